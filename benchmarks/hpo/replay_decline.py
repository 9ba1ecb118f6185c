"""Replays the roll-back's decline rule on stored benchmark runs: on which seeds, and at which step, would a
lone survivor have rolled back, for several ``decline_se`` values? Reads the runs of one arm of a results JSON
(``benchmarks/results/hpo_*.json[:ARM]``) or of a parts folder (``DIR[:ARM]``, ``ARM_seed*.json``; ARM defaults
to evollm). Population runs should be made without roll-backs (``--evo-set hpo.narrowing.rollback=false``) so
that each trajectory is the one the rule would have judged; a single run (the default run, a grid point) never
rolls back, so its trajectory from ``--start`` of its evaluations on stands for a survivor at that rate: where
its final score is good, every roll-back the rule would make there is a false alarm.

The rule is the library's (:func:`evollm.hpo.lone.declined`): the mean of the last three evaluations since the
best state more than a tenth below it and more than ``decline_se`` standard errors of the best state's evaluation
beyond the luck of being the best of the evaluations since the cut (``--no-luck``: without that term, the rule
before 2026-11-29). The standard error of an evaluation is the recorded one (``fitness_se``), or for older runs
the bound of a 0/1 reward, ``sqrt(p (1 - p) / n)`` with n the validation size.

    python -m benchmarks.hpo.replay_decline PARTS_DIR:default PARTS_DIR:grid_lr0.0004 --start 0.2 --z 1.5 3

With ``--kept`` it replays instead which state the run hands back at its end (:func:`returns_kept`).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
from pathlib import Path

from evollm.hpo.lone import DECLINE, STALL_PATIENCE, declined, expected_max_normal


def runs_of(source: str) -> list[dict]:
    """The runs of one arm: ``FILE.json[:ARM]`` or ``DIR[:ARM]`` (ARM defaults to evollm)."""
    if ".json" in source:
        path, _, arm = source.partition(".json")
        arm = arm.lstrip(":") or "evollm"
        return [r for r in json.loads(Path(path + ".json").read_text())["runs"] if r["arm"] == arm]
    folder, _, arm = source.partition(":")
    return [json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{folder}/{arm or 'evollm'}_seed*.json"))]


def first_decline(run: dict, z: float, luck: bool = True, start: float = 0.0) -> tuple[int, float, float] | None:
    """``(step, best, its standard error)`` of the first roll-back the rule would make on ``run``'s lone
    survivor (the best state: its best evaluation since the last cut, or for a single run since ``start`` of its
    evaluations), or ``None``.

    >>> ev = lambda step, f: {"step": step, "members": [1], "fitness": [f], "fitness_se": [0.05]}
    >>> flat = {"validation_size": 64, "evaluations": [ev(10 * i, f) for i, f in enumerate(
    ...     [0.55, 0.55, 0.70, 0.55, 0.55, 0.55])]}  # one lucky 0.70 among flat 0.55
    >>> first_decline(flat, 1.5, luck=False)  # 0.15 below: more than 1.5 se (0.075)
    (50, 0.7, 0.05)
    >>> first_decline(flat, 1.5) is None  # the best of three: (1.5 + 0.846) se = 0.117, and 0.15 is more
    False
    >>> first_decline(flat, 3.0) is None  # (3 + 0.846) se = 0.192
    True
    """
    evals = run["evaluations"]
    if start > 0.0:
        cut = min(int(start * len(evals)), len(evals) - 1)
    else:
        cut = max(i for i, e in enumerate(evals) if i == 0 or len(e["members"]) < len(evals[i - 1]["members"]))
    if len(evals[cut]["members"]) != 1:
        return None
    best, best_se, seen, chosen, after = -math.inf, math.nan, 0, 1, []
    for e in evals[cut:]:
        f = e["fitness"][0]
        seen += 1
        if f > best:
            se = (e.get("fitness_se") or [math.nan])[0]
            if not math.isfinite(se):
                se = math.sqrt(max(f * (1 - f), 0.0) / run["validation_size"])
            best, best_se, chosen, after = f, se, seen, []
            continue
        after.append(f)
        if declined(after, best, STALL_PATIENCE, DECLINE, best_se=best_se, z=z, chosen_from=chosen if luck else 1):
            return e["step"], best, best_se
    return None


def returns_kept(run: dict, luck: bool = True) -> bool:
    """Whether the run's last ranking returns its kept best state (the highest evaluation of the run) instead of
    a live member: the kept fitness, less its luck when ``luck`` (the expected maximum of every evaluation made,
    in its standard errors; :meth:`evollm.run.best_state.KeptBest.beats`), above the live members' last.

    >>> ev = lambda step, fs: {"step": step, "members": list(range(len(fs))), "fitness": fs, "fitness_se": [0.05] * len(fs)}
    >>> flat = {"evaluations": [ev(10, [0.5, 0.4]), ev(20, [0.6])] + [ev(10 * i, [0.52]) for i in range(3, 12)]}
    >>> returns_kept(flat, luck=False), returns_kept(flat)  # 0.60 - 1.59 se (the best of 11) = 0.52: not above
    (True, False)
    """
    best, se, draws = -math.inf, math.nan, 0
    for e in run["evaluations"]:
        scores = e["fitness"]
        errors = e.get("fitness_se") or [math.nan] * len(scores)
        draws += sum(1 for f in scores if f is not None and math.isfinite(f))
        i = max(range(len(scores)), key=lambda k: scores[k])
        if scores[i] >= best:
            best, se = scores[i], errors[i]
    discount = expected_max_normal(max(draws, 1)) * se if luck and math.isfinite(se) else 0.0
    return best - discount > max(run["evaluations"][-1]["fitness"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+")
    parser.add_argument("--z", type=float, nargs="+", default=[0.0, 1.0, 1.5, 2.0])
    parser.add_argument("--no-luck", action="store_true", help="the rule without the best state's luck")
    parser.add_argument("--kept", action="store_true",
                        help="instead: on how many seeds the run returns its kept best state rather than its last, "
                             "with and without the luck discount")
    parser.add_argument("--start", type=float, default=0.0,
                        help="single runs: the share of their evaluations after which the trajectory is judged")
    args = parser.parse_args(argv)
    for source in args.sources:
        runs = runs_of(source)
        if args.kept:
            plain, lucky = (sum(returns_kept(r, luck=x) for r in runs) for x in (False, True))
            print(f"{source}  an older state than the last returned: {plain} of {len(runs)} seeds; "
                  f"less its luck: {lucky}")
            continue
        for z in args.z:
            fired = {r["seed"]: first_decline(r, z, luck=not args.no_luck, start=args.start) for r in runs}
            hits = {s: (step, round(best, 3), round(se, 3)) for s, v in fired.items() if v for step, best, se in [v]}
            print(f"{source}  decline_se {z}{' (no luck term)' if args.no_luck else ''}: "
                  f"{len(hits)} of {len(runs)} seeds  {hits}")


if __name__ == "__main__":
    main()
