"""ONE evolution loop, shared by single-turn reasoning and multi-turn training.

Each step: every member collects experience and learns (``train_step``); every
``evaluation_interval`` steps all members are evaluated on identical work
(``evaluate``); every ``evo_steps`` steps the population is selected and mutated.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from ..population import Population
from ..rollout import evaluate_population, generate_population
from ..run.measure import member_tokens, with_costs
from .callbacks import Callback, LoopState, call


def validate_settings(pop: Sequence, max_steps: int, evaluation_interval: int, evo_steps: int | None,
                      tournament, mutation) -> None:
    """Reject inconsistent settings before any work is done."""
    if not pop:
        raise ValueError("the population is empty")
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if evaluation_interval < 1:
        raise ValueError(f"evaluation_interval must be >= 1, got {evaluation_interval}")
    if evo_steps is not None:
        if tournament is None or mutation is None:
            raise ValueError("evo_steps is set, so both tournament and mutation are required")
        if evo_steps < evaluation_interval or evo_steps % evaluation_interval:
            raise ValueError(f"evo_steps={evo_steps} must be a multiple of evaluation_interval="
                             f"{evaluation_interval}: selection needs a fresh evaluation")
        size = getattr(tournament, "population_size", None)
        if size is not None and size != len(pop):
            raise ValueError(f"tournament.population_size={size} but the population has {len(pop)} members")
    elif tournament is not None or mutation is not None:
        raise ValueError("tournament/mutation given without evo_steps: set evo_steps to evolve the population")
    if len({id(a.shared) for a in pop}) > 1:
        warnings.warn("members live on different base models; rollouts are batched per base", stacklevel=3)


def evolve(pop: Sequence, train_step: Callable[[list, int], dict[int, dict]],
           evaluate: Callable[[list], list[float]], *, max_steps: int, evaluation_interval: int,
           evo_steps: int | None = None, tournament=None, mutation=None, population: Population | None = None,
           save_elite: bool = False, elite_path: str | Path | None = None, verbose: bool = True,
           seed: int = 0, log: Callable[[str], None] | None = None,
           callbacks: Sequence[Callback] = ()) -> tuple[list, Population]:
    """The loop itself; :func:`finetune_llm_reasoning` and ``finetune_llm_multiturn`` supply the
    ``train_step`` (returns per-member metrics) and ``evaluate`` (returns fitness per member).
    ``callbacks`` (:class:`~evollm.training.callbacks.Callback`) are called at every step,
    evaluation, selection and at the end."""
    validate_settings(pop, max_steps, evaluation_interval, evo_steps, tournament, mutation)
    agents = list(pop)
    record = population if population is not None else Population(agents)
    log = log or (lambda msg: tqdm.write(msg))
    since_eval: dict[int, list[float]] = {}
    state = LoopState(0, max_steps, agents, record)
    call(callbacks, "on_train_begin", state)
    bar = tqdm(range(max_steps), desc="train", disable=not verbose, dynamic_ncols=True)
    for step in bar:
        torch.manual_seed(seed + step)
        metrics = train_step(agents, step)
        record.record_step(step + 1, metrics)
        for agent in agents:
            m = metrics.get(agent.index, {})
            agent.scores.append(m.get("mean_reward", math.nan))
            since_eval.setdefault(agent.index, []).append(m.get("mean_reward", math.nan))
            if not math.isfinite(m.get("loss", 0.0)):
                _quarantine(agent, m, log)
        done = step + 1
        state.step, state.agents = done, agents
        call(callbacks, "on_step_end", state, metrics)
        if done % evaluation_interval == 0 or done == max_steps:
            started = time.perf_counter()
            fitness = evaluate(agents)
            record.record_evaluation_time(done, time.perf_counter() - started)
            for i, agent in enumerate(agents):
                if getattr(agent, "quarantined", False):
                    fitness[i] = agent.fitness[-1] = -math.inf
            train_rewards = {a.index: _mean(since_eval.get(a.index, [])) for a in agents}
            record.record_evaluation(done, agents, fitness, train_rewards)
            call(callbacks, "on_evaluation", state, fitness)
            since_eval.clear()
            best = max(fitness)
            bar.set_postfix(best_fitness=f"{best:.3f}", train_reward=f"{_mean(train_rewards.values()):.3f}")
            if verbose:
                log(f"step {done:>5}  train reward {_mean(train_rewards.values()):.3f}  fitness "
                    + " ".join(f"{f:.3f}" for f in fitness))
        if evo_steps is not None and done % evo_steps == 0 and done < max_steps:
            agents, result = _evolve_once(agents, tournament, mutation, record, done)
            state.agents = agents
            call(callbacks, "on_selection", state, result)
            if save_elite:
                record.best().save_checkpoint(Path(elite_path or "elite") / f"step_{done}")
    record.members = list(agents)
    call(callbacks, "on_train_end", state)
    return agents, record


def _evolve_once(agents: list, tournament, mutation, record: Population, step: int) -> list:
    result = tournament.select(agents)
    mutation.mutation(result.mutate)
    record.record_selection(result, step)
    for old in result.dropped:
        if old not in result.population:
            old.release()
    return list(result.population), result


def _quarantine(agent, metrics: dict, log) -> None:
    if not getattr(agent, "quarantined", False):
        agent.quarantined = True
        log(f"member {agent.index} quarantined: non-finite loss {metrics.get('loss')} "
            "(it is no longer trained and will lose the next selection)")


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


def finetune_llm_reasoning(pop: Sequence, env, max_steps: int, evaluation_interval: int = 10,
                           evo_steps: int | None = None, tournament=None, mutation=None,
                           save_elite: bool = False, elite_path: str | Path | None = None,
                           verbose: bool = True, seed: int = 0, population: Population | None = None,
                           callbacks: Sequence[Callback] = ()) -> tuple[list, Population]:
    """Train a population of single-turn agents (GRPO family) on a :class:`ReasoningGym`.

    Every step, all members answer the same prompts (one batched generate over the shared base),
    each member learns from its own completions, then the env moves to the next batch. Returns
    ``(agents, population)``: the final members and their :class:`Population` record.
    """
    for agent in pop:
        rows = env.batch_size * agent.config.group_size
        if rows > agent.config.batch_size and rows % agent.config.batch_size:
            raise ValueError(f"member {agent.index}: data_batch_size_per_gpu ({env.batch_size}) x group_size "
                             f"({agent.config.group_size}) = {rows} rows do not divide into "
                             f"batch_size={agent.config.batch_size}")

    def train_step(agents, step):
        prompts = env.reset()
        started = time.perf_counter()
        rollouts = generate_population([a for a in agents if not getattr(a, "quarantined", False)], prompts)
        generated = time.perf_counter()
        active = [a for a in agents if a.index in rollouts]
        experiences = []
        for agent in active:
            completions, masks = rollouts[agent.index].per_prompt()
            experiences.append((completions, masks, env.score(completions, prompts)))
        env.step_to_next_batch()
        learnt = time.perf_counter()
        metrics = dict(zip([a.index for a in active], learn_all(active, experiences)))
        return with_costs(metrics, member_tokens(active, [e[1] for e in experiences]), generated - started,
                          time.perf_counter() - learnt)

    return evolve(pop, train_step, lambda agents: evaluate_population(agents, env), max_steps=max_steps,
                  evaluation_interval=evaluation_interval, evo_steps=evo_steps, tournament=tournament,
                  mutation=mutation, population=population, save_elite=save_elite, elite_path=elite_path,
                  verbose=verbose, seed=seed, callbacks=callbacks)
