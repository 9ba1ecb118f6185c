"""Evolve a population of LLMREINFORCE agents on single-turn arithmetic with the tiny offline model.

    python examples/reinforce_reasoning.py configs/reinforce_reasoning.yaml [--set train.max_steps=20 ...]

Same as ``evollm train configs/reinforce_reasoning.yaml``: prints the greedy exact-match accuracy on
the fixed test questions before training (the warm start) and after (best member) and the wall time,
and writes the report, lineage, plots and the best member's adapter to ``output_dir``.
Torch threads: ``$EVOLLM_THREADS`` (default 1: the tiny model gains nothing from more, and extra
threads are much slower when the cores are shared).
"""

from __future__ import annotations

import argparse
import os

import torch

from evollm.recipes.cli import train


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/reinforce_reasoning.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="e.g. train.max_steps=20")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("EVOLLM_THREADS", 1)))
    return train(args.config, args.overrides, quiet=True)


if __name__ == "__main__":
    main()
