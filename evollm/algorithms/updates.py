"""The epoch / minibatch / metrics loop every update shares (GRPO, PPO, REINFORCE; one member or
several fused).

An update is ``update_epochs`` passes over the member's rows in minibatches of ``batch_size``, each
pass in a fresh order drawn from the member's own generator (seeded ``seed + steps``, so an update is
reproducible and a resumed run repeats it exactly). The algorithm supplies one minibatch step; this
module runs the schedule, stops a member's epochs early when its ``target_kl`` is exceeded, and turns
the per-minibatch values into the member's metrics.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

#: ``stats[i][name]``: the values of member ``i``'s metric ``name``, one per minibatch step
Stats = list[dict[str, list[float]]]
#: ``step(members, rows, stats)``: one minibatch of the members still updating (indices into the agents),
#: ``rows[k]`` the row indices of ``members[k]``; it appends each member's values to ``stats[member]``
Step = Callable[[list[int], list[torch.Tensor], Stats], None]


def run_epochs(agents: Sequence, n_rows: int, step: Step, stats: Stats | None = None) -> Stats:
    """Run the update schedule of ``agents`` (equal ``update_epochs`` and ``batch_size``) over ``n_rows``
    rows each. After every epoch but the last, a member whose ``target_kl`` is set and whose mean
    ``approx_kl`` over that epoch's minibatches exceeds it takes no further steps (its other members'
    schedules go on). Adds ``epochs`` (the epochs each member ran) to its stats."""
    c0 = agents[0].config
    stats = stats if stats is not None else [{} for _ in agents]
    gens = [torch.Generator().manual_seed(a.config.seed + a.steps) for a in agents]
    active = list(range(len(agents)))
    epochs = [0] * len(agents)
    for epoch in range(c0.update_epochs):
        orders = [torch.randperm(n_rows, generator=gens[i]) for i in active]
        before = [len(stats[i].get("approx_kl", ())) for i in active]
        for start in range(0, n_rows, c0.batch_size):
            step(list(active), [o[start:start + c0.batch_size] for o in orders], stats)
        for i in active:
            epochs[i] += 1
        if epoch + 1 < c0.update_epochs:
            active = [i for i, n in zip(active, before) if not kl_exceeded(agents[i], stats[i].get("approx_kl", [])[n:])]
        if not active:
            break
    for st, n in zip(stats, epochs):
        st["epochs"] = [float(n)]
    return stats


def kl_exceeded(agent, approx_kl: Sequence[float]) -> bool:
    """Whether ``agent``'s ``target_kl`` is set and the mean of ``approx_kl`` (an epoch's minibatches) is above it."""
    target = getattr(agent.config, "target_kl", None)
    return target is not None and len(approx_kl) > 0 and sum(approx_kl) / len(approx_kl) > target


def record(stats: dict[str, list[float]], **values: float) -> None:
    """Append one minibatch's values to a member's stats."""
    for key, value in values.items():
        stats.setdefault(key, []).append(float(value))


def mean_metrics(stats: dict[str, list[float]]) -> dict[str, float]:
    """A member's metrics: the mean of each stat over its minibatch steps."""
    return {k: sum(v) / len(v) for k, v in stats.items() if v}
