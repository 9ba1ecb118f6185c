"""The PPO update of several actor-critic members at once, sharing every forward and backward pass.

Members whose update schedule agrees (same base, ``update_epochs``, ``batch_size`` and number of
rows) are updated together: each minibatch is ONE routed forward over the shared base, rows
``[i*b, (i+1)*b)`` through member ``i``'s actor adapter (and, when members have a separate critic,
ONE routed forward through their critic adapters). Each member's loss is computed from its own rows
with its own settings (clip range, value clip, entropy and value coefficients, temperature, GAE);
the losses are summed for one ``backward`` -- a loss only reaches its own member's adapters and
value head -- and each member clips and steps its own optimizer. With one member this is exactly the
single-member update.

The per-member pieces (value reduction per turn, GAE and whitening, per-group gradient clipping)
are :class:`~evollm.algorithms.ppo.LLMPPO`'s; the maths is :mod:`evollm.functional`'s.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import functional as F
from evollm.parallel import zero
from ..adapters.routing import ROUTED, batch_path, routed
from .multiturn_rollout import EpisodeBatch, episode_batch
from ..rollout import action_start, forward_logits
from ..rollout.logprobs import loss_forward

METRICS = ("loss", "policy_loss", "value_loss", "entropy", "kl", "clip_fraction", "grad_norm_actor",
           "grad_norm_critic", "shared_prompt")


def value_adapter(agent) -> str:
    """The adapter the member's value head reads: its critic, or its actor when it has no critic."""
    return agent.adapter_name("critic" if "critic" in agent.ROLES else "actor")


def update_key(agent, rows: int) -> tuple:
    """Members with equal keys can share forward/backward passes."""
    c = agent.config
    return (id(agent.shared), c.update_epochs, c.batch_size, rows, "critic" in agent.ROLES, agent.pad_token_id)


