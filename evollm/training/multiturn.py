"""Population training on multi-turn environments, on the SAME evolution loop as reasoning.

:func:`finetune_llm_multiturn` only supplies :func:`evollm.training.loop.evolve` with a
``train_step`` and an ``evaluate``:

* ``train_step``: every member plays the same ``episodes_per_step`` seeds (``group_size``
  episodes per seed for group-relative members), all members' running episodes answered
  by one batched, adapter-routed ``generate`` per turn; then each member learns from its
  own episodes.  LLMPPO / LLMREINFORCE get ``(ids, action_masks, turn_ids, rewards[B, K], truncated[B])``
  (``truncated``: the episode was cut by the turn limit or the context length; PPO bootstraps it);
  GRPO-family members get ``(ids, action_masks, returns[P, G])``, where an episode's reward
  is the sum of its turn rewards and advantages are relative to the other episodes of the
  same seed (environment tokens are masked out in both cases).
* ``evaluate``: fitness = mean episode return over a fixed set of seeded episodes
  (``eval_episodes`` seeds, disjoint from training seeds), greedy decoding, identical for
  every member.

Under ``accelerate launch --num_processes N`` every process plays its contiguous ``1/N`` of the step's
seeds and of the evaluation seeds (both must split evenly); members' gradients are averaged over
processes and the returns summed, so every process takes the same decisions (see
:mod:`evollm.parallel.distributed`).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from evollm.parallel import distributed as dist
from ..algorithms.grpo import GRPO
from evollm.run.population import Population
from ..rollout import Episode, EnvPool, collect_episodes, stack_episodes
from ..rollout.population import Fitness, item_products, mean_stderr
from ..run.measure import member_tokens, with_costs
from .compat import AGILERL_ONLY, agilerl_extras, pick_selection
from .data_parallel import reduce_fitness, seed_sampling
from .quarantine import healthy
from .loop import closing_all, evolve, learn_all, run_callbacks
from .settings import LoopSettings, loop_settings

#: Evaluation seeds start here, far from the training seeds (``seed * 10**6 + step * episodes_per_step + i``).
EVAL_SEED_OFFSET = 2**31


def episodes_to_experiences(agent, episodes: Sequence[Episode], num_turns: int) -> tuple:
    """What ``agent.learn`` takes for these episodes (see the module docstring)."""
    ids, masks, turn_ids, rewards = stack_episodes(episodes, agent.pad_token_id, num_turns)
    if isinstance(agent, GRPO):
        group = agent.config.group_size
        returns = torch.tensor([e.episode_return for e in episodes], dtype=torch.float32)
        return ids, masks, returns.reshape(-1, group)
    truncated = torch.tensor([e.truncated for e in episodes], dtype=torch.bool)
    return ids, masks, turn_ids, rewards, truncated


def evaluate_episodes(agents: Sequence, pool: EnvPool, seeds: Sequence[int], max_turns: int | None = None,
                      record: bool = True) -> tuple[list[float], dict[int, list[Episode]]]:
    """Greedy episodes of every member on ``seeds``; returns ``(mean return per member, episodes)``.
    Records the fitness in each member's history when ``record``."""
    episodes = collect_episodes(agents, pool.get(len(agents) * len(seeds)), seeds, training=False,
                                max_turns=max_turns)
    returns = [[float(e.episode_return) for e in episodes[a.index]] for a in agents]
    cross = item_products(torch.tensor(returns, dtype=torch.float64)).tolist()  # every member played the same seeds
    fitness = Fitness([sum(r) / len(seeds) for r in returns],
                      [mean_stderr(sum(r), sum(x * x for x in r), len(r)) for r in returns],
                      [sum(x * x for x in r) for r in returns], cross, len(seeds))
    if record:
        for agent, f in zip(agents, fitness):
            agent.record_fitness(f)
    return fitness, episodes


def success_rate(episodes: Sequence[Episode]) -> float:
    """Fraction of episodes the environment reported as a success (``info["success"]``)."""
    return sum(e.success for e in episodes) / len(episodes) if episodes else math.nan


