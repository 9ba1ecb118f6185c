"""Hyperparameter search at equal compute, for any task a run config describes.

    python -m benchmarks.hpo.run --config benchmarks/hpo/configs/tiny_arithmetic.yaml \
        --seeds 8 --budget-cpu-s 20 --trial-steps 40 --jobs 4 --out benchmarks/results/hpo_tiny

The config is an ordinary ``evollm train`` config: its model, task and env sections (and the task's
fixed algorithm settings such as group_size) define the task; the benchmark adds each arm's own settings
(see :mod:`benchmarks.hpo.arms`). ``--jobs`` worker processes (one torch thread each) share the
(arm, seed) runs; each worker loads the task once. Every run's JSON is kept in ``--parts-dir`` and
reused, so an interrupted benchmark continues where it stopped. Writes ``OUT.json``
(every run, every checkpoint, every trial), ``OUT.png`` and ``OUT.md`` (tables), and prints the tables.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_ARMS = ("evollm", "no_mutation", "tpe", "random", "default")


# --------------------------------------------------------------------------- worker
def worker(args) -> int:
    """Run the (arm, seed) jobs of ``args.job`` one after another on ONE loaded task (imports and the base
    are paid once per process, outside every budget); each job's JSON is written when it ends."""
    import torch

    torch.set_num_threads(1)
    from evollm.config import RunConfig
    from evollm.models.loading import set_threads

    from .task import load_task

    set_threads(1)
    cfg = RunConfig.from_yaml(args.config, args.set)
    probe = speed_probe()
    t0, c0 = time.perf_counter(), time.process_time()
    task = load_task(cfg, args.report_size)
    if args.device != "cpu":  # the shared base on the GPU: every member's adapter follows it
        task.model.to(args.device)
    setup = {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0, "git": _git_head(),
             "speed_probe_cpu_s": probe}
    for job in args.job:
        arm, rest = job.split("@", 1)
        seed, path = rest.split("=", 1)
        if not Path(path).exists():
            run_one(task, cfg, arm, int(seed), Path(path), setup, args)
    return 0


def speed_probe(reps: int = 3) -> float:
    """CPU seconds of a fixed small workload (a tiny MLP's forward and backward, 200 times, one thread; the best
    of ``reps``): how fast this machine is right now. A step of the tiny tasks is bound by the same per-call
    overhead, and on a shared machine it drifts (measured: the tiny task's default run made a mean of 305
    steps in 40 CPU-s one morning and 345 that evening, on one machine), so compare arms run side by side in
    one invocation, and check each run's ``setup.speed_probe_cpu_s`` when they were not."""
    import torch
    gen = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    x = torch.randn(32, 64, generator=gen)
    best = float("inf")
    for _ in range(reps):
        c0 = time.process_time()
        for _ in range(200):
            net.zero_grad()
            net(x).square().mean().backward()
        best = min(best, time.process_time() - c0)
    return best


def start_run(task, cfg, seed: int, setup: dict):
    """The run's config (its seed set) and the base model's report score, with every random generator
    seeded last: a run starts from the same state whether or not it is its worker's first (whose base
    model's evaluation builds an adapter, drawing from torch's generator)."""
    from transformers import set_seed

    from .arms import with_overrides
    from .task import mean_se

    seed_overrides = [f"seed={seed}"] + ([f"task.seed={int(cfg.seed)}"] if task.kind == "reasoning" else [])
    cfg = with_overrides(cfg, seed_overrides)
    task.new_run()
    if "initial" not in setup:  # the base model's report score: the same for every run of this process
        base = _base_member(task, cfg)
        setup["initial"] = dict(zip(("score", "se"), mean_se(task.report(base))))
        base.release()
    set_seed(seed)  # python, numpy and torch
    return cfg, setup["initial"]


