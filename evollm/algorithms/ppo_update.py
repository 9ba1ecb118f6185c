"""THE PPO update of actor-critic members (LLMPPO, IPPO agents): one member, or several sharing every
forward and backward pass. A member learning alone is this update with one member.

Members whose update schedule agrees (:func:`update_key`: same base, ``update_epochs``, ``batch_size``,
number of rows) are updated together: each minibatch is ONE routed forward over the shared base, rows
``[i*b, (i+1)*b)`` through member ``i``'s actor adapter (and, when members have a separate critic, ONE
routed forward through their critic adapters). Each member's loss is computed from its own rows with
its own settings (clip range, value clip, entropy and value coefficients, temperature, GAE); the losses
are summed for one ``backward`` -- a loss only reaches its own member's adapters and value head -- and
each member clips and steps its own optimizer. A member with dropout on (``disable_dropout=False``) or
on a base with gradient checkpointing learns alone (routing never applies dropout, and a recomputed
forward needs its adapter selected during the backward, which then runs inside the forward's context).

Read top to bottom in :func:`ppo_update`: stack the episodes; old log-probs, values and reference
log-probs a minibatch at a time; per member GAE (bootstrapping episodes cut short from the critic)
and whitening; then the shared epoch / minibatch schedule (:func:`evollm.algorithms.updates.run_epochs`)
of clipped policy loss (+ ``beta`` * k3 KL) - ``ent_coef`` * entropy on the actor and ``vf_coef`` *
value loss on the critic. The per-member pieces (values per turn, GAE) are
:class:`~evollm.algorithms.ppo.LLMPPO`'s; the maths is :mod:`evollm.functional`'s.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from .. import functional as F
from evollm.parallel import distributed as dist, zero
from ..adapters.routing import ROUTED, batch_path, routed
from ..adapters.shared import checkpointing
from ..rollout import action_start, first_target, forward_logits, member_logprobs
from ..rollout.logprobs import loss_forward
from .multiturn_rollout import EpisodeBatch, episode_batch
from .updates import mean_metrics, record, run_epochs

#: the per-minibatch metrics of an update
METRICS = ("loss", "policy_loss", "value_loss", "entropy", "kl", "approx_kl", "clip_fraction", "grad_norm_actor",
           "grad_norm_critic", "shared_prompt")


def value_adapter(agent) -> str:
    """The adapter the member's value head reads: its critic, or its actor when it has no critic."""
    return agent.adapter_name("critic" if "critic" in agent.ROLES else "actor")


def learns_alone(agent) -> bool:
    """Whether the member's forwards cannot be routed with others': dropout on, or gradient checkpointing."""
    return not agent.config.disable_dropout or checkpointing(agent.shared.model.get_base_model())


def update_key(agent, rows: int) -> tuple:
    """Members with equal keys share forward/backward passes."""
    c = agent.config
    return (id(agent.shared), c.update_epochs, c.batch_size, rows, "critic" in agent.ROLES, agent.pad_token_id,
            id(agent) if learns_alone(agent) else None)


@contextlib.contextmanager
def member_forward(agents: Sequence, names: Sequence[str] | None, grad: bool):
    """Yields ``forward(ids, attn, hidden, first=0, logits=True, info=None) -> (logits, hidden)``: block ``i``
    of the rows through ``names[i]`` (the reference model when ``names`` is None); ``logits`` ``[N, L-1-first,
    V]`` of the columns from ``first`` on (None without ``logits``: the output head does not run), ``hidden``
    the last hidden layer ``[N, L-1, H]`` (zeros before column ``first``) or None. Rows that share a prompt
    compute it once (``info["shared_prompt"]`` says whether they did; see :func:`evollm.rollout.forward_logits`).

    The backward of the outputs runs inside this context: one member runs in its loss-forward context the
    whole time (its ``disable_dropout``; gradient checkpointing recomputes under the same adapter), several
    through :func:`_forward`."""
    if names is not None and len(names) == 1:
        with loss_forward(agents[0].shared, names[0], grad, agents[0].config.disable_dropout) as model:
            yield lambda ids, attn, hidden, first=0, logits=True, info=None: _run(model, ids, attn, grad, hidden,
                                                                                 first, logits, info)
        return
    yield lambda ids, attn, hidden, first=0, logits=True, info=None: _forward(agents, names, ids, attn, grad, hidden,
                                                                             first, logits, info)


