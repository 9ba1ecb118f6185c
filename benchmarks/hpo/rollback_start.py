"""Roll-backs whose best state had learnt nothing, in stored benchmark results: the kept state's held-out score
not above the run's starting level (the median of its first evaluation) by ``--z`` of the state's standard error,
the roll-backs the library no longer makes (``evollm/training/revival.py``, ``roll_back_declined``).

    python -m benchmarks.hpo.rollback_start benchmarks/results/hpo_*.json [--z 1.5]
"""
import argparse
import json
import math
import statistics

from evollm.hpo.horizon import learnt


def kept_stderr(evaluations: list[dict], best: float, before: int) -> float:
    """The standard error of the evaluation that scored ``best`` before step ``before`` (the records keep the kept
    state's score, not its step): NaN when none is recorded."""
    for e in evaluations:
        for i, f in enumerate(e["fitness"]):
            if abs(f - best) < 1e-4 and e["step"] < before:
                return float(e["fitness_se"][i]) if e.get("fitness_se") else math.nan
    return math.nan


def from_the_start(run: dict, z: float) -> list[tuple[int, float, float]]:
    """``(step, start, best)`` of each of ``run``'s roll-backs whose best state was within ``z`` standard errors of
    the starting level (above it by anything when its standard error is unknown, as ``evollm.hpo.horizon.learnt``)."""
    evaluations = run.get("evaluations") or []
    if not evaluations:
        return []
    start = statistics.median(evaluations[0]["fitness"])
    out = []
    for v in run.get("revivals") or []:
        if v.get("reason") != "rollback":
            continue
        best = float(dict(x.split(":") for x in v["scores"].split())[v["kept"]])
        if not learnt([best], [kept_stderr(evaluations, best, int(v["step"]))], start, z):
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