def run_one(task, cfg, arm: str, seed: int, path: Path, setup: dict, args) -> None:
    from .arms import Clock, run_arm
    from .cost import DEFAULT_MEASUREMENT, load_step_cost

    cfg, initial = start_run(task, cfg, seed, setup)
    before = set(_adapters(task))
    cost = load_step_cost(args.cost_file or DEFAULT_MEASUREMENT) if args.cost_model == "gpu" else None
    clock = Clock(args.budget_cpu_s, args.checkpoints, cost, wall=args.device != "cpu")
    out, rec = run_arm(arm, task, cfg, clock, args)
    cpu_s, wall_s, raw_cpu_s = clock.cpu(), clock.wall(), clock.raw_cpu()
    c0, w0 = time.process_time(), time.perf_counter()
    report_evals = rec.score(task, cfg, initial)
    _free_run(task, before)
    last_eval = rec.evaluations[-1] if rec.evaluations else None
    part = {"arm": arm, "seed": seed, "budget_cpu_s": args.budget_cpu_s, "cpu_s": cpu_s, "wall_s": wall_s,
            "raw_cpu_s": raw_cpu_s, "cost_model": cost.to_dict() if cost else "cpu", "device": args.device,
            "budget_clock": "wall" if args.device != "cpu" else "cpu",
            "raw_cpu_s_by_members": dict(sorted(clock.charged.raw_by_members.items())),
            "report_cpu_s": time.process_time() - c0, "report_wall_s": time.perf_counter() - w0,
            "setup": setup, "initial": initial, "checkpoints": rec.checkpoints, "evaluations": rec.evaluations,
            "report_evals": report_evals, "report_size": task.report_size,
            "validation_size": task.validation_size, "steps": rec.checkpoints[-1]["step"] if rec.checkpoints else 0,
            **out}
    part["recommended_hyperparameters"] = _recommended(part, last_eval)
    part["git"] = setup["git"]  # the checkout this worker loaded
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(part, indent=1, default=float))
    tmp.replace(path)
    print(f"{arm} seed {seed}: final {part['checkpoints'][-1]['score'] if part['checkpoints'] else None} "
          f"({part['cpu_s']:.0f} CPU-s, {part['wall_s']:.0f} s wall)", flush=True)


def _adapters(task) -> list[str]:
    from evollm.adapters.shared import SharedBase
    shared = SharedBase.find(task.model)
    return shared.adapters() if shared is not None else []


def _free_run(task, before: set) -> None:
    """Delete every adapter a run left on the worker's shared base (its last members, the kept best state,
    a parked reserve): the next run of this worker starts on the base as this one did. Left there, they
    slowed every later run (each adapter lengthens the model's module walks): the relay's evollm arm made
    58 steps on its first seed and 31 on its tenth, with 160 adapters left over."""
    from evollm.adapters.shared import SharedBase
    shared = SharedBase.find(task.model)
    for name in [a for a in _adapters(task) if a not in before]:
        shared.delete_adapter(name)


def _base_member(task, cfg):
    """A member with a fresh adapter (LoRA's B starts at zero): it scores as the base model."""
    from .arms import members_of, with_overrides
    return members_of(with_overrides(cfg, ["algorithm.population_size=1", "hpo={}"]), task, None)[0]


def _recommended(part: dict, last_eval: dict | None) -> dict:
    if "trials" in part:
        best = part.get("best_trial")
        return next((t["hyperparameters"] for t in part["trials"] if t["trial"] == best), {})
    if "fixed" in part:
        return part.get("hyperparameters", {})
    if last_eval:
        i = max(range(len(last_eval["fitness"])), key=lambda j: last_eval["fitness"][j])
        return last_eval["hyperparameters"][i]
    return {}


# --------------------------------------------------------------------------- driver
def variants_of(specs: list[str]) -> dict[str, list[str]]:
    """``--variant NAME=KEY=VALUE`` flags -> ``{NAME: [KEY=VALUE, ...]}`` in the order given.

    >>> variants_of(["tie=hpo.narrowing.on_tie=one_rung", "tie=hpo.narrowing.tiebreak=reward", "n4=hpo.population_size=4"])
    {'tie': ['hpo.narrowing.on_tie=one_rung', 'hpo.narrowing.tiebreak=reward'], 'n4': ['hpo.population_size=4']}
    """
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, _, override = spec.partition("=")
        if not name or not name.replace("_", "").isalnum() or "=" not in override:
            raise ValueError(f"--variant {spec!r}: give NAME=KEY=VALUE, NAME of letters, digits and _")
        out.setdefault(name, []).append(override)
    return out


def arms_of(args, cfg) -> list[str]:
    from .arms import grid_values
    arms = list(args.arms) + [f"evollm:{name}" for name in getattr(args, "variants", {})]
    if "grid" not in args.skip:
        values = args.grid_lr or (grid_values(cfg, args.grid_points) if args.grid_points else [])
        arms += [f"grid:lr={v:g}" for v in values]
    return [a for a in arms if a not in args.skip]


def deal(jobs: list[tuple[str, int]], workers: int, done=lambda job: False) -> list[list[tuple[str, int]]]:
    """The unfinished ``(arm, seed)`` jobs in ``workers`` shares, each arm on every worker in turn, and no
    worker idle while another holds two jobs (as many workers as jobs: one job each).

    >>> deal([("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)], 2)
    [[('a', 0), ('b', 1), ('a', 2)], [('b', 0), ('a', 1), ('b', 2)]]
    >>> [len(share) for share in deal([(a, s) for s in range(3) for a in "ab"], 6)]
    [1, 1, 1, 1, 1, 1]
    """
    arms = list(dict.fromkeys(arm for arm, _ in jobs))
    seeds = list(dict.fromkeys(seed for _, seed in jobs))
    shares = [[] for _ in range(workers)]
    for arm, seed in jobs:
        if not done((arm, seed)):  # seed by seed, the arms' order turned by one each seed
            s = seeds.index(seed)
            shares[(s * len(arms) + (arms.index(arm) + s) % len(arms)) % workers].append((arm, seed))
    return shares


