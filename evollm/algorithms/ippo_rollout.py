"""Team rollouts: every agent of every team answers in ONE batched generate per round.

The rounds of all seats of all teams (see :mod:`evollm.envs.team`) are sampled together by
:func:`~evollm.algorithms.multiturn_rollout.population_generate_fn` (one routed ``generate`` per
group of agents whose sampling settings agree, each row through its own agent's actor adapter),
and each agent's episodes stack into exactly the ``(ids, action_masks, turn_ids, rewards[B, K])``
that PPO learns from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..envs.multiturn import TokenObservationWrapper
from ..envs.team import TeamEpisode, TeamTask, play_rounds, team_seats
from ..rollout import Episode, population_generate_fn, stack_episodes
from ..rollout.population import Fitness, item_products, mean_stderr


@dataclass
class TeamRollout:
    """What :func:`play_teams` returns: the episodes and each agent's learn tuple, per team index."""

    episodes: dict[int, list[TeamEpisode]]
    experiences: dict[int, list[tuple]]
    seats: dict[int, list[list[TokenObservationWrapper]]]


def play_teams(teams: Sequence, task: TeamTask, rows: Sequence[dict], training: bool = True) -> TeamRollout:
    """Every team plays every row (sampled when ``training``, greedy otherwise); each round is ONE
    batched generate over all seats of all teams (per group of equal sampling settings)."""
    episodes, seats, owners = [], [], []
    for team in teams:
        eps, sts = team_seats(task, rows, team.index, team.num_agents)
        episodes += eps
        seats += sts
        owners += [team.agents[j] for _, j, _ in sts]
    play_rounds(task, episodes, seats, population_generate_fn(owners, training))
    out_eps: dict[int, list[TeamEpisode]] = {t.index: [] for t in teams}
    for ep in episodes:
        out_eps[ep.team].append(ep)
    out_seats = {t.index: [[] for _ in t.agents] for t in teams}
    for ep, j, wrapper in seats:
        out_seats[ep.team][j].append(wrapper)
    experiences = {t.index: [stack_episodes([Episode(*w.get_episode_data()) for w in out_seats[t.index][j]],
                                            t.pad_token_id, task.num_turns) for j in range(t.num_agents)]
                   for t in teams}
    return TeamRollout(out_eps, experiences, out_seats)


def evaluate_teams(teams: Sequence, task: TeamTask, record: bool = True) -> tuple[Fitness, list[float]]:
    """``(fitness, success)`` per team on the task's fixed evaluation rows, greedy: fitness is the mean
    episode return (a :class:`~evollm.rollout.population.Fitness`, with each mean's standard error over the
    episodes), success the fraction of episodes reaching ``task.success_threshold``. Appends the fitness to
    each team's ``fitness`` when ``record``."""
    rows = task.eval_rows
    if not rows:
        raise ValueError("the task has no eval_dataset: fitness needs a fixed evaluation set")
    totals = {t.index: [0.0, 0, 0.0] for t in teams}  # return sum, successes, sum of squared returns
    returns = {t.index: [] for t in teams}  # row by row, for the paired standard errors
    for start in range(0, len(rows), task.eval_batch_size):
        out = play_teams(teams, task, rows[start:start + task.eval_batch_size], training=False)
        for t in teams:
            for ep in out.episodes[t.index]:
                totals[t.index][0] += ep.episode_return
                totals[t.index][1] += int(ep.episode_return >= task.success_threshold)
                totals[t.index][2] += float(ep.episode_return) ** 2
                returns[t.index].append(float(ep.episode_return))
    lengths = {len(r) for r in returns.values()}
    cross = (item_products(torch.tensor([returns[t.index] for t in teams], dtype=torch.float64)).tolist()
             if len(lengths) == 1 else None)
    fitness = Fitness([totals[t.index][0] / len(rows) for t in teams],
                      [mean_stderr(totals[t.index][0], totals[t.index][2], len(rows)) for t in teams],
                      [totals[t.index][2] for t in teams], cross, lengths.pop() if cross is not None else None)
    success = [totals[t.index][1] / len(rows) for t in teams]
    if record:
        for t, f in zip(teams, fitness):
            t.record_fitness(f)
    return fitness, success

