"""The issue's two questions, task by task, in one table from several results files.

    python -m benchmarks.hpo.verdicts NAME=FILE.json[:ARM] [NAME=FILE.json[:ARM] ...] [--checkpoints N ...] \
        [--half NAME=HALF.json[:ARM]@FULL.json[:ARM] ...]

``ARM`` names the arm that stands for the library (default ``evollm``; a variant such as ``evollm:fs2`` where the
library as it is ran as a variant beside an older library). Every other competitor arm in the file (the default
run, selection only, the tuners; not the grid, not other variants) is compared with it, paired by seed. Prints a
markdown table: per task, the library − the default run at the end, whether its final score is at least every
competitor's (the first question), its score at half the budget − the default run's final score (the second),
and, where the file holds a post-hoc grid, the best fixed setting's score at half the budget (below 0: no search
that returns one fixed setting can meet the second question there).

The second question has two readings. The checkpoint at half of a full-budget run is the score of a run stopped
half way, whose schedule (the cuts, the decay) was laid out for the whole budget. ``--half`` adds the other: the
library's runs *given* half the budget (``HALF.json``, arm ``ARM``, default ``evollm``), each run's final score
against the default run's final score on the same seed (``FULL.json``, arm ``ARM``, default ``default``: runs of the
same day, as the machine's speed per CPU-second varies from day to day). That is what a user who pays half the
compute gets. "reached by half" is yes when either reading is at or above 0, and says which.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.hpo.paired import load
from benchmarks.hpo.stats import NAMES, fmt_diff, mean_se, summarise


def library_runs(runs: list[dict], arm: str) -> list[dict]:
    """The runs with ``arm`` renamed ``evollm`` and every other evollm arm (the older library, other variants)
    left out.

    >>> rs = [{"arm": "evollm"}, {"arm": "evollm:fs2"}, {"arm": "default"}]
    >>> [r["arm"] for r in library_runs(rs, "evollm:fs2")]
    ['evollm', 'default']
    """
    out = []
    for r in runs:
        if r["arm"] == arm:
            out.append({**r, "arm": "evollm"})
        elif not r["arm"].startswith("evollm"):
            out.append(r)
    return out


def load_arm(source: str, arm: str) -> dict[int, dict]:
    """``{seed: run}`` of one arm of a results file (``FILE.json[:ARM]``, ``arm`` when no ARM is named)."""
    path, _, named = source.partition(".json")
    name, runs = load(f"{path}.json:{named.lstrip(':') or arm}")
    if not runs:
        raise SystemExit(f"{name}: no runs of that arm")
    return runs


def half_run_gap(half: dict[int, dict], full: dict[int, dict]) -> tuple[float, float, int, int, int]:
    """Runs given half the budget against full-budget runs, paired by seed: (mean, se) of each run's final score
    minus the other's, seeds ahead, behind, in all.

    >>> run = lambda score: {"checkpoints": [{"fraction": 1.0, "score": score}]}
    >>> m, se, ahead, behind, n = half_run_gap({0: run(0.6), 1: run(0.5), 2: run(0.7)}, {0: run(0.5), 1: run(0.5)})
    >>> round(m, 3), round(se, 3), ahead, behind, n
    (0.05, 0.05, 1, 0, 2)
    """
    diffs = [half[s]["checkpoints"][-1]["score"] - full[s]["checkpoints"][-1]["score"]
             for s in sorted(set(half) & set(full)) if half[s]["checkpoints"] and full[s]["checkpoints"]]
    m, se = mean_se(diffs)
    return m, se, sum(d > 1e-9 for d in diffs), sum(d < -1e-9 for d in diffs), len(diffs)


def reached_by_half(midway: float, given_half: float | None) -> str:
    """The second question's answer from its two readings (NaN or ``None``: not measured).

    >>> reached_by_half(0.01, None), reached_by_half(0.01, 0.02), reached_by_half(-0.01, 0.0)
    ('yes', 'yes', 'yes (a run given ½)')
    >>> reached_by_half(0.01, -0.02), reached_by_half(-0.01, -0.02), reached_by_half(float("nan"), None)
    ('yes (midway)', 'no', '-')
    """
    if math.isnan(midway) and given_half is None:
        return "-"
    if given_half is None or math.isnan(given_half):
        return "yes" if midway >= 0 else "no"
    if midway >= 0:
        return "yes" if given_half >= 0 else "yes (midway)"
    return "yes (a run given ½)" if given_half >= 0 else "no"


def verdict_row(name: str, runs: list[dict], checkpoints: int, half_run: tuple | None = None) -> str:
    """One markdown row: the task's answers to both questions from its runs (``half_run``: :func:`half_run_gap` of
    the library's runs given half the budget, or ``None``)."""
    summary = summarise(runs, checkpoints)
    arms = summary["arms"]
    if "evollm" not in arms or "default" not in arms:
        return f"| {name} | - | needs evollm and default runs | | | | | | |"
    default = arms["default"]
    m, se = default.get("evollm_minus_arm", (math.nan, math.nan))
    ahead, behind, n = default.get("evollm_ahead", "0/0/0").split("/")
    competitors = [a for a in arms if a not in ("evollm", "grid_best") and not a.startswith("evollm:")
                   and "evollm_minus_arm" in arms[a]]
    behind_of = [a for a in competitors if not arms[a]["evollm_minus_arm"][0] >= 0]
    others = ", ".join(f"{NAMES.get(a, a)} {fmt_diff(*arms[a]['evollm_minus_arm'])}"
                       for a in competitors if a != "default") or "-"
    first = "yes" if not behind_of else "no (" + ", ".join(NAMES.get(a, a) for a in behind_of) + ")"
    half = arms["evollm"].get("half_minus_default_final", (math.nan, math.nan))
    given = "-" if half_run is None else (f"{fmt_diff(*half_run[:2])} ({half_run[2]} ahead, {half_run[3]} behind, "
                                          f"of {half_run[4]})")
    second = reached_by_half(half[0], None if half_run is None else half_run[0])
    fixed = {k: v for k, v in (summary.get("fixed_at_half") or {}).items() if not k.endswith("(default)")}
    best = max(fixed, key=lambda k: fixed[k][0]) if fixed else None
    best_s = f"{fmt_diff(*fixed[best])} ({best.split(':', 1)[1]})" if best else "-"
    return (f"| {name} | {n} | {fmt_diff(m, se)} ({ahead} ahead, {behind} behind) | {others} | {first} "
            f"| {fmt_diff(*half)} | {given} | {second} | {best_s} |")


