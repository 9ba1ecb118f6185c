"""The arms of the benchmark. Each one gets the same CPU-time budget per seed and is scored the same way.

* ``evollm`` -- a population with the library's default evolution settings: whatever ``evollm train``
  gives for the task's config once a population is asked for (search space, founders, selection,
  mutation, schedule); :func:`evolution_overrides` says what the harness adds where the library leaves a
  value unset.
* ``no_mutation`` -- the same population and selection, every hyperparameter change off (does mutation help?):
  no mutation operator, and neither the lone member's anneal nor a roll-back's lower rate
  (:func:`frozen_overrides`); each member trains at its founder's values.
* ``tpe`` / ``random`` -- Optuna TPE / random search over the same space: single-member trials of
  ``trial_steps`` steps one after another, each ranked by one validation evaluation at its end.
* ``default`` -- one member at the library's defaults for the whole budget: what ``evollm train`` gives
  for the task's config, held-out evaluations every ``train.evaluation_interval`` steps included (the
  evollm arm pays for the same evaluations of each of its members).
* ``evollm:NAME`` -- evollm with the overrides ``--variant NAME=KEY=VALUE`` names (an ablation run side by
  side with the other arms).
* ``grid:NAME=VALUE`` -- one member at a fixed learning rate (every learning rate of the space set to
  VALUE); the best point of the grid, chosen after the fact, is context, not a competitor.

Budget: ``time.process_time()`` of the worker process (one torch thread), counted from after the base
is loaded and the task built; it includes generation, learning, the arm's own validation evaluations,
selection and mutation. With ``--cost-model gpu`` each of those seconds a population spends with N live
members is charged at what N members cost per member on one GPU (:mod:`benchmarks.hpo.cost`; a lone
member is charged 1). An arm stops at the first step end past the budget. The evollm arms also get
the budget as ``train.max_time`` on the CPU clock where the library has one (its narrowing schedule
reads it). At every checkpoint ``k/checkpoints`` of the budget the arm's current recommendation
(evollm: the library's best member, as ``Population.best``; tuners: the best finished trial by its
validation score; single runs: the member) is copied (adapter weights only), and after the run each
copy is scored on the report set, off the clock, greedy, the same way in every arm.
"""

from __future__ import annotations

import math
import time

#: what the harness adds to the evollm arm only where the library's run config leaves the value unset
#: (the same for every task: population size and a selection interval when train.evo_steps is null)
EVOLUTION_FALLBACK = {"population_size": 8, "evo_steps_per_evaluation": 2}
#: the space used when the library offers no default search space (same for every task)
FALLBACK_SPACE = {"lr": dict(min=1e-5, max=1e-2, log=True)}  # every learning rate of the algorithm
LR_NAMES = ("lr", "lr_actor", "lr_critic", "actor_learning_rate", "critic_learning_rate")
FOREVER = 10**9


class OutOfBudget(Exception):
    pass


class Clock:
    """The budget's seconds since the arm started: CPU seconds of this process (all threads), or, with a
    ``cost`` model (``--cost-model gpu``, :mod:`benchmarks.hpo.cost`), those seconds charged by the number of
    live members; and wall seconds."""

    def __init__(self, budget: float, checkpoints: int, cost=None, wall: bool = False):
        from .cost import ChargedClock
        self.budget = float(budget)
        self.marks = [budget * (k + 1) / checkpoints for k in range(checkpoints)]
        self.charged = ChargedClock(cost, time.perf_counter if wall else time.process_time)
        self.wall_budget = wall  # a run on a GPU: the budget is wall seconds
        self.wall0 = time.perf_counter()

    def cpu(self) -> float:
        """Budget seconds spent (CPU seconds, charged by the cost model if there is one)."""
        return self.charged()

    def raw_cpu(self) -> float:
        return self.charged.raw()

    def wall(self) -> float:
        return time.perf_counter() - self.wall0


