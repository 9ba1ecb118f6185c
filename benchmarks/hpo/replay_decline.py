"""Replays the roll-back's decline rule on stored benchmark runs: on which seeds, and at which step, would a
lone survivor have rolled back, for several ``decline_se`` values? Reads the evollm runs of a results JSON
(``benchmarks/results/hpo_*.json``) or of a parts folder (``evollm_seed*.json``), made without roll-backs
(``--evo-set hpo.narrowing.rollback=false``) so that each trajectory is the one the rule would have judged.

The standard error of an evaluation is the recorded one (``fitness_se``, in runs made since it is recorded);
for older runs, the bound of a 0/1 reward, ``sqrt(p (1 - p) / n)`` with n the validation size (exact for the
game, whose reward is 0 or 1; an overestimate for partial credit).

    python -m benchmarks.hpo.replay_decline benchmarks/results/hpo_guess_number_ppo_rollback_off.json PARTS_DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import math
from pathlib import Path

from evollm.hpo.lone import DECLINE, STALL_PATIENCE, declined


def evollm_runs(source: str) -> list[dict]:
    if source.endswith(".json"):
        return [r for r in json.loads(Path(source).read_text())["runs"] if r["arm"] == "evollm"]
    return [json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{source}/evollm_seed*.json"))]


def first_decline(run: dict, z: float) -> tuple[int, float, float] | None:
    """``(step, best, its standard error)`` of the first roll-back the rule would make on ``run``'s lone
    survivor (the best state: its best evaluation since the last cut), or ``None``."""
    evals = run["evaluations"]
    cut = max(i for i, e in enumerate(evals) if i == 0 or len(e["members"]) < len(evals[i - 1]["members"]))
    if len(evals[cut]["members"]) != 1:
        return None
    best, best_se, after = -math.inf, math.nan, []
    for e in evals[cut:]:
        f = e["fitness"][0]
        if f > best:
            se = (e.get("fitness_se") or [math.nan])[0]
            if not math.isfinite(se):
                se = math.sqrt(max(f * (1 - f), 0.0) / run["validation_size"])
            best, best_se, after = f, se, []
            continue
        after.append(f)
        if declined(after, best, STALL_PATIENCE, DECLINE, best_se=best_se, z=z):
            return e["step"], best, best_se
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+")
    parser.add_argument("--z", type=float, nargs="+", default=[0.0, 1.0, 1.5, 2.0])
    args = parser.parse_args()
    for source in args.sources:
        runs = evollm_runs(source)
        for z in args.z:
            fired = {r["seed"]: first_decline(r, z) for r in runs}
            hits = {s: (step, round(best, 3), round(se, 3)) for s, v in fired.items() if v for step, best, se in [v]}
            print(f"{Path(source).name}  decline_se {z}: {len(hits)} of {len(runs)} seeds  {hits}")


if __name__ == "__main__":
    main()