HEADER = ("| task | seeds | the library − the default run, final | − the other arms in the file "
          "| final ≥ every arm | at ½ the budget − the default's final "
          "| a run given ½ the budget − the default's final | reached by half "
          "| best fixed setting at ½ − the default's final |\n"
          "|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="NAME=FILE.json[:ARM]")
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[4],
                        help="the report checkpoints of each file's runs (one value for all, or one per spec)")
    parser.add_argument("--half", nargs="+", default=[], metavar="NAME=HALF.json[:ARM]@FULL.json[:ARM]",
                        help="the library's runs given half the budget (arm default evollm) and the default runs of "
                             "the same day (arm default default), for the task NAME")
    args = parser.parse_args(argv)
    if len(args.checkpoints) not in (1, len(args.specs)):
        parser.error(f"--checkpoints: give one value or {len(args.specs)} (one per spec), not {len(args.checkpoints)}")
    halves = {}
    for spec in args.half:
        name, sep, pair = spec.partition("=")
        half_src, at, full_src = pair.partition("@")
        if not (sep and at):
            parser.error(f"--half {spec!r}: expected NAME=HALF.json[:ARM]@FULL.json[:ARM]")
        halves[name] = half_run_gap(load_arm(half_src, "evollm"), load_arm(full_src, "default"))
    names = [spec.partition("=")[0] for spec in args.specs]
    if unknown := sorted(set(halves) - set(names)):
        parser.error(f"--half names {unknown}, which no spec has (specs: {names})")
    print(HEADER)
    for i, spec in enumerate(args.specs):
        name, sep, source = spec.partition("=")
        if not sep:
            parser.error(f"{spec!r}: expected NAME=FILE.json[:ARM]")
        path, _, arm = source.partition(".json")
        runs = json.loads(Path(path + ".json").read_text())["runs"]
        checkpoints = args.checkpoints[i if len(args.checkpoints) > 1 else 0]
        print(verdict_row(name, library_runs(runs, arm.lstrip(":") or "evollm"), checkpoints, halves.get(name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
