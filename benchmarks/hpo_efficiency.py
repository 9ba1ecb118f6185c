"""HPO efficiency: does evolution pay?

Same task, model and training budget for three ways of choosing GRPO hyperparameters on the demo
setting (configs/demo.yaml: warm-started tiny model, 1-2 digit addition, exact-match reward, group 8,
8 prompts/step, batch_size 32, LoRA r=8):

* ``a`` -- evollm population WITH evolution: 4 members on one shared base, initial (lr, beta,
  clip_coef) from a scrambled-Sobol Optuna ``QMCSampler``, evaluation every 25 steps, tournament
  selection (size 2, elitism) + ``Mutations`` every 50 steps, S steps.
* ``b`` -- Optuna TPE over K=4 independent single-agent trials of S steps each (same search space;
  the first K/2 trials are TPE's random start-up draws, the rest are model-based); a trial's value is
  its best held-out accuracy (evaluated every 25 steps, like ``a``).
* ``c`` -- the best of 4 hand-chosen settings: lr in {5e-4, 1e-3, 2e-3, 4e-3}, beta 0, clip 0.2.

Every arm trains on 4 x S x 8 prompts x 8 completions = 4*S*64 sampled completions. Sample
accounting follows the order the work is done: in ``a`` all members advance together (samples at
step s = 4*s*64); in ``b``/``c`` the trials run one after another (trial k, step s: (k*S + s)*64).
Held-out accuracy is greedy exact match on the demo's fixed 200-question test set.

Every independent run (each arm; each trial of ``b``/``c``) gets a FRESH copy of the warm-started base
(``load_tiny_model`` seed 0, the demo's base) and a fresh ``ReasoningGym`` seeded with the benchmark
seed, so for one seed all arms see the same data order and sampling seeds. The benchmark seed also
seeds the QMC/TPE samplers, the selection and the mutations.

Usage::

    python benchmarks/hpo_efficiency.py [--steps 300] [--seeds 0 1] [--arms a b c] [--target 0.6] [--jobs 2]

Each (arm, seed) runs in its own subprocess (``--worker``) with one torch thread, at most ``--jobs`` at
a time. Finished parts are kept in ``--parts-dir`` and reused when re-run with the same settings.
Writes ``benchmarks/results/hpo_efficiency.json`` and prints a markdown table.
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
RESULTS = ROOT / "benchmarks" / "results"
DEMO = ROOT / "configs" / "demo.yaml"

POP_SIZE = 4  # members in arm a = trials in arms b and c
EVAL_INTERVAL = 25
EVO_STEPS = 50
FIXED_SETTINGS = [{"lr": lr, "beta": 0.0, "clip_coef": 0.2} for lr in (5e-4, 1e-3, 2e-3, 4e-3)]
FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # of the budget, for the best-so-far columns
ARM_NAMES = {
    "a": "evolution (4 members, QMC init, tournament+mutation every 50 steps)",
    "b": "Optuna TPE, 4 sequential single-agent trials",
    "c": "best of 4 fixed settings (lr 5e-4/1e-3/2e-3/4e-3, beta 0, clip 0.2)",
}


# ---------------------------------------------------------------------------------- building blocks
def _demo():
    from evollm.config import RunConfig
    return RunConfig.from_yaml(DEMO)


def _samples_per_step(cfg) -> int:
    return int(cfg.env["data_batch_size_per_gpu"]) * int(cfg.algorithm["hyperparameters"]["group_size"])


def _fresh_run(cfg, seed: int):
    """A fresh copy of the demo's warm-started base, its tokenizer and a fresh env seeded with ``seed``.
    The dataset (and so the 200 test questions) is the demo's (task seed 0) for every seed."""
    from evollm.config import build_model, build_task
    from evollm.envs.reasoning import ReasoningGym

    model, tok = build_model(cfg.model, 0)
    train, test, reward_fn, template = build_task(cfg.task, 0)
    env_cfg = {k: v for k, v in cfg.env.items() if k != "type"}
    env = ReasoningGym(train, test, tok, reward_fn, template, seed=seed, **env_cfg)
    return model, tok, env


