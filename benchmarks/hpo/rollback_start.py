"""Roll-backs whose best state had learnt nothing, in stored benchmark results: the kept state's held-out score
not above the run's starting level (the median of its first evaluation) by ``--z`` of the state's standard error,
the roll-backs the library no longer makes (``evollm/training/revival.py``, ``roll_back_declined``).

    python -m benchmarks.hpo.rollback_start benchmarks/results/hpo_*.json [--z 1.5]
"""
import argparse
import json
import math
import statistics


def state_stderr(run: dict, member: int, step: int) -> float:
    """The standard error of ``member``'s evaluation at ``step`` (NaN when not recorded)."""
    for e in run.get("evaluations") or []:
        if e["step"] == step and member in e["members"] and e.get("fitness_se"):
            return float(e["fitness_se"][e["members"].index(member)])
    return math.nan


def from_the_start(run: dict, z: float) -> list[tuple[int, float, float]]:
    """``(step, start, best)`` of each of ``run``'s roll-backs whose best state was within ``z`` standard errors of
    the starting level. The state's member is the one whose earlier evaluation scored ``best``, and its standard
    error the smallest of that member's evaluations (the records keep the state's score, not its member; the
    smallest standard error counts the fewest roll-backs)."""
    evaluations = run.get("evaluations") or []
    if not evaluations:
        return []
    start = statistics.median(evaluations[0]["fitness"])
    out = []
    for v in run.get("revivals") or []:
        if v.get("reason") != "rollback":
            continue
        scores = dict(x.split(":") for x in v["scores"].split())
        best = float(scores[v["kept"]])
        source = next((e["members"][e["fitness"].index(f)] for e in evaluations for f in e["fitness"]
                       if abs(f - best) < 1e-4 and e["step"] < v["step"]), None)
        se = math.nan if source is None else min(
            (state_stderr(run, source, e["step"]) for e in evaluations if source in e["members"]), default=math.nan)
        learnt = best - start > 0 and (not math.isfinite(se) or best - start >= z * se)
        if not learnt:
            out.append((int(v["step"]), start, best))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="benchmark results JSON files")
    parser.add_argument("--z", type=float, default=1.5, help="standard errors above the start (decline_se)")
    args = parser.parse_args(argv)
    total = 0
    for path in args.results:
        try:
            runs = json.load(open(path)).get("runs") or []
        except (ValueError, AttributeError):
            continue
        for run in runs:
            if not str(run.get("arm", "")).startswith("evollm"):
                continue
            for step, start, best in from_the_start(run, args.z):
                total += 1
                print(f"{path}: {run['arm']} seed {run['seed']} step {step}: best state {best:.3f}, start {start:.3f}")
    print(f"{total} roll-backs from a state at the starting level")


if __name__ == "__main__":
    main()
