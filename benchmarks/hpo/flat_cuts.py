"""How often does a cut find every member's score equal while it still leaves more than one member?

Such a cut has nothing to rank on: the tie-break (the default founder's lineage first) chooses, and the rungs
after it cost that lineage steps. Reads merged HPO benchmark results (``benchmarks.hpo.run`` JSON with every
run; a run kept in several files counts once) and prints, per task (the file name's first two words), the evollm
runs' narrowing cuts, the flat ones among them that left more than one member, the runs with such a cut and, of
those, the runs whose returned member trains at exactly the default founder's learning rate::

    python -m benchmarks.hpo.flat_cuts benchmarks/results/hpo_*.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict


def flat_cuts(paths: list[str]) -> dict[str, dict[str, int]]:
    """``{task: {"cuts", "flat", "runs", "at_default"}}`` over the evollm runs (every variant) of ``paths``."""
    seen, out = set(), defaultdict(lambda: {"cuts": 0, "flat": 0, "runs": 0, "at_default": 0})
    for path in paths:
        try:
            runs = json.load(open(path)).get("runs") or []
        except (ValueError, AttributeError, OSError):
            continue  # not a results file of the harness
        task = "_".join(os.path.basename(path).removeprefix("hpo_").removesuffix(".json").split("_")[:2])
        for run in runs:
            key = (task, run.get("arm"), run.get("seed"), run.get("steps"), run.get("git"), run.get("cpu_s"))
            if not str(run.get("arm", "")).startswith("evollm") or key in seen:
                continue
            seen.add(key)
            cuts = [r for r in run.get("rankings") or [] if r.get("kind") == "narrowing"]
            flat = [r for r in cuts if r.get("spread") == 0 and r["size_after"] > 1]
            row = out[task]
            row["cuts"] += len(cuts)
            row["flat"] += len(flat)
            if flat:
                row["runs"] += 1
                start, final = run["founders"][0], (run.get("final_members") or [{}])[0]
                rates = [k for k in start if "lr" in k and k in final]
                row["at_default"] += bool(rates) and all(math.isclose(final[k], start[k]) for k in rates)
    return dict(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="results JSON files of benchmarks.hpo.run")
    counts = flat_cuts(p.parse_args(argv).results)
    print("| task | narrowing cuts | flat, leaving more than one | runs with one | of those, returned at the default rate |")
    print("|---|---|---|---|---|")
    for task, row in sorted(counts.items()):
        print(f"| {task} | {row['cuts']} | {row['flat']} | {row['runs']} | {row['at_default']} |")


if __name__ == "__main__":
    main()