def run_jobs(args, jobs: list[tuple[str, int]], path_of: dict, parts: Path) -> None:
    """``args.jobs`` worker processes, each running its share of the unfinished jobs in turn (a SIGTERM to
    the driver stops them too). The shares alternate arms from seed to seed (``deal``): each arm runs on
    every worker, so a core slower than the other (a shared machine's neighbour) slows every arm alike
    instead of one."""
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    shares = deal(jobs, args.jobs, done=lambda j: path_of[j].exists())
    procs = []
    try:
        for i, share in enumerate(s for s in shares if s):
            log = open(parts / f"worker{i}.log", "a")
            cmd = [sys.executable, "-m", "benchmarks.hpo.run", "--worker"] + args.passthrough + \
                [x for j in share for x in ("--job", f"{j[0]}@{j[1]}={path_of[j]}")]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log))
            print(f"worker {i}: {len(share)} runs (log {log.name})", flush=True)
        for proc, log in procs:
            proc.wait()
            log.close()
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
            log.close()
    missing = [j for j in jobs if not path_of[j].exists()]
    if missing:
        print(f"unfinished: {missing} (logs in {parts})", flush=True)


def driver(args) -> int:
    from evollm.config import RunConfig

    from . import stats

    cfg = RunConfig.from_yaml(args.config, args.set)
    arms = arms_of(args, cfg)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    key = hashlib.sha1(json.dumps([Path(args.config).read_text(), args.passthrough]).encode()).hexdigest()[:10]
    parts = Path(args.parts_dir or f"/tmp/evollm_hpo/{Path(args.config).stem}_{key}")
    parts.mkdir(parents=True, exist_ok=True)
    # seed by seed, the grid (context) last: a benchmark cut short has whole seeds of the main arms
    jobs = [(arm, seed) for seed in seeds for arm in arms if not arm.startswith("grid:")] + \
        [(arm, seed) for seed in seeds for arm in arms if arm.startswith("grid:")]
    path_of = {j: parts / f"{j[0].replace(':', '_').replace('=', '')}_seed{j[1]}.json" for j in jobs}
    if args.in_process and not args.summarise_only:
        args.job = [f"{a}@{s}={path_of[(a, s)]}" for a, s in jobs]
        worker(args)
    elif not args.summarise_only:
        run_jobs(args, jobs, path_of, parts)
    runs = [json.loads(path_of[j].read_text()) for j in jobs if path_of[j].exists()]
    if not runs:
        print("no finished runs")
        return 1
    summary = stats.summarise(runs, args.checkpoints)
    noise = stats.mean_se([c["se"] for r in runs for c in r["checkpoints"][-1:]])[0]
    unit = "CPU-s" if args.device == "cpu" else f"wall-s on {args.device}"
    title = (f"{Path(args.config).stem}: {args.budget_cpu_s:g} {unit} per seed, {len(seeds)} seeds "
             f"(band: ± se over seeds; report set {runs[0]['report_size']}, one evaluation's se ≈ {noise:.3f})")
    md = stats.table(summary, args.checkpoints) + "\n\n" + stats.verdict(summary) + "\n\n<details><summary>Every run</summary>\n\n" \
        + stats.per_run_table(runs) + "\n\n</details>\n"
    print("\n" + md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stats.plot(runs, args.checkpoints, args.budget_cpu_s, title, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(f"{title}\n\n{md}")
    doc = {"benchmark": "hpo", "config": str(args.config), "config_text": Path(args.config).read_text(),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "python -m benchmarks.hpo.run " + " ".join(args.argv),
           "git": _git_head(), "setting": {k: v for k, v in vars(args).items() if k not in ("passthrough",)},
           "arms": arms, "seeds": seeds, "report_set_se": noise, "summary": summary,
           "machine": {**machine(), "threads_per_run": 1, "parallel_runs": args.jobs,
                       "load_avg_at_end": os.getloadavg()},
           "runs": runs}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=float))
    print(f"wrote {out.with_suffix('.json')}, .png, .md")
    return 0


