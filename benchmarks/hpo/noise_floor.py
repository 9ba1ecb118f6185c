"""How far apart two runs of the same setting end: the benchmark's run-to-run noise, from runs already made.

Two population arms run on the same seed often hand the same member to the lone phase: the same founder's
lineage at the same hyperparameters, at the same step (e.g. evollm and selection only, when no mutation
reached the lineage that won the cuts). From there on they differ only in the random numbers their training
drew. The difference of their final report scores is then noise, not a method's effect, and its spread says
how large a paired effect must be before the benchmark can see it on N seeds.

    python -m benchmarks.hpo.noise_floor A[:ARM] B[:ARM] [A2[:ARM] B2[:ARM] ...]

Each source is a parts directory (``DIR`` or ``DIR:ARM``) or a results JSON (``FILE.json:ARM``); ARM defaults
to evollm. Pairs are matched by seed; a pair counts when both runs' first lone evaluation has the same step and
the same hyperparameters.
"""

from __future__ import annotations

import argparse
import math

from benchmarks.hpo.paired import load
from benchmarks.hpo.stats import mean_se


def lone_signature(run: dict) -> tuple | None:
    """``(step, hyperparameters)`` of the run's first evaluation with one live member (a single run's first
    evaluation), or ``None`` when the run never narrowed to one member."""
    for evaluation in run.get("evaluations") or []:
        if len(evaluation.get("members") or []) == 1:
            hps = evaluation["hyperparameters"][0]
            return int(evaluation["step"]), tuple(sorted((k, round(float(v), 12)) for k, v in hps.items()))
    return None


def same_lineage_diffs(a: dict[int, dict], b: dict[int, dict]) -> list[tuple[int, float]]:
    """``(seed, final_a - final_b)`` over the seeds whose runs handed the same member to the lone phase.

    >>> run = lambda lr, score: {"evaluations": [{"step": 10, "members": [1, 2], "hyperparameters": [{}, {}]},
    ...     {"step": 20, "members": [1], "hyperparameters": [{"lr": lr}]}], "checkpoints": [{"score": score}]}
    >>> same_lineage_diffs({0: run(1e-4, 0.7), 1: run(1e-4, 0.5)}, {0: run(1e-4, 0.6), 1: run(2e-4, 0.5)})
    [(0, 0.09999999999999998)]
    """
    out = []
    for seed in sorted(set(a) & set(b)):
        sa, sb = lone_signature(a[seed]), lone_signature(b[seed])
        if sa is not None and sa == sb and a[seed]["checkpoints"] and b[seed]["checkpoints"]:
            out.append((seed, a[seed]["checkpoints"][-1]["score"] - b[seed]["checkpoints"][-1]["score"]))
    return out


def floor_lines(diffs: list[float], seeds: tuple[int, ...] = (10, 20, 30)) -> list[str]:
    """The spread of same-setting differences and the paired standard error it implies on ``seeds`` seeds."""
    if len(diffs) < 2:
        return [f"{len(diffs)} same-lineage pair(s): too few for a spread"]
    mean, se = mean_se(diffs)
    sd = se * math.sqrt(len(diffs))
    lines = [f"{len(diffs)} same-lineage pairs: mean {mean:+.3f} ± {se:.3f}, sd {sd:.3f}, "
             f"|difference| median {sorted(abs(d) for d in diffs)[len(diffs) // 2]:.3f}, max {max(abs(d) for d in diffs):.3f}"]
    lines += [f"  a paired mean over {n} seeds of noise alone has se {sd / math.sqrt(n):.3f} "
              f"(2 se: {2 * sd / math.sqrt(n):.3f})" for n in seeds]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", help="pairs of sources: A B [A2 B2 ...] (DIR[:ARM] or FILE.json[:ARM])")
    args = p.parse_args(argv)
    if len(args.sources) % 2:
        p.error("sources come in pairs: A B [A2 B2 ...]")
    pooled = []
    for spec_a, spec_b in zip(args.sources[::2], args.sources[1::2]):
        (name_a, a), (name_b, b) = load(spec_a), load(spec_b)
        diffs = same_lineage_diffs(a, b)
        print(f"{name_a} - {name_b}: {len(set(a) & set(b))} seeds in both, "
              + ", ".join(f"seed {s}: {d:+.3f}" for s, d in diffs))
        pooled += [d for _, d in diffs]
    print("\n".join(floor_lines(pooled)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