def actor_parameters(member) -> list:
    """The adapter weights greedy generation depends on: the member's (actor) adapter, or every agent's of
    an IPPO team."""
    agents = getattr(member, "agents", None) or [member]
    return [p for a in agents for p in a.shared.parameters(a.adapter_name())]


def snapshot(agent) -> list:
    """A copy of the member's (actor) adapter weights: all that greedy generation depends on."""
    return [p.detach().clone() for p in actor_parameters(agent)]


class Recorder:
    """What one (arm, seed) run leaves to score: at every checkpoint ``k/N`` of the budget, a snapshot of
    the arm's recommendation (copied in the run, scored on the report set after it, off the clock)."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.checkpoints: list[dict] = []
        self.evaluations: list[dict] = []
        self.snapshots: dict[str, list] = {}
        self.steps_before = 0  # steps of the earlier trials of a tuner arm
        self.extra_callbacks: list = []  # the single-run and population arms' (--lr-decay)

    def keep(self, key: str, agent) -> str:
        self.snapshots[key] = snapshot(agent)
        return key

    def step_end(self, step: int, recommend) -> None:
        """``recommend()`` returns the member to snapshot, or the key of a snapshot already kept."""
        cpu = self.clock.cpu()
        due = [m for m in self.clock.marks[len(self.checkpoints):] if cpu >= m]
        if due:
            rec = recommend()
            key = rec if isinstance(rec, str) else self.keep(f"checkpoint{len(self.checkpoints)}", rec)
            for mark in due:
                self.checkpoints.append({"fraction": mark / self.clock.budget, "cpu_s": cpu,
                                         "wall_s": self.clock.wall(), "step": step, "snapshot": key})
        if cpu >= self.clock.budget:
            raise OutOfBudget

    def callback(self, recommend, trial: int | None = None):
        from evollm.training.callbacks import Callback
        rec = self

        class _Budget(Callback):
            def on_step_end(self, state, metrics):
                rec.step_end(rec.steps_before + state.step, lambda: recommend(state))

            def on_train_begin(self, state):  # the seconds from here on are the population's
                rec.clock.charged.set_members(len(state.agents))

            def on_step_complete(self, state):  # after any cut: the next seconds are charged at the new size
                rec.clock.charged.set_members(len(state.agents))

            def on_evaluation(self, state, fitness):
                rec.evaluations.append({"cpu_s": rec.clock.cpu(), "step": state.step, "trial": trial,
                                        "members": [int(a.index) for a in state.agents],
                                        "fitness": [float(f) for f in fitness],
                                        "fitness_se": [float(x) for x in getattr(fitness, "stderr", None) or []],
                                        "hyperparameters": [hps(a) for a in state.agents]})
        return _Budget()

    def score(self, task, cfg, initial: dict) -> int:
        """Score every kept snapshot on the report set (a fresh member loaded with its weights) and fill
        in the checkpoints' ``score``/``se``; returns the number of report evaluations."""
        from .task import mean_se
        scores = {"initial": initial}
        for key, tensors in self.snapshots.items():
            member = members_of(with_overrides(cfg, ["algorithm.population_size=1", "hpo={}"]), task, None)[0]
            params = actor_parameters(member)
            if [p.shape for p in params] != [t.shape for t in tensors]:
                raise ValueError(f"snapshot {key}: adapter shapes differ from a fresh member's (evolved LoRA rank?)")
            with torch_no_grad():
                for p, t in zip(params, tensors):
                    p.copy_(t)
            scores[key] = dict(zip(("score", "se"), mean_se(task.report(member))))
            member.release()
        for c in self.checkpoints:
            c.update(scores[c["snapshot"]])
        return len(self.snapshots)


def torch_no_grad():
    import torch
    return torch.no_grad()


def hps(agent) -> dict:
    """The member's evolvable hyperparameters (those of its hp_config) as plain values."""
    names = list(getattr(agent, "hp_config", None) or []) or [n for n in LR_NAMES if hasattr(agent.config, n)]
    out = {}
    for name in names:
        try:
            v = agent.get_hyperparameter(name)
        except (AttributeError, KeyError, ValueError):
            continue
        out[name] = v if isinstance(v, (int, str, bool)) or v is None else float(v)
    return out


