"""How much signal the rankings of a population arm had: unpaired against paired signal-to-noise.

Reads the ``rankings`` that ``benchmarks.hpo.run`` stores with each population run (every selection and
narrowing, with ``snr``: the spread of the scores over their standard errors, and ``paired_snr``: the same
over the standard error of the differences between members paired over the test questions they all
answered) and prints, per kind of ranking (a narrowing from 8 members to 4, a selection among 2, ...), the
median of each and how many rankings each calls mostly noise (below 1)::

    python -m benchmarks.hpo.ranking_noise TASK=PARTS_DIR[:ARM] [TASK=PARTS_DIR[:ARM] ...]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
from collections import defaultdict

import numpy as np


def rankings(parts: str, arm: str = "evollm") -> list[list[dict]]:
    """The rankings of every seed's run of ``arm`` in ``parts`` (runs without them are left out)."""
    out = []
    for path in sorted(glob.glob(os.path.join(parts, f"{arm}_seed*.json"))):
        with open(path) as f:
            run = json.load(f)
        if run.get("rankings"):
            out.append(run["rankings"])
    return out


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.median(values)) if values else math.nan


def table(runs: list[list[dict]]) -> list[str]:
    """One markdown row per kind of ranking (a narrowing 8→4, a selection among 2, ...; the largest first,
    narrowings before selections): how many rankings of that kind the runs made, the median of their snr and
    paired_snr, and how many of them each calls mostly noise (below 1)."""
    by_kind = defaultdict(list)
    for run in runs:
        for r in run:
            by_kind[(r["kind"], int(r["size_before"]), int(r["size_after"]))].append(r)
    lines = ["| ranking | rankings | median snr | median paired snr | snr < 1 | paired snr < 1 |",
             "|---|---|---|---|---|---|"]
    below = lambda vs: sum(1 for v in vs if v is not None and math.isfinite(v) and v < 1)
    known = lambda vs: sum(1 for v in vs if v is not None and math.isfinite(v))
    for (kind, before, after), rows in sorted(by_kind.items(), key=lambda kv: (-kv[0][1], kv[0][0] != "narrowing",
                                                                                -kv[0][2])):
        snr = [r.get("snr") for r in rows]
        paired = [r.get("paired_snr") for r in rows]
        lines.append(f"| {kind} {before}→{after} | {len(rows)} | {_median(snr):.2f} | {_median(paired):.2f} | "
                     f"{below(snr)}/{known(snr)} | {below(paired)}/{known(paired)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", help="TASK=PARTS_DIR[:ARM] (arm: evollm by default)")
    args = parser.parse_args(argv)
    for source in args.sources:
        task, _, where = source.partition("=")
        parts, _, arm = where.partition(":")
        print(f"\n{task} ({parts}, arm {arm or 'evollm'})\n")
        print("\n".join(table(rankings(parts, arm or "evollm"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
