"""Paired comparison of two arms kept in different parts directories: e.g. evollm with an evolution
setting changed (``--evo-set``) against evollm as it is, run side by side into two parts directories.

    python -m benchmarks.hpo.paired A_DIR[:ARM] B_DIR[:ARM] [--checkpoints 4]

(a results JSON of ``benchmarks.hpo.run`` works as a source too: ``FILE.json:ARM``)

prints, over the seeds both hold, A − B at each report checkpoint (paired mean ± se, ahead / behind), A − B at
each run's last checkpoint whatever its budget (A given half B's budget: does A reach B's final score in half
its compute?), the steps each made, and the hyperparameters A returned. ARM defaults to evollm.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.hpo.stats import curve, fmt_diff, mean_se


def load(spec: str) -> tuple[str, dict[int, dict]]:
    """``{seed: run}`` of one arm of a parts directory (``DIR`` or ``DIR:ARM``; a variant ``DIR:evollm:NAME``) or
    of a results JSON (``FILE.json[:ARM]``)."""
    if ".json" in spec:
        source, _, arm = spec.partition(".json")
        arm = arm.lstrip(":") or "evollm"
        runs = json.loads(Path(source + ".json").read_text())["runs"]
        return f"{source}.json:{arm}", {int(r["seed"]): r for r in runs if r["arm"] == arm}
    folder, _, arm = spec.partition(":")
    arm = arm or "evollm"
    runs = {}
    stem = arm.replace(":", "_").replace("=", "")  # as the harness names the file (evollm:tie -> evollm_tie)
    for path in sorted(Path(folder).glob(f"{stem}_seed*.json")):
        run = json.loads(path.read_text())
        runs[int(run["seed"])] = run
    return f"{folder}:{arm}", runs


def _paired(diffs: list[float]) -> str:
    """``A − B mean ± se (A ahead n, behind m, of k)`` of paired differences."""
    ahead, behind = sum(d > 1e-9 for d in diffs), sum(d < -1e-9 for d in diffs)
    return f"A − B {fmt_diff(*mean_se(diffs))} (A ahead {ahead}, behind {behind}, of {len(diffs)})"


def compare(a: dict[int, dict], b: dict[int, dict], checkpoints: int) -> list[str]:
    seeds = sorted(set(a) & set(b))
    ca = {s: curve(a[s], checkpoints) for s in seeds}
    cb = {s: curve(b[s], checkpoints) for s in seeds}
    lines = [f"seeds: {seeds}"]
    for k in range(checkpoints):
        diffs = [ca[s][k] - cb[s][k] for s in seeds if ca[s][k] is not None and cb[s][k] is not None]
        lines.append(f"at {k + 1}/{checkpoints} of the budget: {_paired(diffs)}")
    finals = [a[s]["checkpoints"][-1]["score"] - b[s]["checkpoints"][-1]["score"] for s in seeds
              if a[s]["checkpoints"] and b[s]["checkpoints"]]
    budgets = " against ".join(str(sorted({x[s].get("budget_cpu_s") for s in seeds})) for x in (a, b))
    lines.append(f"each run's last checkpoint (budgets {budgets} s): {_paired(finals)}")
    lines.append("finals A / B: " + ", ".join(f"{s}: {ca[s][-1]:.3f}/{cb[s][-1]:.3f}" for s in seeds
                                              if ca[s][-1] is not None and cb[s][-1] is not None))
    lines.append("steps A / B: " + ", ".join(f"{a[s]['steps']}/{b[s]['steps']}" for s in seeds))
    lines.append("A returned: " + "; ".join(
        ", ".join(f"{k}={v:.2g}" for k, v in sorted((a[s].get("recommended_hyperparameters") or {}).items()))
        for s in seeds))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="parts directory of arm A (DIR or DIR:ARM)")
    p.add_argument("b", help="parts directory of arm B (DIR or DIR:ARM)")
    p.add_argument("--checkpoints", type=int, default=4, help="the runs' --checkpoints")
    args = p.parse_args(argv)
    name_a, a = load(args.a)
    name_b, b = load(args.b)
    print(f"A = {name_a} ({len(a)} runs), B = {name_b} ({len(b)} runs)")
    print("\n".join(compare(a, b, args.checkpoints)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
