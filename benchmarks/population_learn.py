"""CPU seconds of a population's training steps, its members updated together (the fused update: one routed
forward and backward per minibatch for all members) against one by one (``learn_chunk_members=1``), for any
run config whose algorithm has a fused update (LLMPPO, LLMREINFORCE, GRPO). The default is LLMPPO on the game
(guess-the-number, the tiny multi-turn model). Each path runs ``--reps`` times, alternating, from the same
founders. Steps without a learning signal (``learn_path: no_gradient``) run neither path and are counted.

    python benchmarks/population_learn.py --members 8 --steps 6 --reps 2
    python benchmarks/population_learn.py --config benchmarks/hpo/configs/tiny_arithmetic_reinforce.yaml
    python benchmarks/population_learn.py --device cuda   # on a GPU: wall seconds, synchronised

On CPU the figure is CPU seconds (``time.process_time``); with ``--device cuda`` the shared base (and so every
adapter) is on the GPU and the figure is wall seconds after ``torch.cuda.synchronize``, since a GPU's work is
not the process's CPU time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="benchmarks/hpo/configs/guess_number_ppo.yaml")
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--device", default="cpu", help="'cpu' (CPU seconds) or 'cuda' (wall seconds, synchronised)")
    p.add_argument("--out", default=None, help="a JSON of every timing")
    args = p.parse_args()
    torch.set_num_threads(1)
    from benchmarks.hpo.arms import members_of, with_overrides
    from benchmarks.hpo.task import load_task
    from evollm.config import RunConfig

    cfg = RunConfig.from_yaml(args.config, [])
    task = load_task(cfg, 16)
    if args.device != "cpu":
        task.model.to(args.device)

    def clock() -> float:
        if args.device == "cpu":
            return time.process_time()
        torch.cuda.synchronize()
        return time.perf_counter()
    unit = "CPU-s" if args.device == "cpu" else f"wall-s on {args.device}"
    paths = {"fused": "null", "member_by_member": "1"}
    times: dict[str, list[float]] = {k: [] for k in paths}
    idle: dict[str, list[float]] = {k: [] for k in paths}
    for rep in range(args.reps):
        for name in (list(paths) if rep % 2 == 0 else list(paths)[::-1]):
            run_cfg = with_overrides(cfg, [f"algorithm.population_size={args.members}",
                                           f"algorithm.hyperparameters.learn_chunk_members={paths[name]}"])
            torch.manual_seed(0)
            pop = members_of(run_cfg, task, None)
            c0 = clock()
            agents, record = task.train(pop, 0, max_steps=args.steps, evaluation_interval=10**6)
            times[name].append(clock() - c0)
            ran = list(record.metrics()["learn_path"])
            assert set(ran) - {"no_gradient"} == {name}, (name, set(ran))
            idle[name].append(ran.count("no_gradient") / len(ran))
            for agent in agents:
                agent.release()
            print(f"{name}: {times[name][-1]:.2f} {unit} for {args.steps} steps of {args.members} members "
                  f"({idle[name][-1]:.0%} of the member steps without signal)", flush=True)
    means = {k: statistics.mean(v) for k, v in times.items()}
    print(f"fused / member by member: {means['fused'] / means['member_by_member']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "members": args.members, "steps": args.steps,
                                              "device": args.device, "unit": unit,
                                              ("cpu_s" if args.device == "cpu" else "wall_s"): times, "no_gradient_share": idle,
                                              "ratio": means["fused"] / means["member_by_member"]},
                                             indent=1))


if __name__ == "__main__":
    main()
