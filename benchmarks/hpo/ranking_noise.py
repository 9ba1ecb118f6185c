"""How much signal the rankings of a population arm had: unpaired against paired signal-to-noise.

Reads the ``rankings`` that ``benchmarks.hpo.run`` stores with each population run (every selection and
narrowing, with ``snr``: the spread of the scores over their standard errors, and ``paired_snr``: the same
over the standard error of the differences between members paired over the test questions they all
answered) and prints, per ranking in order (the first narrowing, the second, ...), the median of each and
how many rankings each calls mostly noise (below 1)::

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
    """One markdown row per ranking position: which cut (sizes), how many runs had it, median snr and
    paired_snr, and the share of rankings below 1 by each."""
    by_position = defaultdict(list)
    for run in runs:
        for i, r in enumerate(run):
            by_position[i].append(r)
    lines = ["| ranking | kind (sizes) | runs | median snr | median paired snr | snr < 1 | paired snr < 1 |",
             "|---|---|---|---|---|---|---|"]
    for i, rows in sorted(by_position.items()):
        kinds = sorted({f"{r['kind']} {r['size_before']}→{r['size_after']}" for r in rows})
        snr = [r.get("snr") for r in rows]
        paired = [r.get("paired_snr") for r in rows]
        below = lambda vs: sum(1 for v in vs if v is not None and math.isfinite(v) and v < 1)
        known = lambda vs: sum(1 for v in vs if v is not None and math.isfinite(v))
        lines.append(f"| {i + 1} | {', '.join(kinds)} | {len(rows)} | {_median(snr):.2f} | {_median(paired):.2f} | "
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
