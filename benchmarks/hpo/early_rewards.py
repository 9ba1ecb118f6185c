"""When do learning rates separate? Members at fixed learning rates train side by side on the same
prompts (one population, no selection), and the per-step training rewards and their running means are
printed: what a narrowing that ranks on training rewards sees at each step.

    python -m benchmarks.hpo.early_rewards --config benchmarks/hpo/configs/smollm2_short_answers.yaml \\
        --lr 5e-5 5e-4 2e-5 1.5e-4 --steps 12
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a benchmark task config (benchmarks/hpo/configs/)")
    parser.add_argument("--lr", type=float, nargs="+", required=True, help="one member per learning rate")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from evollm.config import RunConfig

    from .arms import LR_NAMES, members_of, with_overrides
    from .task import load_task

    cfg = RunConfig.from_yaml(args.config, [])
    torch.set_num_threads(int(cfg.threads or 1))
    task = load_task(cfg)
    members = members_of(with_overrides(cfg, [f"algorithm.population_size={len(args.lr)}", "hpo={}"]), task, None)
    for member, lr in zip(members, args.lr):
        for name in LR_NAMES:
            if name in member.mutable_hyperparameters():
                member.set_hyperparameter(name, lr)
    started = time.process_time()
    _, record = task.train(members, seed=args.seed, max_steps=args.steps, evaluation_interval=10**9)
    table = record.metrics().pivot_table(index="step", columns="member", values="mean_reward")
    table.columns = [f"lr={lr:g}" for lr in args.lr]
    print("training reward per step (same prompts for every member):")
    print(table.round(3).to_string())
    print("\nrunning mean (what fitness: train ranks on, window permitting):")
    print(table.expanding().mean().round(3).to_string())
    print(f"\n{time.process_time() - started:.0f} CPU-s")


if __name__ == "__main__":
    main()
