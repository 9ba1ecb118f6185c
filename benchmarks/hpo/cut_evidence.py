"""Could a stricter first cut keep the default run where it is best, and the search where it wins?

Reads merged HPO benchmark results (``benchmarks.hpo.run --summarise-only`` JSON, with every run) and looks
at each evollm run whose first ranking cut the population to one member while the default founder (the
first founder: the starting hyperparameters) was still in it. For that ranking it prints how far the best
member's held-out score was above the default founder's, in standard errors of the difference (unpaired:
``(best - default) / sqrt(se_best**2 + se_default**2)``; the pairs' own errors are not stored), and the seed's
final score against the default run's.

Then it replays a rule: "keep the default founder unless another member leads it by at least ``k`` standard
errors". On the seeds where that rule would have kept the default founder and the cut did not, the run's
result is replaced by the default run's own final score (difference 0). That is generous to the rule: the
default founder's lineage trains alone with the search's steps taken out, so it ends at or a little below
the default run (on seeds where the cut did keep it, the table's fourth column gives what it ended at).
If even this bound loses on some task, no such threshold keeps the wins and avoids the losses. For every run
it also counts, first, how often the first ranking had nothing to rank on (every member's score equal)::

    python -m benchmarks.hpo.cut_evidence benchmarks/results/hpo_smollm2_everyday_reinforce.json \\
        benchmarks/results/hpo_smollm2_word_facts.json benchmarks/results/hpo_smollm2_short_answers_solved.json
"""
from __future__ import annotations

import argparse
import json
import math
import os

from .stats import fmt_diff, mean_se


def _default_index(run: dict, evaluation: dict) -> int | None:
    """Where the default founder (the run's first founder, the starting hyperparameters) is in ``evaluation``."""
    at = [i for i, hp in enumerate(evaluation["hyperparameters"]) if hp == run["founders"][0]]
    return at[0] if at else None


def first_cuts(results: dict) -> list[dict]:
    """Per evollm seed whose first ranking was a cut to one with the default founder in it: the seed, the lead
    of the best member over the default founder in standard errors (``z``), whether the cut kept the default
    founder, and the final score minus the default run's (``diff``)."""
    default = {r["seed"]: r for r in results["runs"] if r["arm"] == "default"}
    out = []
    for run in results["runs"]:
        if run["arm"] != "evollm" or run["seed"] not in default or not run.get("rankings"):
            continue
        cut, first = run["rankings"][0], run["evaluations"][0]
        if cut["kind"] != "narrowing" or int(cut["size_after"]) != 1 or first["step"] != cut["step"]:
            continue
        d = _default_index(run, first)
        if d is None:
            continue
        fit, se = first["fitness"], first["fitness_se"]
        best = max(range(len(fit)), key=lambda i: (fit[i], i == d))
        err = math.sqrt(se[best] ** 2 + se[d] ** 2)
        z = (fit[best] - fit[d]) / err if err > 0 else 0.0
        # the member the cut kept: the next evaluation's only member (the ranking's best when there is none)
        kept = run["evaluations"][1]["members"][0] if len(run["evaluations"]) > 1 else first["members"][best]
        kept_default = kept == first["members"][d]
        diff = run["checkpoints"][-1]["score"] - default[run["seed"]]["checkpoints"][-1]["score"]
        out.append({"seed": run["seed"], "z": z, "kept_default": kept_default, "diff": diff})
    return out


def first_rankings(results: dict) -> dict:
    """Over every evollm run's first ranking: how many seeds, how many had every member's score equal (nothing
    to rank on), how many had no member above the default founder, the cuts (``"8→2"``: count) and the steps."""
    out = {"seeds": 0, "all_equal": 0, "default_best": 0, "cuts": {}, "steps": set()}
    for run in results["runs"]:
        if run["arm"] != "evollm" or not run.get("rankings") or not run.get("evaluations"):
            continue
        cut, first = run["rankings"][0], run["evaluations"][0]
        d, fit = _default_index(run, first), first["fitness"]
        out["seeds"] += 1
        out["all_equal"] += len(set(fit)) == 1
        out["default_best"] += d is not None and max(fit) <= fit[d]
        key = f"{cut['kind']} {int(cut['size_before'])}→{int(cut['size_after'])}"
        out["cuts"][key] = out["cuts"].get(key, 0) + 1
        out["steps"].add(int(first["step"]))
    return out


def table(name: str, cuts: list[dict], thresholds: tuple[float, ...]) -> list[str]:
    """Markdown rows for one task: evollm − the default run as measured, and with each threshold's rule."""
    kept = [c["diff"] for c in cuts if c["kept_default"]]
    measured = fmt_diff(*mean_se([c["diff"] for c in cuts]))
    row = f"| {name} | {len(cuts)} | {measured} | {len(kept)}: {fmt_diff(*mean_se(kept))} |"
    for k in thresholds:
        flips = [not c["kept_default"] and c["z"] < k for c in cuts]
        replayed = [0.0 if flip else c["diff"] for c, flip in zip(cuts, flips)]
        lost = sum(c["diff"] for c, flip in zip(cuts, flips) if flip)
        row += f" {sum(flips)} ({lost:+.2f}); {fmt_diff(*mean_se(replayed))} |"
    return [row]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="merged results JSON of benchmarks.hpo.run")
    p.add_argument("--thresholds", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    p.add_argument("--seeds", action="store_true", help="also print every seed's cut")
    args = p.parse_args(argv)
    head = "| task | seeds | evollm − default run | cut kept the default founder: seeds, evollm − default run |"
    rule = "".join(f" rule k = {k:g}: seeds it keeps the default (their evollm − default summed); evollm − default run |"
                   for k in args.thresholds)
    lines = [head + rule, "|---|---|---|---|" + "---|" * len(args.thresholds)]
    notes = []
    for path in args.results:
        with open(path) as f:
            results = json.load(f)
        cuts = first_cuts(results)
        name = os.path.basename(path).removeprefix("hpo_").removesuffix(".json")
        lines += table(name, cuts, tuple(args.thresholds))
        f = first_rankings(results)
        notes.append(f"{name}: first ranking at step {', '.join(map(str, sorted(f['steps'])))} "
                     f"({', '.join(f'{k}: {v}' for k, v in f['cuts'].items())}); every member's score equal on "
                     f"{f['all_equal']} seeds of {f['seeds']}, no member above the default founder on {f['default_best']}")
        if args.seeds:
            for c in cuts:
                print(f"{name} seed {c['seed']}: z {c['z']:.2f}, kept default {c['kept_default']}, "
                      f"evollm − default {c['diff']:+.3f}")
    print("\n".join(notes + [""] + lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