def machine() -> dict:
    """What the machine is, beyond its platform string: the CPU model and the kernels torch picks for it, and
    the versions of the packages a run's numbers depend on. The tiny task's warm-started model itself depends
    on the machine (likely its CPU kernels): built by the same code, it scored 0.41 before training on the earlier
    days' machine and 0.445 on an AMD EPYC with AVX2 (benchmarks/README.md), so compare runs made on one CPU."""
    import importlib.metadata as md
    import torch
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    versions = {}
    for name in ("torch", "transformers", "peft", "numpy"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu_model": cpu or platform.processor(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "gpu": gpu, "versions": versions}


def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="an evollm run config (model, task, env, algorithm.name)")
    p.add_argument("--set", action="append", default=[], help="override a config value (as evollm train --set)")
    p.add_argument("--evo-set", action="append", default=[], help="override an evolution setting of the population "
                   "arms only (an ablation, e.g. hpo.selection.protect_default=0)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE",
                   help="an extra arm evollm:NAME, the evollm arm with the override KEY=VALUE added to its "
                   "evolution settings (repeat with the same NAME for several overrides): ablations run side by "
                   "side with the other arms, seed by seed, in one invocation")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (first_seed, first_seed+1, ...)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--budget-cpu-s", type=float, required=True, help="CPU seconds per arm and seed")
    p.add_argument("--checkpoints", type=int, default=8, help="report evaluations at k/N of the budget (an even N puts one at "
                   "half the budget, where the second target is judged)")
    p.add_argument("--trial-steps", type=int, default=50, help="steps of one tuner trial (tpe, random)")
    p.add_argument("--tpe-startup", type=int, default=3, help="TPE's random start-up trials")
    p.add_argument("--grid-points", type=int, default=3, help="learning rates of the post-hoc grid, spread over the "
                   "space's range (0: none); the default run is a point of the grid too")
    p.add_argument("--grid-lr", type=float, nargs="*", default=[], help="the grid's learning rates instead")
    p.add_argument("--report-size", type=int, default=None,
                   help="held-out report items (single-turn: cut from task.n_test, default half; games: seeds)")
    p.add_argument("--arms", nargs="+", default=list(BASE_ARMS), choices=BASE_ARMS)
    p.add_argument("--skip", nargs="*", default=[], help="arms to leave out (e.g. grid)")
    p.add_argument("--lr-decay", choices=("cosine", "linear", "wsd"), default=None,
                   help="an experiment: decay every learning rate over the budget to --lr-floor of it (the "
                   "population and single-run arms; the tuners' trials keep theirs)")
    p.add_argument("--lr-floor", type=float, default=0.1, help="the --lr-decay factor at the end of the budget")
    p.add_argument("--lr-cooldown", type=float, default=0.2, help="with --lr-decay wsd: the last share of the budget "
                   "over which the rates fall to --lr-floor (constant before it)")
    p.add_argument("--cost-model", choices=("cpu", "gpu"), default="cpu",
                   help="how the budget is counted: 'cpu' seconds, or 'gpu': each CPU second a population spends "
                   "with N live members charged at what N members cost on one GPU, per member "
                   "(benchmarks/hpo/cost.py; a lone member is charged 1)")
    p.add_argument("--cost-file", default=None, help="the gpu_population.py measurement the gpu cost model is "
                   "fitted to (default: benchmarks/results/gpu_population_smollm2_cuda_float32.json)")
    p.add_argument("--device", default="cpu", help="where the runs train: 'cpu', or 'cuda' (the base and every "
                   "adapter on the GPU; the budget is then wall seconds, since the arms share the GPU's time, so "
                   "run with --jobs 1)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    p.add_argument("--out", default="benchmarks/results/hpo", help="OUT.json, OUT.png, OUT.md")
    p.add_argument("--parts-dir", default=None, help="where each run's JSON is kept (default under /tmp)")
    p.add_argument("--in-process", action="store_true", help="run every job in this process, one after another")
    p.add_argument("--summarise-only", action="store_true", help="tables and plot from the parts already there")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--job", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    try:
        args.variants = variants_of(args.variant)
    except ValueError as e:
        p.error(str(e))
    args.passthrough = ["--config", str(args.config), "--budget-cpu-s", str(args.budget_cpu_s),
                        "--checkpoints", str(args.checkpoints), "--trial-steps", str(args.trial_steps),
                        "--tpe-startup", str(args.tpe_startup)] + \
        (["--report-size", str(args.report_size)] if args.report_size else []) + \
        (["--lr-decay", args.lr_decay, "--lr-floor", str(args.lr_floor), "--lr-cooldown", str(args.lr_cooldown)]
         if args.lr_decay else []) + \
        (["--device", args.device] if args.device != "cpu" else []) + \
        (["--cost-model", args.cost_model] + (["--cost-file", args.cost_file] if args.cost_file else [])
         if args.cost_model != "cpu" else []) + \
        [x for s in args.set for x in ("--set", s)] + [x for s in args.evo_set for x in ("--evo-set", s)] + \
        [x for s in args.variant for x in ("--variant", s)]
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