def _forward(agents: Sequence, names: Sequence[str] | None, ids, attn, grad: bool, hidden: bool, first: int = 0,
             logits: bool = True, info: dict | None = None):
    """One forward over the shared base, block ``i`` of the rows through ``names[i]`` (the reference
    model when ``names`` is None), dropout off as in every loss forward (the policy contract of
    :func:`evollm.rollout.logprobs.loss_forward`). Adapters that cannot be routed exactly (e.g. DoRA)
    run member by member through PEFT's own forward. Returns ``(logits [N, L-1-first, V] (None without
    ``logits``: the output head does not run), last hidden [N, L-1, H] (zeros before column ``first``) or
    None)``: the output head runs from the first action column ``first`` on, and each block's rows that
    share a prompt compute it once (``info["shared_prompt"]`` says whether they did; see
    :func:`evollm.rollout.forward_logits`)."""
    shared = agents[0].shared
    if names is not None and len(names) > 1 and batch_path(shared, names) != ROUTED:
        k = ids.shape[0] // len(names)
        infos = [{} for _ in names]
        parts = [_forward(agents, [n], ids[i * k:(i + 1) * k], attn[i * k:(i + 1) * k], grad, hidden, first, logits,
                          infos[i]) for i, n in enumerate(names)]
        if grad:  # selecting the next member froze the previous one's tensors in PEFT; the backward needs them
            for name in names:
                for p in shared.parameters(name):
                    p.requires_grad_(True)
        if info is not None:
            info["shared_prompt"] = min(i["shared_prompt"] for i in infos)
        return (torch.cat([p[0] for p in parts]) if logits else None,
                torch.cat([p[1] for p in parts]) if hidden else None)
    if names is None:
        ctx = shared.reference()
    elif len(names) == 1:
        ctx = loss_forward(shared, names[0], grad, suppress_checkpointing=True)
    else:
        ctx = routed(shared, names, [ids.shape[0] // len(names)] * len(names), differentiable=grad)
    with torch.set_grad_enabled(grad), ctx as model:
        if names is not None and len(names) > 1:
            model.eval()  # dropout off; routing never applies LoRA dropout
        out, states, used = forward_logits(model, ids, attn, first, hidden, len(names) if names else 1, head=logits)
    if info is not None:
        info["shared_prompt"] = float(used)
    return out, (torch.nn.functional.pad(states, (0, 0, first, 0)) if hidden else None)


def _logprobs(agent, logits: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
    """``[B, L-1]`` log-probs of ``ids[:, 1:]`` from the logits of columns ``first`` on (0 before)."""
    return torch.nn.functional.pad(F.token_logprobs(_scaled(agent, logits), ids[:, first + 1:]), (first, 0))


def _scaled(agent, logits: torch.Tensor) -> torch.Tensor:
    t = agent.config.temperature
    return logits / t if t != 1.0 else logits


def _values(agent, hidden: torch.Tensor) -> torch.Tensor:
    return agent.value_head(hidden.to(next(agent.value_head.parameters()).dtype)).squeeze(-1)


class _Member:
    """One member's batch and the quantities fixed before its update (old log-probs, values, advantages)."""

    def __init__(self, agent, batch: EpisodeBatch):
        self.agent, self.batch = agent, batch
        self.token_level = agent._token_level(batch)
        self.old_logp = self.ref_logp = self.old_values = self.vmask = None
        self.token_adv = self.returns = None
        self.stats: dict[str, list[float]] = {k: [] for k in METRICS}

    def rows(self, idx: torch.Tensor) -> EpisodeBatch:
        b = self.batch
        return EpisodeBatch(b.input_ids[idx], b.attention_mask[idx], b.action_mask[idx], b.turn_ids[idx],
                            b.rewards[idx])


def _common_width(batches: list[EpisodeBatch], pad: int) -> list[EpisodeBatch]:
    width = max(b.input_ids.shape[1] for b in batches)
    out = []
    for b in batches:
        extra = width - b.input_ids.shape[1]
        if extra:  # right padding: masked out, and never attended to by an earlier position
            p = torch.nn.functional.pad
            b = EpisodeBatch(p(b.input_ids, (0, extra), value=pad), p(b.attention_mask, (0, extra), value=1),
                             p(b.action_mask, (0, extra), value=0), p(b.turn_ids, (0, extra), value=-1), b.rewards)
        out.append(b)
    return out


def ppo_update(agents: Sequence, experiences: Sequence) -> list[dict[str, float]]:
    """The PPO update of ``agents`` (equal :func:`update_key`), each from its own experiences (as
    :meth:`LLMPPO.learn` takes them). Returns each member's mean metrics."""
    dev = agents[0].device
    batches = [episode_batch(e, a.pad_token_id) for a, e in zip(agents, experiences)]
    if len(agents) > 1 and len({update_key(a, b.input_ids.shape[0]) for a, b in zip(agents, batches)}) > 1:
        raise ValueError("ppo_update: members differ in update settings or rows; group them with update_key")
    batches = _common_width(batches, agents[0].pad_token_id)
    members = [_Member(a, EpisodeBatch(*(t.to(dev) for t in (b.input_ids, b.attention_mask, b.action_mask,
                                                              b.turn_ids, b.rewards)))) for a, b in zip(agents, batches)]
    c0 = agents[0].config
    n, bs = members[0].batch.input_ids.shape[0], c0.batch_size
    separate = "critic" in agents[0].ROLES
    actors = [a.adapter_name("actor") for a in agents]
    critics = [value_adapter(a) for a in agents]
    needs_old = c0.update_epochs > 1 or bs < n
    with_ref = any(a.config.beta > 0 for a in agents)
    first = min(action_start(m.batch.action_mask) for m in members)  # the losses read no earlier column
    with torch.no_grad():  # old log-probs, values and reference, a minibatch of rows per member at a time
        parts: dict[str, list] = {"logp": [], "values": [], "ref": []}
        for start in range(0, n, bs):
            ids = torch.cat([m.batch.input_ids[start:start + bs] for m in members])
            attn = torch.cat([m.batch.attention_mask[start:start + bs] for m in members])
            logits, hidden = _forward(agents, actors, ids, attn, False, not separate, first)
            if separate:
                hidden = _forward(agents, critics, ids, attn, False, True, first, logits=False)[1]
            k = ids.shape[0] // len(agents)
            parts["values"].append([_values(a, hidden[i * k:(i + 1) * k]) for i, a in enumerate(agents)])
            if needs_old:
                parts["logp"].append([_logprobs(a, logits[i * k:(i + 1) * k], ids[i * k:(i + 1) * k], first)
                                      for i, a in enumerate(agents)])
            if with_ref:
                ref = _forward(agents, None, ids, attn, False, False, first)[0]
                parts["ref"].append([_logprobs(a, ref[i * k:(i + 1) * k], ids[i * k:(i + 1) * k], first)
                                     for i, a in enumerate(agents)])
            del logits, hidden
        for i, m in enumerate(members):
            token_values = torch.cat([p[i] for p in parts["values"]])
            m.old_values, m.vmask = m.agent._state_values(token_values, m.batch, m.token_level)
            m.token_adv, m.returns, _ = m.agent._advantages(m.batch, m.old_values, m.vmask, m.token_level)
            if needs_old:
                m.old_logp = torch.cat([p[i] for p in parts["logp"]])
            if with_ref and m.agent.config.beta > 0:
                m.ref_logp = torch.cat([p[i] for p in parts["ref"]])

    gens = [torch.Generator().manual_seed(a.config.seed + a.steps) for a in agents]
    for _ in range(c0.update_epochs):
        orders = [torch.randperm(n, generator=g).to(dev) for g in gens]
        for start in range(0, n, bs):
            rows = [o[start:start + bs] for o in orders]
            subs = [m.rows(r) for m, r in zip(members, rows)]
            ids, attn = torch.cat([s.input_ids for s in subs]), torch.cat([s.attention_mask for s in subs])
            k = len(rows[0])
            for a in agents:
                a.optimizer.zero_grad(set_to_none=True)
            # actors (and value heads on them): one forward, one backward; a separate critic's forward
            # runs after the actors' backward (switching adapters must not touch a graph still in use)
            first = min(action_start(s.action_mask) for s in subs)
            info: dict = {}
            logits, hidden = _forward(agents, actors, ids, attn, True, not separate, first, info=info)
            total = 0.0
            for i, (m, r, sub) in enumerate(zip(members, rows, subs)):
                m.stats["shared_prompt"].append(info["shared_prompt"])
                loss = _policy_loss(m, r, sub, logits[i * k:(i + 1) * k], first)
                if not separate:  # the value head on the actor: its loss reaches both groups
                    loss = loss + _value_loss(m, r, sub, hidden[i * k:(i + 1) * k])
                # under DeepSpeed ZeRO: through the engines of the groups the loss reaches
                total = total + zero.track(m.agent.optimizer, loss, "actor" if separate else None)
            del logits, hidden
            total.backward()  # each member's loss reaches only its own adapters and value head
            if separate:
                hidden = _forward(agents, critics, ids, attn, True, True, first, logits=False)[1]
                total = sum(zero.track(m.agent.optimizer, _value_loss(m, r, sub, hidden[i * k:(i + 1) * k]), "critic")
                            for i, (m, r, sub) in enumerate(zip(members, rows, subs)))
                del hidden
                total.backward()
            for m in members:
                for name, norm in zip(("grad_norm_actor", "grad_norm_critic"), m.agent.clip_and_step_groups()):
                    m.stats[name].append(norm)
                m.agent.optimizer.zero_grad(set_to_none=True)
    return [_finish(m) for m in members]


def _policy_loss(m: _Member, rows: torch.Tensor, sub: EpisodeBatch, logits: torch.Tensor, first: int) -> torch.Tensor:
    """Clipped policy loss (+ ``beta`` * KL) - ``ent_coef`` * entropy of one member's minibatch (``logits`` of
    the columns from ``first`` on)."""
    a, c = m.agent, m.agent.config
    logits = _scaled(a, logits)
    logp = torch.nn.functional.pad(F.token_logprobs(logits, sub.input_ids[:, first + 1:]), (first, 0))
    with torch.set_grad_enabled(c.ent_coef != 0):
        entropy = F.masked_mean(F.entropy_from_logits(logits), sub.action_mask[:, first:])
    pg_loss, st = F.policy_loss_with_stats(
        logp, m.old_logp[rows] if m.old_logp is not None else logp.detach(), m.token_adv[rows], sub.action_mask,
        loss_type="dapo", clip_low=c.clip_range()[0], clip_high=c.clip_range()[1], ref_logp=m.ref_logp[rows] if m.ref_logp is not None else None,
        beta=c.beta)
    loss = pg_loss - c.ent_coef * entropy
    s = m.stats
    s["loss"].append(float(loss.detach()))
    s["policy_loss"].append(float(pg_loss.detach()))
    s["entropy"].append(float(entropy.detach()))
    s["kl"].append(st["kl"])
    s["clip_fraction"].append(st["clip_fraction"])
    return loss


def _value_loss(m: _Member, rows: torch.Tensor, sub: EpisodeBatch, hidden: torch.Tensor) -> torch.Tensor:
    """``vf_coef`` * (clipped) value loss of one member's minibatch (added to its ``loss`` metric)."""
    a, c = m.agent, m.agent.config
    values, _ = a._state_values(_values(a, hidden), sub, m.token_level)
    v_loss = F.value_loss(values, m.old_values[rows], m.returns[rows], m.vmask[rows], clip=c.value_clip)
    m.stats["value_loss"].append(float(v_loss.detach()))
    m.stats["loss"][-1] += c.vf_coef * float(v_loss.detach())
    return c.vf_coef * v_loss


def _finish(m: _Member) -> dict[str, float]:
    from .ppo import _explained_variance

    m.agent.steps += 1
    b = m.batch
    metrics = {k: sum(v) / len(v) for k, v in m.stats.items()}
    returns = b.episode_returns()
    metrics.update(mean_reward=float(returns.mean()), mean_return=float(returns.mean()),
                   explained_variance=_explained_variance(m.old_values, m.returns, m.vmask),
                   mean_turns=float(b.turn_mask().sum(1).float().mean()),
                   completion_length=float(b.action_mask.sum(1).float().mean()))
    return metrics


def learn_grouped(agents: Sequence, experiences: Sequence) -> list[dict[str, float]]:
    """:func:`ppo_update` over every group of members whose :func:`update_key` agrees."""
    groups: dict[tuple, list[int]] = {}
    for i, (a, e) in enumerate(zip(agents, experiences)):
        rows = episode_batch(e, a.pad_token_id).input_ids.shape[0]
        groups.setdefault(update_key(a, rows), []).append(i)
    out: dict[int, dict] = {}
    for idx in groups.values():
        out.update(zip(idx, ppo_update([agents[i] for i in idx], [experiences[i] for i in idx])))
    return [out[i] for i in range(len(agents))]

