"""Population training on multi-turn environments, on the SAME evolution loop as reasoning.

:func:`finetune_llm_multiturn` only supplies :func:`evollm.training.loop.evolve` with a
``train_step`` and an ``evaluate``:

* ``train_step``: every member plays the same ``episodes_per_step`` seeds (``group_size``
  episodes per seed for group-relative members), all members' running episodes answered
  by one batched, adapter-routed ``generate`` per turn; then each member learns from its
  own episodes.  LLMPPO / LLMREINFORCE get ``(ids, action_masks, turn_ids, rewards[B, K])``;
  GRPO-family members get ``(ids, action_masks, returns[P, G])``, where an episode's reward
  is the sum of its turn rewards and advantages are relative to the other episodes of the
  same seed (environment tokens are masked out in both cases).
* ``evaluate``: fitness = mean episode return over a fixed set of seeded episodes
  (``eval_episodes`` seeds, disjoint from training seeds), greedy decoding, identical for
  every member.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..algorithms.grpo import GRPO
from ..algorithms.multiturn_rollout import Episode, EnvPool, collect_episodes, stack_episodes
from ..population import Population
from .loop import evolve

#: Evaluation seeds start here, far from the training seeds (``seed * 10**6 + step * episodes_per_step + i``).
EVAL_SEED_OFFSET = 2**31


def episodes_to_experiences(agent, episodes: Sequence[Episode], num_turns: int) -> tuple:
    """What ``agent.learn`` takes for these episodes (see the module docstring)."""
    ids, masks, turn_ids, rewards = stack_episodes(episodes, agent.pad_token_id, num_turns)
    if isinstance(agent, GRPO):
        group = agent.config.group_size
        returns = torch.tensor([e.episode_return for e in episodes], dtype=torch.float32)
        return ids, masks, returns.reshape(-1, group)
    return ids, masks, turn_ids, rewards


def evaluate_episodes(agents: Sequence, pool: EnvPool, seeds: Sequence[int], max_turns: int | None = None,
                      record: bool = True) -> tuple[list[float], dict[int, list[Episode]]]:
    """Greedy episodes of every member on ``seeds``; returns ``(mean return per member, episodes)``.
    Appends the fitness to each member's ``fitness`` when ``record``."""
    episodes = collect_episodes(agents, pool.get(len(agents) * len(seeds)), seeds, training=False,
                                max_turns=max_turns)
    fitness = [sum(e.episode_return for e in episodes[a.index]) / len(seeds) for a in agents]
    if record:
        for agent, f in zip(agents, fitness):
            agent.fitness.append(f)
    return fitness, episodes


def success_rate(episodes: Sequence[Episode]) -> float:
    """Fraction of episodes the environment reported as a success (``info["success"]``)."""
    return sum(e.success for e in episodes) / len(episodes) if episodes else math.nan


def finetune_llm_multiturn(pop: Sequence, max_turns: int, env_factory: Callable[[], object], max_steps: int,
                           evaluation_interval: int = 10, evo_steps: int | None = None, tournament=None,
                           mutation=None, episodes_per_step: int = 16, eval_episodes: int = 64,
                           save_elite: bool = False, elite_path: str | Path | None = None, verbose: bool = True,
                           seed: int = 0, population: Population | None = None,
                           on_evaluation: Callable[[int, list, dict], None] | None = None) -> tuple[list, Population]:
    """Train a population on a multi-turn environment.

    Args:
        pop: the members (LLMPPO, LLMREINFORCE or GRPO family), all on one shared base.
        max_turns: most model turns per episode.
        env_factory: returns a fresh :class:`~evollm.envs.multiturn.TokenObservationWrapper`; one is
            made per concurrently played episode and reused.
        max_steps, evaluation_interval, evo_steps, tournament, mutation, save_elite, elite_path, verbose,
            seed, population: as in :func:`~evollm.training.loop.finetune_llm_reasoning`.
        episodes_per_step: training seeds per step (each member plays each, ``group_size`` times for
            group-relative members).
        eval_episodes: size of the fixed evaluation set of seeds.
        on_evaluation: optional ``callback(step, agents, episodes_by_member)`` after each evaluation
            (e.g. to log success rates).

    Returns ``(agents, population)`` like the reasoning loop.
    """
    if max_turns < 1 or episodes_per_step < 1 or eval_episodes < 1:
        raise ValueError(f"max_turns, episodes_per_step and eval_episodes must be >= 1, got {max_turns}, "
                         f"{episodes_per_step}, {eval_episodes}")
    pool = EnvPool(env_factory)
    eval_seeds = [EVAL_SEED_OFFSET + seed * 10**6 + i for i in range(eval_episodes)]
    progress = {"step": 0}

    def train_step(agents, step):
        progress["step"] = step + 1
        active = [a for a in agents if not getattr(a, "quarantined", False)]
        seeds = [seed * 10**6 + step * episodes_per_step + i for i in range(episodes_per_step)]
        groups = [max(1, int(getattr(a.config, "group_size", 1))) for a in active]
        envs = pool.get(len(seeds) * sum(groups))
        episodes = collect_episodes(active, envs, seeds, training=True, max_turns=max_turns)
        return {a.index: a.learn(episodes_to_experiences(a, episodes[a.index], max_turns)) for a in active}

    def evaluate(agents):
        fitness, episodes = evaluate_episodes(agents, pool, eval_seeds, max_turns)
        if on_evaluation is not None:
            on_evaluation(progress["step"], agents, episodes)
        return fitness

    return evolve(pop, train_step, evaluate, max_steps=max_steps, evaluation_interval=evaluation_interval,
                  evo_steps=evo_steps, tournament=tournament, mutation=mutation, population=population,
                  save_elite=save_elite, elite_path=elite_path, verbose=verbose, seed=seed)
