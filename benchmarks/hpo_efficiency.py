"""HPO efficiency at equal compute: evolution on one shared base vs sequential tuners.

Four ways of choosing GRPO hyperparameters for the demo task (configs/demo.yaml: warm-started tiny
model, 1-2 digit addition, exact-match reward, 8 prompts x group 8 per step, batch_size 32, LoRA r=8),
each given the SAME compute budget per seed:

* ``a`` -- evollm: 8 members on one shared base, batched rollouts and fused updates; founders from the
  search space by scrambled-Sobol QMC; evaluation + tournament selection (size 2, elitism) + mutation
  (perturb one hyperparameter, 20 % resampled from the prior) every ``--evo-steps`` steps.
* ``b`` -- Optuna TPE: single-agent trials of ``--trial-steps`` steps, one after the other, until the
  budget is spent (the first 2 trials are TPE's random start-up draws); trial value = its best
  held-out accuracy.
* ``c`` -- random search: the same trials with Optuna's RandomSampler.
* ``d`` -- one run with evollm's default GRPO settings (lr 5e-5, beta 0, clip 0.2, loss grpo) for the
  whole budget.

Search space (wide enough that bad settings fail): lr log-uniform 1e-5..1e-2, beta 0..0.1,
clip_low 0.05..0.4, clip_high 0.05..0.5, temperature 0.5..1.5, loss_type in {grpo, dr_grpo, dapo,
gspo, cispo}. Members that differ in temperature still share one batched generate and one fused
learn pass (each row at its member's temperature).

Budget: CPU seconds of the arm's own process (``time.process_time``, one torch thread), counted from
after the base model is loaded; wall seconds are recorded too. The machine's cores are shared with
other jobs, so CPU time is the fair measure; wall time is reported alongside. Every arm of a seed
gets the same base, data order and seeds. Held-out accuracy is greedy exact match on the demo's 200
fixed test questions, measured every ``--eval-every`` steps in every arm (the evaluations count
against the budget).

Usage::

    python benchmarks/hpo_efficiency.py --budget 20 --trial-steps 20 --eval-every 5 --evo-steps 10 \
        --seeds 0 1 2 3 4 5 6 7 --jobs 8 --target 0.65

Each (arm, seed) runs in its own subprocess; runs are started seed by seed, arms interleaved. Parts
are kept in ``--parts-dir`` and reused. Writes ``benchmarks/results/hpo_efficiency.json`` and
``benchmarks/results/hpo_efficiency.png`` and prints the markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's evollm, not an installed one
RESULTS = ROOT / "benchmarks" / "results"
DEMO = ROOT / "configs" / "demo.yaml"
POP_SIZE = 8
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
ARM_NAMES = {
    "a": "evollm, 8 members on one base (QMC founders, tournament + mutation)",
    "b": "Optuna TPE, sequential single-agent trials",
    "c": "random search, sequential single-agent trials",
    "d": "one run, default settings",
}
SPACE = {
    "lr": {"min": 1e-5, "max": 1e-2, "log": True},
    "beta": {"min": 0.0, "max": 0.1},
    "clip_low": {"min": 0.05, "max": 0.4},
    "clip_high": {"min": 0.05, "max": 0.5},
    "temperature": {"min": 0.5, "max": 1.5},
    "loss_type": {"choices": ["grpo", "dr_grpo", "dapo", "gspo", "cispo"]},
}
FIXED = {"group_size": 8, "batch_size": 32, "max_output_tokens": 5}


class _OutOfBudget(Exception):
    pass


def _hp_config():
    from evollm.hpo import HyperparameterConfig, RLParameter
    return HyperparameterConfig(**{k: RLParameter(**v) for k, v in SPACE.items()})


def _setup(seed: int):
    from evollm.config import RunConfig
    from evollm.recipes.builders import build_model, build_task
    from evollm.envs.reasoning import ReasoningGym

    cfg = RunConfig.from_yaml(DEMO)
    model, tok = build_model(cfg.model, 0)
    train, test, reward_fn, template = build_task(cfg.task, 0)
    env = ReasoningGym(train, test, tok, reward_fn, template, seed=seed,
                       data_batch_size_per_gpu=cfg.env.data_batch_size_per_gpu,
                       max_context_length=cfg.env.max_context_length, eval_batch_size=cfg.env.eval_batch_size)
    return cfg, model, tok, env


def _kwargs(cfg, tok, seed: int) -> dict:
    from evollm.adapters.shared import default_lora_config
    return dict(pad_token_id=tok.pad_token_id, pad_token=tok.pad_token, eos_token_id=tok.eos_token_id,
                lora_config=default_lora_config(**cfg.algorithm.lora.kwargs()), seed=seed, **FIXED)


class Clock:
    """CPU and wall time since the arm started; raises when the CPU budget is spent."""

    def __init__(self, budget: float):
        self.budget, self.cpu0, self.wall0 = budget, time.process_time(), time.perf_counter()
        self.evaluations: list[dict] = []

    def cpu(self) -> float:
        return time.process_time() - self.cpu0

    def wall(self) -> float:
        return time.perf_counter() - self.wall0

    def callback(self, trial: int | None = None):
        from evollm.training.callbacks import Callback
        clock = self

        class _Budget(Callback):
            def on_step_end(self, state, metrics):
                if clock.cpu() >= clock.budget:
                    raise _OutOfBudget

            def on_evaluation(self, state, fitness):
                best = max(range(len(fitness)), key=lambda i: fitness[i])
                agent = state.agents[best]
                clock.evaluations.append({
                    "cpu_s": clock.cpu(), "wall_s": clock.wall(), "step": state.step, "trial": trial,
                    "fitness": float(fitness[best]), "all_fitness": [float(f) for f in fitness],
                    "hyperparameters": {k: agent.get_hyperparameter(k) for k in SPACE}})
        return _Budget()


def arm_a(seed: int, budget: float, args) -> dict:
    from evollm.algorithms.grpo import GRPO
    from evollm.hpo import Mutations, TournamentSelection
    from evollm.training.loop import finetune_llm_reasoning

    cfg, model, tok, env = _setup(seed)
    clock = Clock(budget)
    pop = GRPO.population(POP_SIZE, model, hp_config=_hp_config(), init_sampler="qmc", **_kwargs(cfg, tok, seed))
    founders = [{k: a.get_hyperparameter(k) for k in SPACE} for a in pop]
    mutation = Mutations(no_mutation=0.2, rl_hp=0.8, resample_prob=0.2, rand_seed=seed)
    selection = TournamentSelection(2, elitism=True, population_size=POP_SIZE, rand_seed=seed)
    try:
        finetune_llm_reasoning(pop, env, max_steps=10 ** 6, evaluation_interval=args.eval_every,
                               evo_steps=args.evo_steps, tournament=selection, mutation=mutation,
                               verbose=False, seed=seed, callbacks=[clock.callback()])
    except _OutOfBudget:
        pass
    return {"founders": founders, "evaluations": clock.evaluations}


def _trials(seed: int, budget: float, args, sampler) -> dict:
    import optuna
    from evollm.algorithms.grpo import GRPO
    from evollm.hpo import hp_config_to_distributions
    from evollm.training.loop import finetune_llm_reasoning

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    cfg, model, tok, env = _setup(seed)
    clock = Clock(budget)
    distributions = hp_config_to_distributions(_hp_config())
    study = optuna.create_study(direction="maximize", sampler=sampler)
    trials, k = [], 0
    while clock.cpu() < budget:
        trial = study.ask(distributions)
        hps = dict(trial.params)
        agent = GRPO(model, **_kwargs(cfg, tok, seed), **hps)
        start = len(clock.evaluations)
        try:
            finetune_llm_reasoning([agent], env, max_steps=args.trial_steps, evaluation_interval=args.eval_every,
                                   verbose=False, seed=seed + 1000 * k, callbacks=[clock.callback(k)])
        except _OutOfBudget:
            pass
        agent.release()
        values = [e["fitness"] for e in clock.evaluations[start:]]
        if values:
            study.tell(trial, max(values))
        trials.append({"trial": k, "hyperparameters": hps, "best": max(values) if values else None,
                       "evaluations": len(values)})
        k += 1
    return {"trials": trials, "evaluations": clock.evaluations}


def arm_b(seed, budget, args):
    import optuna
    return _trials(seed, budget, args, optuna.samplers.TPESampler(seed=seed, n_startup_trials=2))


def arm_c(seed, budget, args):
    import optuna
    return _trials(seed, budget, args, optuna.samplers.RandomSampler(seed=seed))


def arm_d(seed, budget, args):
    from evollm.algorithms.grpo import GRPO
    from evollm.training.loop import finetune_llm_reasoning

    cfg, model, tok, env = _setup(seed)
    clock = Clock(budget)
    agent = GRPO(model, **_kwargs(cfg, tok, seed))
    try:
        finetune_llm_reasoning([agent], env, max_steps=10 ** 6, evaluation_interval=args.eval_every,
                               verbose=False, seed=seed, callbacks=[clock.callback()])
    except _OutOfBudget:
        pass
    return {"evaluations": clock.evaluations}


ARMS = {"a": arm_a, "b": arm_b, "c": arm_c, "d": arm_d}


# ---------------------------------------------------------------------------------- summaries
def best_so_far(evals: list[dict], t: float, key: str = "cpu_s") -> float | None:
    vals = [e["fitness"] for e in evals if e[key] <= t]
    return max(vals) if vals else None


def summarise(part: dict, budget: float, target: float) -> dict:
    ev = [e for e in part["evaluations"] if e["cpu_s"] <= budget * 1.02]  # the step that crossed the budget
    reached = [e for e in ev if e["fitness"] >= target - 1e-6]  # float32 fitness
    best = max(ev, key=lambda e: e["fitness"]) if ev else None
    return {"best": best["fitness"] if best else None,
            "best_hyperparameters": best["hyperparameters"] if best else None,
            "cpu_to_target": reached[0]["cpu_s"] if reached else None,
            "wall_to_target": reached[0]["wall_s"] if reached else None,
            "by_fraction": {str(f): best_so_far(ev, f * budget * (1.02 if f == 1 else 1)) for f in FRACTIONS},
            "evaluations": len(ev), "trials": len(part.get("trials", [])) or None}


def _ms(xs) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return f"{m:.3f} ± {sd:.3f}"


def summary_table(results: list[dict], target: float) -> str:
    lines = [f"| arm | best held-out acc at 1/4, 1/2, 3/4 of the budget (mean ± sd) | at the full budget "
             f"| min-max at full budget | reached {target:.2f} | CPU s to {target:.2f} (mean over reaching; "
             f"median all, unreached = budget) | wall s to {target:.2f} (reaching) | trials |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in sorted({r["arm"] for r in results}):
        rs = [r["summary"] for r in results if r["arm"] == arm]
        full = [s["by_fraction"]["1.0"] for s in rs if s["by_fraction"]["1.0"] is not None]
        hit = [s["cpu_to_target"] for s in rs if s["cpu_to_target"] is not None]
        wall = [s["wall_to_target"] for s in rs if s["wall_to_target"] is not None]
        all_t = sorted(s["cpu_to_target"] if s["cpu_to_target"] is not None else results[0]["budget"] for s in rs)
        med = (all_t[(len(all_t) - 1) // 2] + all_t[len(all_t) // 2]) / 2
        trials = [s["trials"] for s in rs if s["trials"]]
        lines.append(f"| {arm}: {ARM_NAMES[arm]} | "
                     + " / ".join(_ms([s["by_fraction"][str(f)] for s in rs]) for f in FRACTIONS[:-1])
                     + f" | {_ms(full)} | {min(full):.3f}-{max(full):.3f} | {len(hit)}/{len(rs)} | "
                     f"{(sum(hit) / len(hit)) if hit else float('nan'):.1f}; median {med:.1f} | "
                     f"{(sum(wall) / len(wall)) if wall else float('nan'):.0f} | "
                     f"{(sum(trials) / len(trials)) if trials else 1:.1f} |")
    return "\n".join(lines)


def per_run_table(results: list[dict], target: float) -> str:
    lines = [f"| arm | seed | best acc | CPU s to {target:.2f} | wall s of the run | best hyperparameters |",
             "|---|---|---|---|---|---|"]
    for r in results:
        s = r["summary"]
        h = s["best_hyperparameters"] or {}
        hs = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in h.items())
        t = "-" if s["cpu_to_target"] is None else f"{s['cpu_to_target']:.1f}"
        best = "-" if s["best"] is None else f"{s['best']:.3f}"
        lines.append(f"| {r['arm']} | {r['seed']} | {best} | {t} | {r['wall_s']:.0f} | {hs} |")
    return "\n".join(lines)


def plot(results: list[dict], budget: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.linspace(0, budget, 121)
    fig, ax = plt.subplots(figsize=(8, 5))
    for arm in sorted({r["arm"] for r in results}):
        curves = []
        for r in (r for r in results if r["arm"] == arm):
            ev = r["evaluations"]
            curves.append([best_so_far(ev, t) if best_so_far(ev, t) is not None else np.nan for t in grid])
        c = np.array(curves, dtype=float)
        mean = np.nanmean(c, axis=0)
        ax.plot(grid, mean, label=f"{arm}: {ARM_NAMES[arm]}")
        ax.fill_between(grid, np.nanmin(c, axis=0), np.nanmax(c, axis=0), alpha=0.15)
    ax.set_xlabel("CPU seconds of the arm's process (1 thread)")
    ax.set_ylabel("best held-out accuracy so far")
    ax.set_title(f"HPO at equal compute ({len({r['seed'] for r in results})} seeds; band = min-max)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------- driver
def worker(args) -> int:
    import torch
    torch.set_num_threads(1)
    part = ARMS[args.arm](args.seed, args.budget, args)
    part.update(arm=args.arm, seed=args.seed, budget=args.budget)
    part["wall_s"] = max([e["wall_s"] for e in part["evaluations"]], default=0.0)
    Path(args.out).write_text(json.dumps(part, indent=1, default=float))
    return 0


def driver(args) -> int:
    parts = Path(args.parts_dir)
    parts.mkdir(parents=True, exist_ok=True)
    tag = f"b{args.budget:g}_t{args.trial_steps}_e{args.eval_every}_g{args.evo_steps}"
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    path_of = {j: parts / f"{j[0]}_seed{j[1]}_{tag}.json" for j in jobs}
    todo = [j for j in jobs if not path_of[j].exists()]
    if not args.summarise_only:
        running: dict = {}
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        try:
            while todo or running:
                while todo and len(running) < args.jobs:
                    j = todo.pop(0)
                    log = open(parts / f"{j[0]}_seed{j[1]}_{tag}.log", "w")
                    cmd = [sys.executable, __file__, "--worker", "--arm", j[0], "--seed", str(j[1]),
                           "--out", str(path_of[j])] + args.passthrough
                    running[j] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT),
                                  log, time.perf_counter())
                    print(f"started arm {j[0]} seed {j[1]}", flush=True)
                time.sleep(2)
                for j, (proc, log, t0) in list(running.items()):
                    if proc.poll() is not None:
                        log.close()
                        del running[j]
                        print(f"arm {j[0]} seed {j[1]} rc={proc.returncode} in {time.perf_counter() - t0:.0f} s "
                              f"(load {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            for proc, log, _ in running.values():
                proc.terminate()
                proc.wait()
                log.close()
    results = []
    for j in jobs:
        if path_of[j].exists():
            part = json.loads(path_of[j].read_text())
            part["summary"] = summarise(part, args.budget, args.target)
            results.append(part)
    if not results:
        print("no results")
        return 1
    summary, per_run = summary_table(results, args.target), per_run_table(results, args.target)
    print("\n" + summary + "\n\n" + per_run)
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, args.budget, RESULTS / "hpo_efficiency.png")
    out = {"benchmark": "hpo_efficiency", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/hpo_efficiency.py " + " ".join(args.argv),
           "setting": {"budget_cpu_s": args.budget, "trial_steps": args.trial_steps, "eval_every": args.eval_every,
                       "evo_steps": args.evo_steps, "population": POP_SIZE, "search_space": SPACE, "fixed": FIXED,
                       "target": args.target, "seeds": args.seeds, "arms": ARM_NAMES},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads_per_run": 1,
                       "parallel_runs": args.jobs, "load_avg_at_end": os.getloadavg()},
           "summary_markdown": summary, "per_run_markdown": per_run, "runs": results}
    (RESULTS / "hpo_efficiency.json").write_text(json.dumps(out, indent=1, default=float))
    print(f"wrote {RESULTS / 'hpo_efficiency.json'} and hpo_efficiency.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=20.0, help="CPU seconds per arm and seed")
    p.add_argument("--trial-steps", type=int, default=20, help="steps of one sequential trial (arms b, c)")
    p.add_argument("--eval-every", type=int, default=5, help="steps between held-out evaluations")
    p.add_argument("--evo-steps", type=int, default=10, help="steps between selections (arm a)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    p.add_argument("--arms", nargs="+", default=["a", "b", "c", "d"], choices=sorted(ARMS))
    p.add_argument("--target", type=float, default=0.65, help="held-out accuracy to reach")
    p.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    p.add_argument("--parts-dir", default=str(Path(tempfile.gettempdir()) / "evollm_hpo_efficiency"))
    p.add_argument("--summarise-only", action="store_true", help="tables and plot from the parts already there")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", choices=sorted(ARMS), help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    args.passthrough = ["--budget", str(args.budget), "--trial-steps", str(args.trial_steps),
                        "--eval-every", str(args.eval_every), "--evo-steps", str(args.evo_steps)]
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