def _forward(agents: Sequence, names: Sequence[str] | None, ids, attn, grad: bool, hidden: bool, first: int = 0,
             logits: bool = True, info: dict | None = None):
    """One forward of several members (or the reference): ONE routed forward with dropout off, or, when their
    adapters cannot be routed exactly (e.g. DoRA), one by one through PEFT's own forward (no checkpointing:
    the backward runs after the last member is selected). Outputs as :func:`member_forward`'s."""
    shared = agents[0].shared
    if names is not None and len(names) > 1 and batch_path(shared, names) != ROUTED:
        k = ids.shape[0] // len(names)
        parts, infos = [], [{} for _ in names]
        for i, name in enumerate(names):
            with loss_forward(shared, name, grad, suppress_checkpointing=True) as model:
                parts.append(_run(model, ids[i * k:(i + 1) * k], attn[i * k:(i + 1) * k], grad, hidden, first, logits,
                                  infos[i]))
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
        ctx = loss_forward(shared, names[0], grad, agents[0].config.disable_dropout, suppress_checkpointing=True)
    else:
        ctx = routed(shared, names, [ids.shape[0] // len(names)] * len(names), differentiable=grad)
    with ctx as model:
        if names is not None and len(names) > 1:
            model.eval()  # dropout off; routing never applies LoRA dropout
        return _run(model, ids, attn, grad, hidden, first, logits, info, len(names) if names else 1)


def _run(model, ids, attn, grad: bool, hidden: bool, first: int, logits: bool, info: dict | None, blocks: int = 1):
    with torch.set_grad_enabled(grad):
        out, states, used = forward_logits(model, ids, attn, first, hidden, blocks, head=logits)
    if info is not None:
        info["shared_prompt"] = float(used)
    return out, (torch.nn.functional.pad(states, (0, 0, first, 0)) if hidden else None)


def _scaled(agent, logits: torch.Tensor) -> torch.Tensor:
    t = agent.config.temperature
    return logits / t if t != 1.0 else logits


def head_values(agent, hidden: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` values from the last hidden states ``[N, T, H]``: position ``t`` is the value of the prefix
    ``ids[:, :t+1]``."""
    return agent.value_head(hidden.to(next(agent.value_head.parameters()).dtype)).squeeze(-1)


class _Member:
    """One member's batch and the quantities fixed before its update (old log-probs, values, advantages)."""

    def __init__(self, agent, batch: EpisodeBatch):
        self.agent, self.batch = agent, batch
        self.token_level = agent.is_token_level(batch)
        self.old_logp = self.ref_logp = self.old_values = self.vmask = None
        self.token_adv = self.returns = None
        self.stats: dict[str, list[float]] = {k: [] for k in METRICS}

    def rows(self, idx: torch.Tensor) -> EpisodeBatch:
        return self.batch.rows(idx)


def common_width(batches: list[EpisodeBatch], pad: int) -> list[EpisodeBatch]:
    """The batches right-padded to one width, plus one column when an episode was cut short (its bootstrap
    value is read one column past its last action token). Right padding is masked out and never attended to
    by an earlier position."""
    width = max(b.input_ids.shape[1] for b in batches) + int(any(bool(b.truncated.any()) for b in batches))
    out = []
    for b in batches:
        extra = width - b.input_ids.shape[1]
        if extra:
            p = torch.nn.functional.pad
            b = EpisodeBatch(p(b.input_ids, (0, extra), value=pad), p(b.attention_mask, (0, extra), value=1),
                             p(b.action_mask, (0, extra), value=0), p(b.turn_ids, (0, extra), value=-1), b.rewards,
                             b.truncated)
        out.append(b)
    return out


def ppo_update(agents: Sequence, experiences: Sequence) -> list[dict[str, float]]:
    """The PPO update of ``agents`` (equal :func:`update_key`), each from its own experiences (as
    :meth:`LLMPPO.learn` takes them). Returns each member's mean metrics."""
    dev = agents[0].device
    batches = [episode_batch(e, a.pad_token_id) for a, e in zip(agents, experiences)]
    if len(agents) > 1 and len({update_key(a, b.input_ids.shape[0]) for a, b in zip(agents, batches)}) > 1:
        raise ValueError("ppo_update: members differ in update settings or rows; group them with update_key")
    members = [_Member(a, b.to(dev)) for a, b in zip(agents, common_width(batches, agents[0].pad_token_id))]
    c0 = agents[0].config
    n, bs = members[0].batch.input_ids.shape[0], c0.batch_size
    separate = "critic" in agents[0].ROLES
    actors = [a.adapter_name("actor") for a in agents]
    critics = [value_adapter(a) for a in agents]
    with torch.no_grad():
        _fixed_quantities(members, actors, critics, separate, needs_old=c0.update_epochs > 1 or bs < n)

    def step(active: list[int], rows: list[torch.Tensor], stats) -> None:
        ms = [members[i] for i in active]
        rows = [r.to(dev) for r in rows]
        subs = [m.rows(r) for m, r in zip(ms, rows)]
        ids, attn = torch.cat([s.input_ids for s in subs]), torch.cat([s.attention_mask for s in subs])
        first = min(action_start(s.action_mask) for s in subs)  # the losses read no earlier column
        k = len(rows[0])
        # several processes: token means over the whole minibatch (one all-reduce of every member's counts)
        counts = (dist.token_divisors([s.action_mask for s in subs] + [m.vmask[r] for m, r in zip(ms, rows)])
                  if dist.is_distributed() else None)
        act, val = (counts[:len(ms)], counts[len(ms):]) if counts else ([None] * len(ms), [None] * len(ms))
        for m in ms:
            m.agent.optimizer.zero_grad(set_to_none=True)
        # actors (and value heads on them): one forward, one backward; a separate critic's forward runs after
        # the actors' backward (switching adapters must not touch a graph still in use)
        with member_forward([m.agent for m in ms], [actors[i] for i in active], True) as forward:
            info: dict = {}
            logits, hidden = forward(ids, attn, not separate, first, info=info)
            total = 0.0
            for j, (m, r, sub) in enumerate(zip(ms, rows, subs)):
                record(m.stats, shared_prompt=info["shared_prompt"])
                loss = _policy_loss(m, r, sub, logits[j * k:(j + 1) * k], first, act[j])
                if not separate:  # the value head on the actor: its loss reaches both groups
                    loss = loss + _value_loss(m, r, sub, hidden[j * k:(j + 1) * k], val[j])
                # under DeepSpeed ZeRO: through the engines of the groups the loss reaches
                total = total + zero.track(m.agent.optimizer, loss, "actor" if separate else None)
            del logits, hidden
            total.backward()  # each member's loss reaches only its own adapters and value head
        if separate:
            with member_forward([m.agent for m in ms], [critics[i] for i in active], True) as forward:
                hidden = forward(ids, attn, True, first, logits=False)[1]
                total = sum(zero.track(m.agent.optimizer, _value_loss(m, r, sub, hidden[j * k:(j + 1) * k], val[j]),
                                       "critic")
                            for j, (m, r, sub) in enumerate(zip(ms, rows, subs)))
                del hidden
                total.backward()
        for m in ms:
            norms = m.agent.clip_and_step_groups()
            record(m.stats, grad_norm_actor=norms[0], grad_norm_critic=norms[1])
            m.agent.optimizer.zero_grad(set_to_none=True)

    run_epochs(agents, n, step, [m.stats for m in members])
    return [_finish(m) for m in members]


def _fixed_quantities(members: list[_Member], actors, critics, separate: bool, needs_old: bool) -> None:
    """Old log-probs, values and reference log-probs (from the first action column on: log-probs through
    :func:`evollm.rollout.member_logprobs`, values without the output head); then each member's returns and
    advantages (GAE, bootstrapping episodes cut short from the critic). Several members, or logits from the
    value head's own forward, go a minibatch of rows per member at a time; one member with a critic in one
    pass (its log-probs bound their logits to ``logits_budget_mb`` themselves)."""
    agents = [m.agent for m in members]
    c0 = agents[0].config
    n = members[0].batch.input_ids.shape[0]
    bs = n if len(agents) == 1 and separate else c0.batch_size
    temps = [a.config.temperature for a in agents]
    with_ref = any(a.config.beta > 0 for a in agents)
    parts: dict[str, list] = {"logp": [], "values": [], "ref": []}
    for start in range(0, n, bs):
        ids = torch.cat([m.batch.input_ids[start:start + bs] for m in members])
        attn = torch.cat([m.batch.attention_mask[start:start + bs] for m in members])
        mask = torch.cat([m.batch.action_mask[start:start + bs] for m in members])
        k = ids.shape[0] // len(agents)

        def logprobs(reference: bool) -> list[torch.Tensor]:
            return list(member_logprobs(agents[0].shared, actors, ids, attn, k, False, reference, temps,
                                        c0.logprob_chunk_rows, c0.logits_budget_mb, start=first_target(mask)).split(k))
        first = action_start(mask)
        if separate:
            with member_forward(agents, critics, False) as forward:
                hidden = forward(ids, attn, True, first, logits=False)[1]
            if needs_old:
                parts["logp"].append(logprobs(reference=False))
        else:  # the value head reads the actor: one forward gives both
            with member_forward(agents, actors, False) as forward:
                logits, hidden = forward(ids, attn, True, first)
            if needs_old:
                parts["logp"].append([_logprobs(a, logits[i * k:(i + 1) * k], ids[i * k:(i + 1) * k], first)
                                      for i, a in enumerate(agents)])
            del logits
        parts["values"].append([head_values(a, hidden[i * k:(i + 1) * k]) for i, a in enumerate(agents)])
        del hidden
        if with_ref:
            parts["ref"].append(logprobs(reference=True))
    for i, m in enumerate(members):
        values = torch.cat([p[i] for p in parts["values"]])
        m.old_values, m.vmask = m.agent.state_values(values, m.batch, m.token_level)
        boot = F.truncation_bootstrap(values, m.batch.action_mask, m.batch.truncated)
        m.token_adv, m.returns, _ = m.agent.gae_advantages(m.batch, m.old_values, m.vmask, m.token_level, boot)
        if needs_old:
            m.old_logp = torch.cat([p[i] for p in parts["logp"]])
        if with_ref and m.agent.config.beta > 0:
            m.ref_logp = torch.cat([p[i] for p in parts["ref"]])


def _logprobs(agent, logits: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
    """``[B, L-1]`` log-probs of ``ids[:, 1:]`` from the logits of columns ``first`` on (0 before)."""
    return torch.nn.functional.pad(F.token_logprobs(_scaled(agent, logits), ids[:, first + 1:]), (first, 0))


def _policy_loss(m: _Member, rows: torch.Tensor, sub: EpisodeBatch, logits: torch.Tensor, first: int,
                 count: float | None = None) -> torch.Tensor:
    """Clipped policy loss (+ ``beta`` * KL) - ``ent_coef`` * entropy of one member's minibatch (``logits`` of
    the columns from ``first`` on); token means divided by ``count`` when given (several processes)."""
    a, c = m.agent, m.agent.config
    logits = _scaled(a, logits)
    logp = torch.nn.functional.pad(F.token_logprobs(logits, sub.input_ids[:, first + 1:]), (first, 0))
    with torch.set_grad_enabled(c.ent_coef != 0):
        token_entropy, mask = F.entropy_from_logits(logits), sub.action_mask[:, first:]
        entropy = (F.masked_mean(token_entropy, mask) if count is None
                   else F.masked_sum(token_entropy, mask) / max(count, 1.0))
    low, high = c.clip_range()
    pg_loss, st = F.policy_loss_with_stats(
        logp, m.old_logp[rows] if m.old_logp is not None else logp.detach(), m.token_adv[rows], sub.action_mask,
        loss_type="dapo", clip_low=low, clip_high=high,
        ref_logp=m.ref_logp[rows] if m.ref_logp is not None else None, beta=c.beta, token_count=count)
    loss = pg_loss - c.ent_coef * entropy
    record(m.stats, loss=loss.detach(), policy_loss=pg_loss.detach(), entropy=entropy.detach(), kl=st["kl"],
           approx_kl=st["approx_kl"], clip_fraction=st["clip_fraction"])
    return loss


def _value_loss(m: _Member, rows: torch.Tensor, sub: EpisodeBatch, hidden: torch.Tensor,
                count: float | None = None) -> torch.Tensor:
    """``vf_coef`` * (clipped) value loss of one member's minibatch (added to its ``loss`` metric)."""
    a, c = m.agent, m.agent.config
    values, _ = a.state_values(head_values(a, hidden), sub, m.token_level)
    v_loss = F.value_loss(values, m.old_values[rows], m.returns[rows], m.vmask[rows], clip=c.value_clip, count=count)
    m.stats["value_loss"].append(float(v_loss.detach()))
    m.stats["loss"][-1] += c.vf_coef * float(v_loss.detach())
    return c.vf_coef * v_loss


def _finish(m: _Member) -> dict[str, float]:
    m.agent.steps += 1
    b = m.batch
    metrics = mean_metrics(m.stats)
    returns = b.episode_returns()
    metrics.update(mean_reward=float(returns.mean()), mean_return=float(returns.mean()),
                   explained_variance=F.explained_variance(m.old_values, m.returns, m.vmask),
                   truncated=float(b.truncated.float().mean()),
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
