"""What skipping the forwards and backward of a no-signal GRPO update buys on a real model.

A GRPO batch whose every group has equal rewards has an exactly zero loss and gradient; the update then
only steps the optimizer (``evollm.algorithms.updates.optimizer_only_update``). This runs one member on a
config's task for ``--steps`` steps with the skip on and off (same seed), and prints the CPU time of each,
the share of steps without signal, and the final held-out score of both (equal up to float noise).

    python benchmarks/no_signal_skip.py --config benchmarks/hpo/configs/smollm2_short_answers.yaml --steps 60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(cfg, task, skip: bool, steps: int, seed: int, lr: float | None) -> dict:
    from benchmarks.hpo.arms import members_of, with_overrides
    from evollm.algorithms import updates

    updates.SKIP_ZERO_GRADIENT = skip
    sets = ["algorithm.population_size=1", "hpo={}", f"seed={seed}"] + ([f"algorithm.hyperparameters.lr={lr}"] if lr else [])
    task.new_run()
    torch.manual_seed(seed)
    agent = members_of(with_overrides(cfg, sets), task, None)[0]
    started, wall = time.process_time(), time.perf_counter()
    _, record = task.train([agent], seed=seed, max_steps=steps, evaluation_interval=steps)
    cpu, wall = time.process_time() - started, time.perf_counter() - wall
    flat = [r.get("zero_std_groups") == 1.0 for r in record.metric_rows]
    scores = task.report(agent)
    return {"skip": skip, "steps": steps, "cpu_s": cpu, "wall_s": wall, "cpu_s_per_step": cpu / steps,
            "no_signal_share": sum(flat) / max(1, len(flat)),
            "report_score": sum(scores) / len(scores)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="the member's learning rate (default: the library's)")
    p.add_argument("--report-size", type=int, default=None)
    p.add_argument("--out", default=None, help="write the two runs as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    from benchmarks.hpo.task import load_task
    from evollm.config import RunConfig

    cfg = RunConfig.from_yaml(args.config, [])
    task = load_task(cfg, args.report_size)
    out = [run(cfg, task, skip, args.steps, args.seed, args.lr) for skip in (False, True)]
    for r in out:
        print(json.dumps(r))
    print(f"CPU time with the skip / without: {out[1]['cpu_s'] / out[0]['cpu_s']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "runs": out}, indent=1))


if __name__ == "__main__":
    main()