def finetune_llm_multiturn(pop: Sequence, max_turns: int, env_factory: Callable[[], object],
                           settings: LoopSettings | None = None, *, tournament=None, mutation=None,
                           episodes_per_step: int = 16, eval_episodes: int = 64, population: Population | None = None,
                           on_evaluation: Callable[[int, list, dict], None] | None = None,
                           callbacks: Sequence = (), selection_strategy=None, max_wall_seconds=None,
                           **options) -> tuple[list, Population]:
    """Train a population on a multi-turn environment.

    Args:
        pop: the members (LLMPPO, LLMREINFORCE or GRPO family), all on one shared base.
        max_turns: most model turns per episode.
        env_factory: returns a fresh :class:`~evollm.envs.multiturn.TokenObservationWrapper`; one is
            made per concurrently played episode and reused.
        settings: the loop's options (:class:`~evollm.training.settings.LoopSettings`, or its fields as
            keywords), as in :func:`~evollm.training.loop.finetune_llm_reasoning` (episode seeds follow
            from the step, so a checkpoint holds no env state).
        tournament, mutation, population: as in :func:`~evollm.training.loop.finetune_llm_reasoning`.
        episodes_per_step: training seeds per step (each member plays each, ``group_size`` times for
            group-relative members).
        eval_episodes: size of the fixed evaluation set of seeds.
        on_evaluation: optional ``callback(step, agents, episodes_by_member)`` after each evaluation
            (e.g. to log success rates).

    Returns ``(agents, population)`` like the reasoning loop. AgileRL's ``selection_strategy``
    (``tournament``), ``max_wall_seconds`` (``max_time``), ``init_hp``, ``wb`` and ``accelerator`` are
    accepted (see :mod:`evollm.training.compat`).
    """
    agilerl_extras({k: options.pop(k) for k in list(options) if k in AGILERL_ONLY})
    tournament = pick_selection(tournament, selection_strategy)
    if max_wall_seconds is not None:
        options.setdefault("max_time", max_wall_seconds)
    s = loop_settings(settings, options, "finetune_llm_multiturn")
    seed = s.seed
    if max_turns < 1 or episodes_per_step < 1 or eval_episodes < 1:
        raise ValueError(f"max_turns, episodes_per_step and eval_episodes must be >= 1, got {max_turns}, "
                         f"{episodes_per_step}, {eval_episodes}")
    dist.init()
    for name, n in (("episodes_per_step", episodes_per_step), ("eval_episodes", eval_episodes)):
        if n % dist.num_processes():
            raise ValueError(f"{name}={n} does not split over {dist.num_processes()} processes; use a multiple of "
                             "the number of processes")
    pool = EnvPool(env_factory)
    eval_seeds = [EVAL_SEED_OFFSET + seed * 10**6 + i for i in range(eval_episodes)]
    progress = {"step": 0}

    def train_step(agents, step):
        progress["step"] = step + 1
        active = healthy(agents)
        seeds = [seed * 10**6 + step * episodes_per_step + i for i in range(episodes_per_step)]
        seeds = dist.shard(seeds, "episodes (episodes_per_step)")  # multi-process: this process's share
        seed_sampling(seed, step)
        groups = [max(1, int(getattr(a.config, "group_size", 1))) for a in active]
        envs = pool.get(len(seeds) * sum(groups))
        started = time.perf_counter()
        episodes = collect_episodes(active, envs, seeds, training=True, max_turns=max_turns)
        generated = time.perf_counter()
        experiences = [episodes_to_experiences(a, episodes[a.index], max_turns) for a in active]
        learnt = time.perf_counter()
        metrics = dict(zip((a.index for a in active), learn_all(active, experiences)))  # fused where it can be
        return with_costs(metrics, member_tokens(active, [e[1] for e in experiences]), generated - started,
                          time.perf_counter() - learnt)

    def evaluate(agents):
        mine = dist.shard(eval_seeds, "evaluation episodes (eval_episodes)")
        fitness, episodes = evaluate_episodes(agents, pool, mine, max_turns, record=False)
        if dist.is_distributed():  # every process the same fitness: the mean return (and its error) over all seeds
            fitness = reduce_fitness(fitness, len(mine), len(eval_seeds))
        if on_evaluation is not None:
            on_evaluation(progress["step"], agents, episodes)
        return fitness

    callbacks = run_callbacks(callbacks, s, mutation=mutation, selection=tournament)
    with closing_all(callbacks):
        return evolve(pop, train_step, evaluate, s, tournament=tournament, mutation=mutation, population=population,
                      callbacks=callbacks)