def _hp_config(cfg):
    from evollm.config import build_hpo
    hp_config, _, _ = build_hpo(cfg.hpo, POP_SIZE, 0)
    return hp_config


def _agent_kwargs(cfg, tok, seed: int) -> dict:
    from evollm.adapters.shared import default_lora_config
    hps = dict(cfg.algorithm["hyperparameters"])
    hps["seed"] = seed
    return dict(pad_token_id=tok.pad_token_id, pad_token=tok.pad_token, eos_token_id=tok.eos_token_id,
                lora_config=default_lora_config(**cfg.algorithm["lora"]), **hps)


def _evaluations(population, offset_steps: int, agents_in_parallel: int, samples_per_step: int) -> list[dict]:
    """Rows (step, member, fitness, samples, hps) of a run's report; ``samples`` = cumulative training
    samples of the whole arm when that evaluation happened."""
    rows = []
    for r in population.report().to_dict("records"):
        step = int(r["step"])
        rows.append({"step": step, "member": int(r["member"]), "fitness": float(r["fitness"]),
                     "samples": (offset_steps + agents_in_parallel * step) * samples_per_step,
                     "lr": float(r["hp_lr"]), "beta": float(r["hp_beta"]), "clip_coef": float(r["hp_clip_coef"])})
    return rows


def _train_single(cfg, seed: int, steps: int, hps: dict):
    """One independent single-agent run with ``hps``; returns its Population record."""
    from evollm.algorithms.grpo import GRPO
    from evollm.training.loop import finetune_llm_reasoning

    model, tok, env = _fresh_run(cfg, seed)
    agent = GRPO(model, hp_config=_hp_config(cfg), **_agent_kwargs(cfg, tok, seed))
    for name, value in hps.items():
        agent.set_hyperparameter(name, value)
    _, population = finetune_llm_reasoning([agent], env, max_steps=steps, evaluation_interval=EVAL_INTERVAL,
                                           verbose=False, seed=seed)
    agent.release()
    return population


# ---------------------------------------------------------------------------------- the three arms
def arm_a(cfg, seed: int, steps: int) -> dict:
    from evollm.algorithms.grpo import GRPO
    from evollm.hpo import Mutations, TournamentSelection, initial_population_hyperparameters
    from evollm.rollout import evaluate_population
    from evollm.training.loop import finetune_llm_reasoning

    hp_config = _hp_config(cfg)
    model, tok, env = _fresh_run(cfg, seed)
    init = initial_population_hyperparameters(hp_config, POP_SIZE, sampler="qmc", seed=seed)
    pop = GRPO.population(POP_SIZE, actor_network=model, hp_config=hp_config, init_hyperparameters=init,
                          **_agent_kwargs(cfg, tok, seed))
    warm_start = evaluate_population(pop[:1], env, record=False)[0]  # zero LoRA update = the base itself
    mutation = Mutations(**{**cfg.hpo["mutation"], "rand_seed": seed})
    sel = {k: v for k, v in cfg.hpo["selection"].items() if k != "type"}
    tournament = TournamentSelection(population_size=POP_SIZE, rand_seed=seed, **sel)
    _, population = finetune_llm_reasoning(pop, env, max_steps=steps, evaluation_interval=EVAL_INTERVAL,
                                           evo_steps=EVO_STEPS, tournament=tournament, mutation=mutation,
                                           verbose=False, seed=seed)
    lineage = population.lineage()
    births = [] if lineage.empty else [
        {"member": int(row["member"]), "parent": int(row["parent"]), "generation": int(row["generation"]),
         "step": int(row["step"]), "mutation": row["mutation"], "old_value": row["old_value"],
         "new_value": row["new_value"]}
        for row in lineage.to_dict("records")
        if row.get("parent") is not None and not (isinstance(row["parent"], float) and math.isnan(row["parent"]))]
    return {"warm_start_accuracy": warm_start, "initial_hyperparameters": init, "births": births,
            "evaluations": _evaluations(population, 0, POP_SIZE, _samples_per_step(cfg))}