def library_best(state):
    """The member the library would hand back now (:meth:`Population.best` over the live members, with
    the run's kept best state, ``train.keep_best``, and a member parked by a stall swap,
    ``hpo.narrowing.revive``)."""
    return state.record.best(state.agents)


# --------------------------------------------------------------------------- the arms' configs
def evolution_overrides(cfg) -> list[str]:
    """``--set`` overrides that turn the task's config into the evollm arm: a population, and evolution on,
    with the library's defaults for everything it defines (fallbacks in :data:`EVOLUTION_FALLBACK`)."""
    out = []
    if cfg.algorithm.population_size < 2:
        out.append(f"algorithm.population_size={EVOLUTION_FALLBACK['population_size']}")
    if cfg.train.evo_steps is None:
        out.append(f"train.evo_steps={cfg.train.evaluation_interval * EVOLUTION_FALLBACK['evo_steps_per_evaluation']}")
    return out


def search_space(cfg):
    """The evollm arm's search space: the library's (``build_hpo``), else :data:`FALLBACK_SPACE`."""
    from evollm.hpo import HyperparameterConfig, RLParameter
    from evollm.recipes.builders import build_hpo

    hp_config = build_hpo(cfg)[0]
    if hp_config is None or not len(hp_config):
        hp_config = HyperparameterConfig(**{n: RLParameter(**FALLBACK_SPACE["lr"]) for n in _lr_names(cfg)})
    return hp_config


def _lr_names(cfg) -> list[str]:
    from evollm.config import algorithm_class
    mutable = set(getattr(algorithm_class(cfg.algorithm.name), "MUTABLE", ()))
    names = [n for n in LR_NAMES if n in mutable]
    if "lr_actor" in names and "lr" in names:
        names.remove("lr")
    return names


def with_overrides(cfg, overrides: list[str]):
    from evollm.config import RunConfig
    from evollm.config.schema import apply_override
    data = cfg.to_dict(explicit=True)
    for item in overrides:
        apply_override(data, item)
    return RunConfig.from_dict(data)


def members_of(cfg, task, hp_config):
    from evollm.recipes.cli import build_population
    return build_population(cfg, task.model, task.tokenizer, hp_config)


# --------------------------------------------------------------------------- arms
def budget_kwargs(cfg, clock: Clock) -> dict:
    """The loop keywords ``evollm train`` derives from the config for a run with a CPU-time budget of
    ``clock.budget`` seconds (``train.max_time`` on the CPU clock, and the narrowing schedule it drives),
    for the library versions that have them; the harness stops every arm at the same point anyway. With a
    cost model the loop reads the harness's charged clock instead of its own CPU clock."""
    import inspect

    from evollm.recipes import builders
    from evollm.training.loop import evolve
    try:  # the loop's options live in LoopSettings (or, in older versions, in evolve's signature)
        import dataclasses

        from evollm.training.settings import LoopSettings
        names = {f.name for f in dataclasses.fields(LoopSettings)}
    except ImportError:
        names = set(inspect.signature(evolve).parameters)
    out = {}
    if "max_time_clock" in names:
        own_clock = clock.charged.cost is not None or clock.wall_budget
        out.update(max_time=clock.budget, max_time_clock=clock.charged if own_clock else "cpu")
    if hasattr(builders, "build_narrowing"):
        out["narrowing"] = builders.build_narrowing(cfg)
    return {**out, **keep_best_kwargs(cfg)}


def single_budget_kwargs(cfg, clock: Clock) -> dict:
    """A single run's loop keywords: ``keep_best``, and with ``train.lr_cooldown`` set, the budget as
    ``train.max_time`` (on the CPU clock, or the harness's own) so that the cool-down knows where the budget
    ends, as the population's does. Without a cool-down the budget changes nothing in a single run (the harness
    stops it at the same step), and it is left out, as before."""
    out = keep_best_kwargs(cfg)
    if getattr(cfg.train, "lr_cooldown", 0.0) > 0:
        own_clock = clock.charged.cost is not None or clock.wall_budget
        out.update(max_time=clock.budget, max_time_clock=clock.charged if own_clock else "cpu")
    return out


