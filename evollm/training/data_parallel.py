"""Data-parallel glue for the training loops (see :mod:`evollm.parallel.distributed`): sharded evaluation
whose result is identical on every process, and a per-process sampling seed."""

from __future__ import annotations

from typing import Sequence

import torch

from evollm.parallel import distributed as dist
from evollm.rollout.population import Fitness, mean_stderr


class ShardedTestSet:
    """A view of an env whose fixed test prompts are this process's contiguous share (the last
    process may get fewer when the count does not split evenly)."""

    def __init__(self, env):
        self.env = env
        prompts = list(env.test_prompts())
        n, rank = dist.num_processes(), dist.process_index()
        size = -(-len(prompts) // n)
        self._prompts = prompts[rank * size:(rank + 1) * size]
        self.total = len(prompts)
        self.eval_batch_size = getattr(env, "eval_batch_size", 64)

    def test_prompts(self):
        return self._prompts

    def score(self, completions, prompts=None):
        return self.env.score(completions, prompts)


def evaluate_data_parallel(agents: Sequence, env, evaluate_population, record: bool = True) -> list[float]:
    """Fitness of every member, the test prompts split over processes and the reward sums added up,
    so every process gets the same numbers (equal to a single-process evaluation)."""
    if not dist.is_distributed():
        return evaluate_population(agents, env, record=record)
    view = ShardedTestSet(env)
    n = len(view.test_prompts())
    local = evaluate_population(agents, view, record=False) if n else [0.0] * len(agents)
    fitness = reduce_fitness(local, n, view.total)
    if record:
        for agent, f in zip(agents, fitness):
            agent.record_fitness(f)
    return fitness


def reduce_fitness(local: Sequence[float], count: int, total: int) -> Fitness:
    """The fitness of a whole evaluation from each process's share: ``local`` holds the means of this process's
    ``count`` items (a :class:`Fitness` with ``sum_sq``; a plain list, or ``count`` 0, adds nothing to the squares),
    ``total`` the items over every process. Sums and sums of squares are added up over the processes, so every
    process gets the means and standard errors of one evaluation of all ``total`` items."""
    squares = getattr(local, "sum_sq", None) or [0.0] * len(local)
    sums = dist.all_reduce_sum([float(f) * count for f in local])
    squares = dist.all_reduce_sum([float(q) for q in squares]).tolist()
    n = len(local)
    cross = getattr(local, "cross", None) if count else [[0.0] * n for _ in range(n)]
    if dist.all_reduce_sum([float(cross is None)])[0] > 0:  # a process without the products: no paired errors
        cross = None
    else:
        cross = dist.all_reduce_sum([x for row in cross for x in row]).reshape(n, n).tolist() if n else []
    return Fitness((sums / total).tolist(), [mean_stderr(float(t), q, total) for t, q in zip(sums, squares)], squares,
                   cross, total if cross is not None else None)


def seed_sampling(seed: int, step: int) -> None:
    """Different sampling noise on every process (the prompts differ too), reproducible per step."""
    if dist.is_distributed():
        torch.manual_seed(seed + step + 1_000_003 * dist.process_index())
