"""The issue's two questions, task by task, in one table from several results files.

    python -m benchmarks.hpo.verdicts NAME=FILE.json[:ARM] [NAME=FILE.json[:ARM] ...] [--checkpoints N ...]

``ARM`` names the arm that stands for the library (default ``evollm``; a variant such as ``evollm:fs2`` where the
library as it is ran as a variant beside an older library). Every other competitor arm in the file (the default
run, selection only, the tuners; not the grid, not other variants) is compared with it, paired by seed. Prints a
markdown table: per task, the library − the default run at the end, whether its final score is at least every
competitor's (the first question), its score at half the budget − the default run's final score (the second),
and, where the file holds a post-hoc grid, the best fixed setting's score at half the budget (below 0: no search
that returns one fixed setting can meet the second question there).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.hpo.stats import NAMES, fmt_diff, summarise


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


def verdict_row(name: str, runs: list[dict], checkpoints: int) -> str:
    """One markdown row: the task's answers to both questions from its runs."""
    summary = summarise(runs, checkpoints)
    arms = summary["arms"]
    if "evollm" not in arms or "default" not in arms:
        return f"| {name} | - | needs evollm and default runs | | | | |"
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
    second = "-" if math.isnan(half[0]) else "yes" if half[0] >= 0 else "no"
    fixed = {k: v for k, v in (summary.get("fixed_at_half") or {}).items() if not k.endswith("(default)")}
    best = max(fixed, key=lambda k: fixed[k][0]) if fixed else None
    best_s = f"{fmt_diff(*fixed[best])} ({best.split(':', 1)[1]})" if best else "-"
    return (f"| {name} | {n} | {fmt_diff(m, se)} ({ahead} ahead, {behind} behind) | {others} | {first} "
            f"| {fmt_diff(*half)} | {second} | {best_s} |")


HEADER = ("| task | seeds | the library − the default run, final | − the other arms in the file | final ≥ every arm "
          "| at ½ the budget − the default's final | reached by half | best fixed setting at ½ − the default's final |\n"
          "|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="NAME=FILE.json[:ARM]")
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[4],
                        help="the report checkpoints of each file's runs (one value for all, or one per spec)")
    args = parser.parse_args(argv)
    if len(args.checkpoints) not in (1, len(args.specs)):
        parser.error(f"--checkpoints: give one value or {len(args.specs)} (one per spec), not {len(args.checkpoints)}")
    print(HEADER)
    for i, spec in enumerate(args.specs):
        name, sep, source = spec.partition("=")
        if not sep:
            parser.error(f"{spec!r}: expected NAME=FILE.json[:ARM]")
        path, _, arm = source.partition(".json")
        runs = json.loads(Path(path + ".json").read_text())["runs"]
        checkpoints = args.checkpoints[i if len(args.checkpoints) > 1 else 0]
        print(verdict_row(name, library_runs(runs, arm.lstrip(":") or "evollm"), checkpoints))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
