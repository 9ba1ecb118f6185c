"""One training step of the SmolLM2 demo (configs/smollm2_arithmetic.yaml), split into generation
and learning, for N members on the one shared SmolLM2-135M-Instruct base.

Each population size runs in this process alone (run the script once per size, so peak RSS does
not carry over). Per step it records wall time and process CPU time (``time.process_time``) of the
batched generate and of the (fused) learn, and at the end the peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``) and the load average (the machine is shared: compare CPU
times, and wall times only between runs taken at the same load).

Usage: ``python benchmarks/smollm2_demo_members.py --members 4 [--steps 3] [--threads 1]``
Writes ``benchmarks/results/smollm2_demo_members_<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2_arithmetic.yaml"


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from evollm.recipes.cli import build_population
    from evollm.config import RunConfig
    from evollm.recipes.builders import build_hpo, build_model, build_task
    from evollm.envs.reasoning import ReasoningGym
    from evollm.rollout import generate_population
    from evollm.training.loop import learn_all

    cfg = RunConfig.from_yaml(CONFIG, [f"algorithm.population_size={args.members}", "train.evo_steps=null",
                                       "hpo={}"])  # no selection here: one step is timed
    torch.manual_seed(cfg.seed)
    (model, tok), load_wall, load_cpu = _timed(lambda: build_model(cfg.model, cfg.seed))
    hp_config, _, _ = build_hpo(cfg)
    members = build_population(cfg, model, tok, hp_config)
    train, test, reward, template = build_task(cfg.task, cfg.seed)
    env = ReasoningGym(train, test, tok, reward, template, data_batch_size_per_gpu=cfg.env.data_batch_size_per_gpu)
    steps = []
    for _ in range(args.steps):
        prompts = env.reset()
        rollouts, g_wall, g_cpu = _timed(lambda: generate_population(members, prompts))
        experiences = []
        for agent in members:
            completions, masks = rollouts[agent.index].per_prompt()
            experiences.append((completions, masks, env.score(completions, prompts)))
        env.step_to_next_batch()
        metrics, l_wall, l_cpu = _timed(lambda: learn_all(members, experiences))
        steps.append(dict(generate_wall_s=g_wall, generate_cpu_s=g_cpu, learn_wall_s=l_wall, learn_cpu_s=l_cpu,
                          mean_reward=statistics.mean(m["mean_reward"] for m in metrics),
                          seq_len=int(rollouts[members[0].index].sequences.shape[1])))
        print(json.dumps(steps[-1]), flush=True)
    later = steps[1:] or steps  # the first step pays one-off costs (allocator, kernels)
    result = dict(
        members=args.members, threads=args.threads, steps=steps, load_wall_s=load_wall, load_cpu_s=load_cpu,
        median={k: statistics.median(s[k] for s in later)
                for k in ("generate_wall_s", "generate_cpu_s", "learn_wall_s", "learn_cpu_s")},
        rows_per_member=cfg.env.data_batch_size_per_gpu * cfg.algorithm.hyperparameters["group_size"],
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, loadavg=os.getloadavg(),
        torch=torch.__version__, python=platform.python_version(), cpus=os.cpu_count(),
        when=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"smollm2_demo_members_{args.members}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("members", "median", "peak_rss_mb", "loadavg")}))


if __name__ == "__main__":
    main()