def keep_best_kwargs(cfg) -> dict:
    """``keep_best`` (and ``lr_cooldown``) as ``evollm train`` sets them from the config, for the library versions
    that have them."""
    out = {"keep_best": cfg.train.keep_best} if hasattr(cfg.train, "keep_best") else {}
    if getattr(cfg.train, "lr_cooldown", 0.0) > 0:
        out.update(lr_cooldown=cfg.train.lr_cooldown, lr_cooldown_floor=cfg.train.lr_cooldown_floor)
    return out


#: the mutation operators off: a clone keeps its parent's hyperparameters and LoRA rank
MUTATIONS_OFF = ["hpo.mutation.no_mutation=1.0", "hpo.mutation.rl_hp=0.0", "hpo.mutation.lora_rank=0.0"]
#: the narrowing's own hyperparameter changes off: the lone member's anneal on a plateau, the learning-rate
#: cut of a roll-back's copy (the roll-back itself, a return to the best state, is selection and stays), a stall
#: swap's rate between two members, the decay of an actor-critic member's rate, and a faster member's pull on it
NARROWING_CHANGES_OFF = ["hpo.narrowing.anneal=false", "hpo.narrowing.rollback_lr=1.0", "hpo.narrowing.revive_rate=own",
                         "hpo.narrowing.decay=none", "hpo.narrowing.faster_se=0"]


def frozen_overrides(cfg) -> list[str]:
    """The ``no_mutation`` arm's overrides: no hyperparameter ever changes during the run, so every member
    trains at its founder's values. The mutation operators are off, and so are the narrowing's changes to the
    member training alone (the anneal halves its learning rates on a plateau, a roll-back's copy trains at a
    lower rate, a stall swap's reserve trains between two rates, an actor-critic member's rate decays, a faster
    member's rate pulls the lone member's up): PBT's explore step, applied to one member (2026-11-28; before, the
    arm kept them and measured the clones' perturbation alone; ``--variant NAME=`` with :data:`MUTATIONS_OFF` runs
    that arm; the decay and the faster member's pull were added to the list on 2026-12-07, night).
    Only the options the library version has are set.

    >>> from evollm.config import RunConfig
    >>> frozen_overrides(RunConfig.from_dict({"model": {"source": "tiny"}, "algorithm": {"name": "GRPO"}}))[-5:]
    ['hpo.narrowing.anneal=false', 'hpo.narrowing.rollback_lr=1.0', 'hpo.narrowing.revive_rate=own', 'hpo.narrowing.decay=none', 'hpo.narrowing.faster_se=0']
    """
    narrowing = getattr(getattr(cfg, "hpo", None), "narrowing", None)
    changes = [o for o in NARROWING_CHANGES_OFF if hasattr(narrowing, o.split(".")[2].split("=")[0])]
    return list(MUTATIONS_OFF) + changes


