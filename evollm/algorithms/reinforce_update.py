"""THE LLMREINFORCE update: one member, or several sharing every forward and backward pass. A member
learning alone is this update with one member.

Read top to bottom in :func:`reinforce_update`: stack each member's episodes; its ReBN advantages
(:meth:`LLMREINFORCE.normalised_returns`); members whose every advantage is zero take only their optimizer
steps (:func:`~evollm.algorithms.updates.optimizer_only_update`); the rest are padded to one width and
grouped by the memory plan (:func:`~evollm.algorithms.memory_plan.member_chunks`). Per group, the old
log-probs (when a later pass needs them) and the reference log-probs (``beta > 0``) are one routed forward;
then the shared epoch / minibatch schedule (:func:`~evollm.algorithms.updates.run_epochs`) runs, per
minibatch and group, ONE routed forward of the members' rows (rows ``[i*b, (i+1)*b)`` through member ``i``'s
adapter), each member's clipped policy loss on its own rows with its own settings (clip range, ``beta``,
temperature), one ``backward`` of their sum (a loss reaches only its own adapter), and each member's own
clip and optimizer step. So each member's update equals the one it would make alone.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import functional as F
from evollm.parallel import zero
from ..rollout import first_target, member_logprobs
from .memory_plan import learn_path, member_chunks
from .multiturn_rollout import EpisodeBatch, episode_batch
from .ppo_update import common_width
from .updates import (chunked_step, mean_metrics, optimizer_only_update, record, run_epochs, with_idle_members,
                      zero_gradient)

#: the per-minibatch metrics of an update (``kl``: k3 to the reference; ``approx_kl``: to the sampling policy)
METRICS = ("loss", "kl", "approx_kl", "clip_fraction", "entropy", "grad_norm", "shared_prompt")


def update_key(agent, rows: int) -> tuple:
    """Members with equal keys can share forward/backward passes (the same base, schedule and rows, and
    the settings of the shared log-prob passes); a member with dropout on learns alone (routing never
    applies dropout)."""
    c = agent.config
    return (id(agent.shared), c.update_epochs, c.batch_size, rows, agent.pad_token_id, c.logprob_chunk_rows,
            c.logits_budget_mb, c.learn_chunk_members, id(agent) if not c.disable_dropout else None)


def learn_grouped(agents: Sequence, experiences: Sequence) -> list[dict[str, float]]:
    """:func:`reinforce_update` over every group of members whose :func:`update_key` agrees."""
    groups: dict[tuple, list[int]] = {}
    for i, (a, e) in enumerate(zip(agents, experiences)):
        groups.setdefault(update_key(a, episode_batch(e, a.pad_token_id).input_ids.shape[0]), []).append(i)
    out: dict[int, dict] = {}
    for idx in groups.values():
        out.update(zip(idx, reinforce_update([agents[i] for i in idx], [experiences[i] for i in idx])))
    return [out[i] for i in range(len(agents))]


def reinforce_update(agents: Sequence, experiences: Sequence) -> list[dict[str, float]]:
    """The update of ``agents`` (equal :func:`update_key`), each from its own experiences (as
    :meth:`LLMREINFORCE.learn` takes them). Returns each member's mean metrics, with ``learn_path`` and
    ``learn_chunks`` (how the members' passes ran)."""
    batches = [episode_batch(e, a.pad_token_id) for a, e in zip(agents, experiences)]
    if len(agents) > 1 and len({update_key(a, b.input_ids.shape[0]) for a, b in zip(agents, batches)}) > 1:
        raise ValueError("reinforce_update: members differ in update settings or rows; group them with update_key")
    advantages = [a.normalised_returns(b) for a, b in zip(agents, batches)]
    n = batches[0].input_ids.shape[0]
    idle = [i for i, (a, adv) in enumerate(zip(agents, advantages)) if zero_gradient(a, adv, n)]
    if idle:  # no signal: these members' loss and gradient are exactly zero, only their optimizers step
        return with_idle_members(agents, experiences, idle, lambda i: _optimizer_only(agents[i], batches[i]),
                                 reinforce_update)
    dev, c0 = agents[0].device, agents[0].config
    padded = [b.to(dev) for b in common_width(batches, agents[0].pad_token_id)]
    width = padded[0].input_ids.shape[1]
    adv = [torch.nn.functional.pad(a, (0, width - 1 - a.shape[1])).to(dev) for a in advantages]
    starts = [first_target(b.action_mask) for b in padded]
    chunks = member_chunks(agents, min(c0.batch_size, n), width, width - min(starts) + 1)
    old: list = [None] * len(agents)
    ref: list = [None] * len(agents)
    for ch in chunks:
        if c0.update_epochs > 1 or c0.batch_size < n:  # a later pass scores against the sampling policy
            old_ch = _logprobs([agents[i] for i in ch], [padded[i] for i in ch], n, grad=False)[0]
            for i, lp in zip(ch, old_ch.split(n)):
                old[i] = lp
        with_ref = [i for i in ch if agents[i].config.beta > 0]
        if with_ref:
            ref_ch = _logprobs([agents[i] for i in with_ref], [padded[i] for i in with_ref], n, grad=False,
                               reference=True)[0]
            for i, lp in zip(with_ref, ref_ch.split(n)):
                ref[i] = lp
    params = [a.shared.parameters(a.adapter_name("actor")) for a in agents]

    def learn_chunk(ch: list[int], rows: list[torch.Tensor], counts: list, stats) -> None:
        """One routed forward and backward over the group's minibatch rows."""
        rows = [r.to(dev) for r in rows]
        k = len(rows[0])
        info: dict = {}
        logp, entropy = _logprobs([agents[i] for i in ch], [padded[i].rows(r) for i, r in zip(ch, rows)], k,
                                  grad=True, info=info)
        total = 0.0
        for i, r, count, lp, ent in zip(ch, rows, counts, logp.split(k), entropy.split(k)):
            a, c, m = agents[i], agents[i].config, padded[i].action_mask[r]
            low, high = c.clip_range()
            # with old == current (first pass) the clipped surrogate's gradient is exactly -A * grad log pi
            loss, s = F.policy_loss_with_stats(
                lp, old[i][r] if old[i] is not None else lp.detach(), adv[i][r], m, loss_type="dapo",
                clip_low=low, clip_high=high, ref_logp=ref[i][r] if ref[i] is not None else None, beta=c.beta,
                token_count=count)
            total = total + zero.track(a.optimizer, loss)  # under DeepSpeed ZeRO: through the member's engine
            record(stats[i], loss=loss.detach(), kl=s["kl"], approx_kl=s["approx_kl"],
                   clip_fraction=s["clip_fraction"], entropy=F.masked_mean(ent, m), shared_prompt=info["shared_prompt"])
        total.backward()  # each member's loss reaches only its own adapter

    step = chunked_step(agents, chunks, params, lambda i, r: padded[i].action_mask[r.to(dev)], learn_chunk)
    stats = run_epochs(agents, n, step, [{k: [] for k in METRICS} for _ in agents])
    path = learn_path(len(agents), len(chunks))
    out = []
    for a, b, st in zip(agents, batches, stats):
        a.steps += 1
        out.append({**a._metrics(mean_metrics(st), b), "learn_path": path, "learn_chunks": float(len(chunks))})
    return out


def _logprobs(agents: Sequence, batches: Sequence[EpisodeBatch], rows_each: int, grad: bool,
              reference: bool = False, info: dict | None = None):
    """``(logp, entropy)`` of the concatenated batches, block ``i`` under ``agents[i]``'s adapter (or the
    reference), at each member's sampling temperature; the output head only from the first column any
    block scores (:func:`evollm.rollout.member_logprobs`)."""
    a0, c = agents[0], agents[0].config
    mask = torch.cat([b.action_mask for b in batches])
    out = member_logprobs(a0.shared, [a.adapter_name("actor") for a in agents], torch.cat([b.input_ids for b in batches]),
                          torch.cat([b.attention_mask for b in batches]), rows_each, grad, reference,
                          [a.config.temperature for a in agents], c.logprob_chunk_rows, c.logits_budget_mb,
                          c.disable_dropout, start=first_target(mask), with_entropy=grad, info=info)
    return out if grad else (out, None)


def _optimizer_only(agent, batch: EpisodeBatch) -> dict[str, float]:
    """The update of a member whose every advantage is zero, without its forwards and backward; entropy
    and ``approx_kl`` not measured (``nan``)."""
    n = batch.input_ids.shape[0]
    optimizer_only_update(agent, agent.shared.parameters(agent.adapter_name("actor")), n)
    agent.steps += 1
    nan = float("nan")
    return agent._metrics({"loss": 0.0, "kl": 0.0, "approx_kl": nan, "clip_fraction": 0.0, "entropy": nan,
                           "grad_norm": 0.0, "epochs": float(agent.config.update_epochs),
                           "learn_path": "no_gradient", "learn_chunks": 0.0}, batch)
