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

from evollm.parallel import zero
from evollm.parallel.distributed import all_reduce_mean, is_distributed, token_divisors

#: skip the forwards and backward of an update whose every advantage is zero (tests switch it off to
#: compare with the full update)
SKIP_ZERO_GRADIENT = True

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
            active = _within_target_kl(agents, active, [stats[i].get("approx_kl", [])[n:] for i, n in zip(active, before)])
        if not active:
            break
    for st, n in zip(stats, epochs):
        st["epochs"] = [float(n)]
    return stats


def with_idle_members(agents: Sequence, experiences: Sequence, idle: list[int], idle_update: Callable[[int], dict],
                      update: Callable[[Sequence, Sequence], list[dict]]) -> list[dict]:
    """Each member's metrics when the members ``idle`` have no learning signal: those take
    ``idle_update(i)`` (only their optimizer steps, :func:`optimizer_only_update`), the others
    ``update(agents, experiences)`` together."""
    out = {i: idle_update(i) for i in idle}
    rest = [i for i in range(len(agents)) if i not in out]
    if rest:
        out.update(zip(rest, update([agents[i] for i in rest], [experiences[i] for i in rest])))
    return [out[i] for i in range(len(agents))]


def chunked_step(agents: Sequence, chunks: list[list[int]], params: Sequence, mask_of: Callable,
                 learn_chunk: Callable) -> Step:
    """The minibatch step of a fused update (GRPO, REINFORCE): group by group (``chunks``, from the memory
    plan) of the members still updating, zero their gradients, ``learn_chunk(members, rows, counts, stats)``
    (one forward and backward of the group; ``counts``: each member's token-mean divisor, None in one
    process, see :func:`~evollm.parallel.distributed.token_divisors`), then each member clips and steps its
    own optimizer. ``mask_of(i, rows)``: member ``i``'s action mask of those rows."""

    def step(members: list[int], rows: list[torch.Tensor], stats: Stats) -> None:
        row_of = dict(zip(members, rows))
        # several processes: one all-reduce of every member's token count (nothing to gather in one process)
        counts = token_divisors([mask_of(i, row_of[i]) for i in members]) if is_distributed() else None
        count_of = dict(zip(members, counts)) if counts else {}
        for ch in chunks:  # each member's forward reads only its own adapter: step a group before the next
            ch = [i for i in ch if i in row_of]
            if not ch:
                continue
            for i in ch:
                agents[i].optimizer.zero_grad(set_to_none=True)
            learn_chunk(ch, [row_of[i] for i in ch], [count_of.get(i) for i in ch], stats)
            for i in ch:  # clip_and_step frees the gradients: one group's are alive at a time
                record(stats[i], grad_norm=agents[i].clip_and_step(params[i]))

    return step


def _within_target_kl(agents: Sequence, active: list[int], epoch_kl: list[Sequence[float]]) -> list[int]:
    """The members of ``active`` whose epoch did not exceed their ``target_kl`` (``epoch_kl``: each one's
    minibatch ``approx_kl`` values of the epoch; their mean is compared). In a multi-process run the epoch
    means are averaged over processes first, so every process stops the same members (their later passes are
    collective)."""
    targets = [getattr(agents[i].config, "target_kl", None) for i in active]
    if all(t is None for t in targets):
        return active
    means = [sum(kl) / len(kl) if len(kl) else 0.0 for kl in epoch_kl]
    if is_distributed():
        means = all_reduce_mean(means).tolist()
    return [i for i, m, t in zip(active, means, targets) if t is None or not m > t]


def record(stats: dict[str, list[float]], **values: float) -> None:
    """Append one minibatch's values to a member's stats."""
    for key, value in values.items():
        stats.setdefault(key, []).append(float(value))


def mean_metrics(stats: dict[str, list[float]]) -> dict[str, float]:
    """A member's metrics: the mean of each stat over its minibatch steps."""
    return {k: sum(v) / len(v) for k, v in stats.items() if v}


def zero_gradient(agent, advantages: torch.Tensor, rows: int) -> bool:
    """Whether ``agent``'s update on ``rows`` rows with ``advantages`` has an exactly zero loss and
    gradient, so its forwards and backward can be skipped without changing the result: every advantage
    is zero (no signal: each GRPO group's, or the whole ReBN batch's, rewards are equal), no KL term
    (``beta == 0``), no ``target_kl`` early stop (which reads the forwards), one process and no
    DeepSpeed engine (their steps are collective)."""
    c = agent.config
    return (SKIP_ZERO_GRADIENT and rows > 0 and getattr(c, "beta", 0.0) == 0 and getattr(c, "target_kl", None) is None
            and not is_distributed() and not zero.is_zero(agent.optimizer) and not bool(advantages.any()))


def optimizer_only_update(agent, params: list[torch.nn.Parameter], rows: int) -> None:
    """The optimizer steps of an update with a zero gradient (:func:`zero_gradient`), without its
    forwards and backward: one step per epoch and minibatch on zero gradients, so AdamW's moments decay
    and its momentum and weight decay move the adapter exactly as the full update would."""
    c = agent.config
    for _ in range(c.update_epochs * len(range(0, rows, min(c.batch_size, rows)))):
        for p in params:
            p.grad = torch.zeros_like(p)
        agent.clip_and_step(params)