def run_population(task, cfg, rec: Recorder, mutate: bool, evo_set: list[str] = ()) -> dict:
    """A population arm; ``evo_set``: ``--evo-set`` overrides of its evolution settings (ablations)."""
    from evollm.recipes.builders import build_hpo

    cfg = with_overrides(cfg, evolution_overrides(cfg) + list(evo_set) + ([] if mutate else frozen_overrides(cfg)))
    hp_config = search_space(cfg)
    _, mutation, selection = build_hpo(cfg)
    members = members_of(cfg, task, hp_config)
    founders = [hps(a) for a in members]
    live: dict = {}

    def recommend(state):
        live["agents"], live["record"] = state.agents, state.record
        return library_best(state)

    try:
        task.train(members, seed=cfg.seed, max_steps=FOREVER, evaluation_interval=cfg.train.evaluation_interval,
                   evo_steps=cfg.train.evo_steps, tournament=selection, mutation=mutation,
                   callbacks=[rec.callback(recommend)] + rec.extra_callbacks, **budget_kwargs(cfg, rec.clock))
    except OutOfBudget:
        pass
    return {"founders": founders, "population_size": len(members), "evo_steps": cfg.train.evo_steps,
            "evaluation_interval": cfg.train.evaluation_interval, "mutation": cfg.hpo.mutation.to_dict(),
            "selection": cfg.hpo.selection.to_dict(),
            "narrowing": cfg.hpo.narrowing.to_dict() if hasattr(cfg.hpo, "narrowing") else None,
            "final_members": [hps(a) for a in live.get("agents", [])],
            "revivals": [{k: r.get(k) for k in ("step", "kept", "dropped", "scores", "budget_fraction", "no_signal",
                                                "reason", "rates")}
                         for r in getattr(live.get("record"), "selection_rows", []) if r["kind"] == "revival"],
            "rankings": [{k: r.get(k) for k in ("step", "kind", "size_before", "size_after", "spread", "snr",
                                                "paired_snr", "tied", "budget_fraction", "demoted", "kept",
                                                "dropped", "scores", "rates")}
                         for r in getattr(live.get("record"), "selection_rows", []) if r["kind"] != "revival"]}


def run_single(task, cfg, rec: Recorder, fixed: dict | None = None) -> dict:
    cfg = with_overrides(cfg, ["algorithm.population_size=1", "hpo={}"]
                         + [f"algorithm.hyperparameters.{k}={v:.6e}" for k, v in (fixed or {}).items()])
    agent = members_of(cfg, task, None)[0]
    try:
        task.train([agent], seed=cfg.seed, max_steps=FOREVER, evaluation_interval=cfg.train.evaluation_interval,
                   callbacks=[rec.callback(library_best)] + rec.extra_callbacks, **single_budget_kwargs(cfg, rec.clock))
    except OutOfBudget:
        pass
    return {"hyperparameters": hps(agent), "fixed": fixed or {}}


def run_trials(task, cfg, rec: Recorder, sampler: str, trial_steps: int, startup: int) -> dict:
    import optuna
    from evollm.hpo import hp_config_to_distributions

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    space_cfg = with_overrides(cfg, evolution_overrides(cfg))
    distributions = hp_config_to_distributions(search_space(space_cfg))
    seed = int(cfg.seed)
    make = {"tpe": lambda: optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup),
            "random": lambda: optuna.samplers.RandomSampler(seed=seed)}[sampler]
    study = optuna.create_study(direction="maximize", sampler=make())
    single = with_overrides(cfg, ["algorithm.population_size=1", "hpo={}"])
    trials: list[dict] = []
    best: dict = {"value": -math.inf, "key": "initial"}
    k = 0
    while True:
        trial = study.ask(distributions)
        params = dict(trial.params)
        agent = members_of(single, task, None)[0]
        for name, value in params.items():
            agent.set_hyperparameter(name, value)
        n_eval = len(rec.evaluations)
        stopped = False
        try:
            task.train([agent], seed=seed + 1000 * k, max_steps=trial_steps, evaluation_interval=trial_steps,
                       callbacks=[rec.callback(lambda state: best["key"], trial=k)])
        except OutOfBudget:
            stopped = True
        rec.steps_before += trial_steps if not stopped else 0
        done = rec.evaluations[n_eval:]
        value = done[-1]["fitness"][0] if done and not stopped else None
        entry = {"trial": k, "hyperparameters": params, "value": value, "finished": value is not None}
        if value is not None:
            study.tell(trial, value)
            if value > best["value"]:
                best.update(value=value, key=rec.keep(f"trial{k}", agent), trial=k)
        trials.append(entry)
        agent.release()
        if stopped:
            break
        k += 1
        try:  # a trial's final evaluation may cross a checkpoint, or the budget
            rec.step_end(rec.steps_before, lambda: best["key"])
        except OutOfBudget:
            break
    return {"trials": trials, "trial_steps": trial_steps, "best_trial": best.get("trial"),
            "space": {k: str(v) for k, v in distributions.items()}}


