"""Which evolution settings should be evollm's defaults? Paired runs at equal CPU time on the tiny task.

The task is the demo's (warm-started tiny model, 1-2 digit addition, exact match, 8 prompts x group 8
per step, batch 32, LoRA r=8) but WITHOUT the demo's tuned search space: every population variant
evolves the library's default search space (LoRA learning rate, log-uniform; 1e-5..1e-2 when measured, QMC founders),
and the single run uses the library's default GRPO settings (lr 5e-5). Variants:

* ``single``: one member at the library defaults (what a user gets with population_size 1);
* ``pbt``: 8 members, tournament (2, elitism) every 10 steps on the last held-out fitness, every clone
  mutated (perturb x0.8/x1.2), evaluation every 5 steps;
* ``narrow``: ``pbt`` + narrowing 8 -> 4 -> 2 at 25 % and 50 % of the budget;
* ``narrow_train``: ``narrow`` ranking on the running mean of the last 10 steps' training rewards,
  held-out evaluation only every 20 steps (cheaper);
* ``narrow_pb2``: ``narrow`` + half the mutations proposed by a GP fitted on the population's history;
* ``default``: whatever the library's YAML defaults are now, with population 8 and evo_steps 10.

Every run gets ``--budget`` CPU seconds of its own process (``train.max_time`` on the ``cpu`` clock,
evaluations included; one torch thread) and stops after the step that crosses it, with a final
evaluation. Score: the final best member (by its last held-out fitness on the 200 test questions the
run selects on) evaluated on ``--final-n`` fresh questions of a different seed (no selection bias).
Paired by seed: every variant of a seed has the same base, data order and sampling seeds.

Usage::

    python benchmarks/evolution_defaults.py --budget 60 --seeds 0 1 2 3 --jobs 4

Writes ``benchmarks/results/evolution_defaults.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

BASE = {
    "threads": 1,
    "model": {"source": "tiny", "warm_start": True},
    "task": {"name": "arithmetic", "n_train": 2000, "n_test": 200, "ops": ["+"], "digits": [1, 2],
             "reward": "exact_match"},
    "env": {"type": "reasoning", "data_batch_size_per_gpu": 8},
    "algorithm": {"name": "GRPO", "population_size": 8, "lora": {"r": 8, "lora_alpha": 16},
                  "hyperparameters": {"group_size": 8, "batch_size": 32, "max_output_tokens": 5}},
    "train": {"max_steps": 100000, "evaluation_interval": 5, "evo_steps": 10, "max_time_clock": "cpu"},
    "logging": {"tensorboard": False, "plots": False},
}
PBT = {"mutation": {"no_mutation": 0.0, "rl_hp": 1.0}, "selection": {"fitness": "last"}, "narrowing": {"at": []}}
VARIANTS = {
    "single": {"algorithm.population_size": 1, "train.evo_steps": None, "hpo": {}},
    "pbt": {"hpo": PBT},
    "narrow": {"hpo": {**PBT, "narrowing": {"at": [0.25, 0.5]}}},
    "narrow_train": {"hpo": {**PBT, "narrowing": {"at": [0.25, 0.5]}, "selection": {"fitness": "train"}},
                     "train.evaluation_interval": 20},
    "narrow_pb2": {"hpo": {**PBT, "narrowing": {"at": [0.25, 0.5]},
                           "mutation": {"no_mutation": 0.0, "rl_hp": 1.0, "model_prob": 0.5}}},
    "default": {"hpo": {}},
}


def config(variant: str, seed: int, budget: float, out: str) -> dict:
    import copy
    cfg = copy.deepcopy(BASE)
    cfg.update(seed=seed, output_dir=out)
    cfg["train"]["max_time"] = budget
    for key, value in VARIANTS[variant].items():
        if "." in key:
            section, name = key.split(".")
            cfg[section][name] = value
        else:
            cfg[key] = value
    if cfg["train"]["evo_steps"] is None:
        cfg["train"].pop("evo_steps")
    return cfg


def run_one(variant: str, seed: int, budget: float, final_n: int, out: str) -> dict:
    """One run in this process: train under the budget, then score the best member on fresh questions."""
    import torch
    from evollm.config import RunConfig
    from evollm.envs.reasoning import ReasoningGym
    from evollm.models.loading import set_threads
    from evollm.recipes.builders import build_hpo, build_model, build_narrowing
    from evollm.recipes.cli import build_population
    from evollm.recipes.runners import run_reasoning
    from evollm.rollout import evaluate_population
    from evollm.tasks.user import task_parts

    cfg = RunConfig.from_dict(config(variant, seed, budget, out))
    set_threads(1)
    torch.manual_seed(seed)
    model, tok = build_model(cfg.model, seed)
    hp, mutation, selection = build_hpo(cfg)
    members = build_population(cfg, model, tok, hp)
    settings = cfg.train.loop_settings(out, seed, verbose=False).replace(
        narrowing=build_narrowing(cfg), max_time_clock="cpu", checkpoint_dir=None, save_elite=False)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = run_reasoning(cfg, members, tok, settings, selection, mutation, [])
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    population = result["population"]
    best = population.best()
    _, fresh, reward_fn, template = task_parts("arithmetic", seed=10_000 + seed, reward="exact_match",
                                               n_train=10, n_test=final_n, ops=["+"], digits=[1, 2])
    env = ReasoningGym(fresh, fresh, tok, reward_fn, template, data_batch_size_per_gpu=8)
    final = evaluate_population([best], env, record=False)
    report = population.report()
    sel = population.selections()
    curve = report.groupby("step")["fitness"].max()
    return {"variant": variant, "seed": seed, "budget_cpu_s": budget, "cpu_s": cpu, "wall_s": wall,
            "steps": int(report["step"].max()), "final_fresh": float(final[0]),
            "final_fresh_se": float(final.stderr[0]), "best_member": int(best.index),
            "best_lr": float(best.get_hyperparameter("lr")), "best_heldout": float(best.fitness[-1]),
            "initial_fitness": float(result["initial_fitness"]),
            "curve": {int(k): float(v) for k, v in curve.items()},
            "snr": [float(x) for x in sel["snr"]] if len(sel) else [],
            "sizes": [int(x) for x in sel["size_after"]] if len(sel) else []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=60.0, help="CPU seconds per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--final-n", type=int, default=400)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--parts-dir", default="/tmp/evollm_evolution_defaults")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "evolution_defaults.json"))
    args = parser.parse_args()
    parts = Path(args.parts_dir)
    parts.mkdir(parents=True, exist_ok=True)
    if args.one:
        variant, seed = args.one[0], int(args.one[1])
        res = run_one(variant, seed, args.budget, args.final_n, str(parts / f"run_{variant}_{seed}"))
        (parts / f"{variant}_{seed}.json").write_text(json.dumps(res))
        return
    # a run whose log exists was started (by this or an earlier driver): delete its log to run it again
    todo = [(v, s) for s in args.seeds for v in args.variants if not (parts / f"{v}_{s}.log").exists()]
    running: list[subprocess.Popen] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    while todo or running:
        while todo and len(running) < args.jobs:
            v, s = todo.pop(0)
            cmd = [sys.executable, __file__, "--one", v, str(s), "--budget", str(args.budget),
                   "--final-n", str(args.final_n), "--parts-dir", str(parts)]
            running.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                            stderr=open(parts / f"{v}_{s}.log", "w")))
        time.sleep(5)
        running = [p for p in running if p.poll() is None]
    rows = [json.loads((parts / f"{v}_{s}.json").read_text()) for s in args.seeds for v in args.variants
            if (parts / f"{v}_{s}.json").exists()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"budget_cpu_s": args.budget, "seeds": args.seeds, "runs": rows}, indent=1))
    table(rows, args.variants, args.seeds)


def table(rows: list[dict], variants: list[str], seeds: list[int]) -> None:
    by = {(r["variant"], r["seed"]): r for r in rows}
    ref = "single"
    print("| variant | final (fresh 400 q.) mean | paired diff vs single (SE) | wins | steps | CPU s | best lr (median) |")
    print("|---|---|---|---|---|---|---|")
    for v in variants:
        runs = [by[(v, s)] for s in seeds if (v, s) in by]
        if not runs:
            continue
        mean = sum(r["final_fresh"] for r in runs) / len(runs)
        diffs = [by[(v, s)]["final_fresh"] - by[(ref, s)]["final_fresh"] for s in seeds
                 if (v, s) in by and (ref, s) in by]
        if len(diffs) >= 2:
            m = sum(diffs) / len(diffs)
            se = math.sqrt(sum((d - m) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
            diff = f"{m:+.3f} ({se:.3f})"
        else:
            diff = "-"
        wins = sum(d > 0 for d in diffs)
        lrs = sorted(r["best_lr"] for r in runs)
        print(f"| {v} | {mean:.3f} | {diff} | {wins}/{len(diffs)} | {sum(r['steps'] for r in runs) / len(runs):.0f} "
              f"| {sum(r['cpu_s'] for r in runs) / len(runs):.0f} | {lrs[len(lrs) // 2]:.2g} |")


if __name__ == "__main__":
    main()