def _sequential(cfg, seed: int, steps: int, settings) -> dict:
    """Trials one after another; ``settings`` yields (hps, tell) pairs: tell(value) gets the trial value."""
    spp = _samples_per_step(cfg)
    evaluations, trials = [], []
    for k, (hps, tell) in enumerate(settings):
        t0 = time.perf_counter()
        rows = _evaluations(_train_single(cfg, seed, steps, hps), k * steps, 1, spp)
        for r in rows:
            r["member"] = k
        value = max(r["fitness"] for r in rows)
        if tell is not None:
            tell(value)
        trials.append({"trial": k, "hyperparameters": hps, "best": value, "final": rows[-1]["fitness"],
                       "wall_s": time.perf_counter() - t0})
        print(f"  trial {k}: {hps} best {value:.3f} final {rows[-1]['fitness']:.3f}", flush=True)
        evaluations += rows
    return {"trials": trials, "evaluations": evaluations}


def arm_b(cfg, seed: int, steps: int) -> dict:
    import optuna
    from evollm.hpo import hp_config_to_distributions

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    distributions = hp_config_to_distributions(_hp_config(cfg))
    # Optuna's default n_startup_trials=10 would make 4 trials pure random search: let TPE model the
    # second half of the trials from the first half.
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(1, POP_SIZE // 2))
    study = optuna.create_study(direction="maximize", sampler=sampler)

    def settings():
        for _ in range(POP_SIZE):
            trial = study.ask(distributions)
            hps = {name: float(trial.params[name]) for name in distributions}
            yield hps, (lambda value, t=trial: study.tell(t, value))

    return _sequential(cfg, seed, steps, settings())


def arm_c(cfg, seed: int, steps: int) -> dict:
    return _sequential(cfg, seed, steps, ((dict(s), None) for s in FIXED_SETTINGS))


ARMS = {"a": arm_a, "b": arm_b, "c": arm_c}


def summarise(part: dict, steps: int, target: float, samples_per_step: int) -> dict:
    """Best accuracy, final best and samples to first reach ``target`` from an arm's evaluations."""
    evals = part["evaluations"]
    best = max(evals, key=lambda r: (r["fitness"], -r["samples"]))
    final = max((r for r in evals if r["step"] == steps), key=lambda r: r["fitness"])
    reached = sorted((r for r in evals if r["fitness"] >= target - 1e-9), key=lambda r: r["samples"])
    curve, so_far = [], -1.0
    for r in sorted(evals, key=lambda r: (r["samples"], r["member"])):
        so_far = max(so_far, r["fitness"])
        if curve and curve[-1][0] == r["samples"]:
            curve[-1][1] = so_far
        else:
            curve.append([r["samples"], so_far])
    budget = POP_SIZE * steps * samples_per_step
    by_fraction = {str(f): max((v for n, v in curve if n <= f * budget), default=None) for f in FRACTIONS}
    return {"best_accuracy": best["fitness"], "best_at_samples": best["samples"],
            "best_hyperparameters": {k: best[k] for k in ("lr", "beta", "clip_coef")},
            "final_best": final["fitness"],
            "samples_to_target": reached[0]["samples"] if reached else None,
            "budget_samples": budget,
            "best_by_budget_fraction": by_fraction,
            "best_so_far_curve": curve}


# ---------------------------------------------------------------------------------- worker / driver
def worker(args) -> int:
    import torch
    torch.set_num_threads(1)
    cfg = _demo()
    t0 = time.perf_counter()
    part = ARMS[args.arm](cfg, args.seed, args.steps)
    part.update(arm=args.arm, seed=args.seed, steps=args.steps, wall_s=time.perf_counter() - t0)
    Path(args.out).write_text(json.dumps(part, indent=1, default=float))
    return 0


def _fmt_samples(n) -> str:
    return "not reached" if n is None else f"{n:,}"


def table(results: list[dict], target: float) -> str:
    lines = [f"| arm | seed | best held-out acc | at samples | final best | samples to reach {target:.2f} "
             f"| best hyperparameters (lr, beta, clip) | wall time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["summary"]
        h = s["best_hyperparameters"]
        lines.append(f"| {r['arm']} | {r['seed']} | {s['best_accuracy']:.3f} | {s['best_at_samples']:,} | "
                     f"{s['final_best']:.3f} | {_fmt_samples(s['samples_to_target'])} | "
                     f"{h['lr']:.2e}, {h['beta']:.3f}, {h['clip_coef']:.2f} | {r['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


def summary_table(results: list[dict], target: float, seeds: list[int]) -> str:
    lines = [f"| arm | mean best acc | mean final best | best so far after 1/4, 1/2, 3/4 of the budget "
             f"| reached {target:.2f} | mean samples to {target:.2f} (reaching runs) | mean wall time |",
             "|---|---|---|---|---|---|---|"]
    for arm in sorted({r["arm"] for r in results}):
        rs = [r for r in results if r["arm"] == arm]
        hit = [r["summary"]["samples_to_target"] for r in rs if r["summary"]["samples_to_target"] is not None]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        lines.append(f"| {arm}: {ARM_NAMES[arm]} | {mean([r['summary']['best_accuracy'] for r in rs]):.3f} | "
                     f"{mean([r['summary']['final_best'] for r in rs]):.3f} | "
                     + ", ".join(f"{mean([r['summary']['best_by_budget_fraction'][str(f)] for r in rs]):.3f}"
                                 for f in FRACTIONS[:-1])
                     + f" | {len(hit)}/{len(rs)} | "
                     f"{(f'{mean(hit):,.0f}' if hit else 'not reached')} | "
                     f"{mean([r['wall_s'] for r in rs]) / 60:.1f} min |")
    return "\n".join(lines)


def paired_table(results: list[dict]) -> str:
    """Arm vs arm on the same seeds: mean difference of the best and final-best accuracy, and how often
    the first arm is ahead / level / behind on best accuracy."""
    by = {(r["arm"], r["seed"]): r["summary"] for r in results}
    arms = sorted({r["arm"] for r in results})
    lines = ["| comparison (same seeds) | seeds | mean diff. best acc | mean diff. final best "
             "| first arm ahead / level / behind (best acc) |", "|---|---|---|---|---|"]
    for i, x in enumerate(arms):
        for y in arms[i + 1:]:
            seeds = sorted(s for (a, s) in by if a == x and (y, s) in by)
            if not seeds:
                continue
            d_best = [by[x, s]["best_accuracy"] - by[y, s]["best_accuracy"] for s in seeds]
            d_final = [by[x, s]["final_best"] - by[y, s]["final_best"] for s in seeds]
            ahead = sum(d > 1e-9 for d in d_best)
            behind = sum(d < -1e-9 for d in d_best)
            lines.append(f"| {x} - {y} | {len(seeds)} | {sum(d_best) / len(seeds):+.3f} | "
                         f"{sum(d_final) / len(seeds):+.3f} | {ahead} / {len(seeds) - ahead - behind} / {behind} |")
    return "\n".join(lines)


def driver(args) -> int:
    cfg = _demo()
    spp = _samples_per_step(cfg)
    parts = Path(args.parts_dir)
    parts.mkdir(parents=True, exist_ok=True)
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    path_of = {j: parts / f"{j[0]}_seed{j[1]}_steps{args.steps}.json" for j in jobs}
    todo = [j for j in jobs if not path_of[j].exists()]
    print(f"{len(jobs)} runs ({len(jobs) - len(todo)} already in {parts}), {args.jobs} at a time; "
          f"each arm trains on {POP_SIZE} x {args.steps} x {spp} = {POP_SIZE * args.steps * spp:,} samples",
          flush=True)
    load_log = parts / f"load_steps{args.steps}.jsonl"

    def note_load(event: str) -> None:
        if todo or running or event != "start":  # only while this driver actually runs workers
            with open(load_log, "a") as f:
                f.write(json.dumps({"time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                    "event": event, "load_avg": os.getloadavg()}) + "\n")

    running: dict = {}
    note_load("start")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        while todo or running:
            while todo and len(running) < args.jobs:
                arm, seed = j = todo.pop(0)
                log = open(parts / f"{arm}_seed{seed}_steps{args.steps}.log", "w")
                cmd = [sys.executable, __file__, "--worker", "--arm", arm, "--seed", str(seed),
                       "--steps", str(args.steps), "--out", str(path_of[j])]
                running[j] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT),
                              log, time.perf_counter())
                print(f"started arm {arm} seed {seed} (pid {running[j][0].pid})", flush=True)
            time.sleep(2)
            for j, (proc, log, t0) in list(running.items()):
                if proc.poll() is not None:
                    note_load(f"finished arm {j[0]} seed {j[1]}")
                    log.close()
                    del running[j]
                    status = "done" if proc.returncode == 0 else f"FAILED rc={proc.returncode} (see {log.name})"
                    print(f"arm {j[0]} seed {j[1]} {status} in {(time.perf_counter() - t0) / 60:.1f} min "
                          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for proc, log, _ in running.values():  # interrupted: stop our own workers
            proc.terminate()
            proc.wait()
            log.close()
    load_samples = ([json.loads(line) for line in load_log.read_text().splitlines()]
                    if load_log.exists() else [])
    load_now = os.getloadavg()

    results = []
    for j in jobs:
        if not path_of[j].exists():
            continue
        part = json.loads(path_of[j].read_text())
        part["summary"] = summarise(part, args.steps, args.target, spp)
        results.append(part)
    if not results:
        print("no results")
        return 1
    warm = {r["seed"]: r["warm_start_accuracy"] for r in results if "warm_start_accuracy" in r}
    per_run = table(results, args.target)
    summary = summary_table(results, args.target, args.seeds)
    paired = paired_table(results)
    print("\n" + per_run + "\n\n" + summary + "\n\n" + paired)
    if warm:
        print("\nwarm-start (base model) held-out accuracy: "
              + ", ".join(f"seed {k}: {v:.3f}" for k, v in sorted(warm.items())))
    out = {
        "benchmark": "hpo_efficiency",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/hpo_efficiency.py " + " ".join(args.argv),
        "setting": {"config": "configs/demo.yaml", "steps": args.steps, "seeds": args.seeds, "target": args.target,
                    "members_or_trials": POP_SIZE, "samples_per_step_per_agent": spp,
                    "budget_samples_per_arm": POP_SIZE * args.steps * spp,
                    "evaluation_interval": EVAL_INTERVAL, "evo_steps": EVO_STEPS,
                    "test_questions": int(cfg.task.get("n_test", 200)), "fixed_settings": FIXED_SETTINGS,
                    "arms": ARM_NAMES},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads_per_run": 1,
                    "parallel_runs": args.jobs, "load_avg_now": load_now,
                    "load_avg_while_running": load_samples},
        "warm_start_accuracy_by_seed": warm,
        "table_markdown": per_run,
        "summary_markdown": summary,
        "paired_markdown": paired,
        "runs": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    dest = RESULTS / args.output
    dest.write_text(json.dumps(out, indent=1, default=float))
    if load_samples:
        ones = [x["load_avg"][0] for x in load_samples]
        print(f"\n1-min load average while the workers ran: {min(ones):.1f} to {max(ones):.1f} "
              f"({len(ones)} samples, {os.cpu_count()} CPUs)")
    print(f"wrote {dest}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps per run (S)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--arms", nargs="+", default=["a", "b", "c"], choices=sorted(ARMS))
    p.add_argument("--target", type=float, default=0.60, help="held-out accuracy to reach")
    p.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    p.add_argument("--parts-dir", default=str(Path(tempfile.gettempdir()) / "evollm_hpo_efficiency"))
    p.add_argument("--output", default="hpo_efficiency.json", help="file name in benchmarks/results/")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", choices=sorted(ARMS), help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    if args.worker:
        return worker(args)
    if not args.output.startswith("hpo_efficiency") or not args.output.endswith(".json"):
        p.error("--output must look like hpo_efficiency*.json")
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