def decay_multiplier(kind: str, fraction: float, floor: float, cooldown: float = 0.2) -> float:
    """The factor on every learning rate at ``fraction`` of the budget (``--lr-decay``): from 1 down to
    ``floor`` at the end, linearly or along a half cosine over the whole budget, or (``wsd``: warm-up, stable,
    decay, without the warm-up) 1 until the last ``cooldown`` of the budget and linearly down to ``floor`` over it.

    >>> [round(decay_multiplier("wsd", f, 0.1, 0.2), 3) for f in (0.0, 0.8, 0.9, 1.0)]
    [1.0, 1.0, 0.55, 0.1]
    """
    f = min(max(fraction, 0.0), 1.0)
    if kind == "wsd":
        shape = min(1.0, (1.0 - f) / cooldown) if cooldown > 0 else 1.0
    else:
        shape = 1.0 - f if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * f))
    return floor + (1.0 - floor) * shape


def lr_decay_callback(clock: Clock, kind: str, floor: float, cooldown: float = 0.2):
    """An experiment, not a library option: after every step (selection and mutation included) each
    member's optimizer groups (every agent's, in an IPPO team) take the member's own (evolving) learning rate
    times :func:`decay_multiplier` of the CPU budget spent, in the population and single-run arms alike."""
    from evollm.training.callbacks import Callback

    class _Decay(Callback):
        def on_step_complete(self, state):
            m = decay_multiplier(kind, clock.cpu() / clock.budget, floor, cooldown)
            for member in state.agents:
                for agent in getattr(member, "agents", None) or [member]:
                    c = agent.config
                    base = {"actor": getattr(c, "lr_actor", None) or c.lr, "critic": getattr(c, "lr_critic", None)}
                    for group in agent.optimizer.param_groups:
                        group["lr"] = base[group["name"]] * m
    return _Decay()


def run_arm(arm: str, task, cfg, clock: Clock, args) -> tuple[dict, Recorder]:
    rec = Recorder(clock)
    if getattr(args, "lr_decay", None):
        rec.extra_callbacks.append(lr_decay_callback(clock, args.lr_decay, args.lr_floor,
                                                     getattr(args, "lr_cooldown", 0.2)))
    if arm == "evollm":
        out = run_population(task, cfg, rec, mutate=True, evo_set=args.evo_set)
    elif arm == "no_mutation":
        out = run_population(task, cfg, rec, mutate=False, evo_set=args.evo_set)
    elif arm.startswith("evollm:"):  # --variant NAME=KEY=VALUE: evollm with overrides of its own
        out = run_population(task, cfg, rec, mutate=True, evo_set=list(args.evo_set) + args.variants[arm.split(":", 1)[1]])
    elif arm == "default":
        out = run_single(task, cfg, rec)
    elif arm in ("tpe", "random"):
        out = run_trials(task, cfg, rec, arm, args.trial_steps, args.tpe_startup)
    elif arm.startswith("grid:"):
        fixed = grid_point(cfg, arm)
        out = run_single(task, cfg, rec, fixed)
    else:
        raise ValueError(f"unknown arm {arm!r}")
    return out, rec


def grid_point(cfg, arm: str) -> dict:
    """``grid:lr=3e-4`` -> every learning rate of the search space at 3e-4."""
    value = float(arm.split("=", 1)[1])
    names = list(search_space(with_overrides(cfg, evolution_overrides(cfg))))
    lrs = [n for n in names if n in LR_NAMES] or _lr_names(cfg)
    return {n: value for n in lrs}


def grid_values(cfg, points: int) -> list[float]:
    """``points`` learning rates evenly spread (log scale) inside the search space's learning-rate range."""
    space = search_space(with_overrides(cfg, evolution_overrides(cfg)))
    p = next(space[n] for n in space if n in LR_NAMES)
    lo, hi = math.log10(p.min), math.log10(p.max)
    return [float(f"{10 ** (lo + (hi - lo) * (i + 0.5) / points):.2g}") for i in range(points)]
