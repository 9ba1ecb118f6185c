"""GRPO and its loss variants (GSPO, CISPO, Dr. GRPO, DAPO, BNPO).

Read top to bottom: sample ``group_size`` completions per prompt, score them,
turn the rewards into group-relative advantages, and take clipped policy-gradient
steps on this member's LoRA adapter. The maths lives in :mod:`evollm.functional`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .. import functional as F
from .base import AgentConfig, LLMAgent
from ..rollout import (Rollout, attention_from_sequences, evaluate_population, generate_population, member_logprobs,
                       stack_rows)


@dataclass
class GRPOConfig(AgentConfig):
    """GRPO hyperparameters (see :class:`AgentConfig` for the shared ones)."""

    group_size: int = 8
    loss_type: str = "grpo"
    scale_rewards: str = "group"
    lr: float = 5e-5
    beta: float = 0.0
    clip_coef: float | tuple[float, float] = 0.2

    def validate(self) -> None:
        super().validate()
        if self.loss_type not in F.LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not valid; choose one of {list(F.LOSS_TYPES)}")
        if self.scale_rewards not in F.ADVANTAGE_SCALES:
            raise ValueError(f"scale_rewards={self.scale_rewards!r} is not valid; "
                             f"choose one of {list(F.ADVANTAGE_SCALES)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for the GRPO family (advantages are relative to the "
                             f"other samples of the same prompt), got {self.group_size}")
        if self.batch_size < 1 or self.update_epochs < 1:
            raise ValueError(f"batch_size and update_epochs must be >= 1, got {self.batch_size}, "
                             f"{self.update_epochs}")
        lo, hi = self.clip_bounds()
        if not 0 <= lo <= 1 <= hi:
            raise ValueError(f"clip_coef={self.clip_coef!r} must give bounds lo <= 1 <= hi, got ({lo}, {hi})")


class GRPO(LLMAgent):
    """Group Relative Policy Optimization on a LoRA adapter of a shared base model.

    ``GRPO(model, pad_token_id, pad_token, group_size=8, lr=5e-5, loss_type="grpo", ...)``: any
    :class:`GRPOConfig` field may be given as a keyword, or pass ``config=GRPOConfig(...)``.
    """

    config_cls = GRPOConfig
    MUTABLE = LLMAgent.MUTABLE + ("loss_type", "scale_rewards")

    # ------------------------------------------------------------------ population constructor
    @classmethod
    def population(cls, size: int, actor_network: torch.nn.Module, hp_config=None, init_hyperparameters=None,
                   **kwargs) -> list["GRPO"]:
        """``size`` members on ONE shared base. ``init_hyperparameters``: an optional list of per-member
        dicts (e.g. from :func:`evollm.hpo.initial_population_hyperparameters`)."""
        if size < 1:
            raise ValueError(f"population size must be >= 1, got {size}")
        if init_hyperparameters is not None and len(init_hyperparameters) != size:
            raise ValueError(f"init_hyperparameters has {len(init_hyperparameters)} entries for {size} members")
        members = []
        for i in range(size):
            agent = cls(actor_network, hp_config=hp_config, **kwargs)
            for name, value in (init_hyperparameters[i] if init_hyperparameters else {}).items():
                agent.set_hyperparameter(name, value)
            members.append(agent)
        return members

    # ------------------------------------------------------------------ acting
    def get_action(self, prompts: Sequence[dict], training: bool = True):
        """Sample ``group_size`` completions per prompt (one greedy completion when not training).

        Returns ``(completion_ids, action_masks)``: lists with one tensor per prompt, of shapes
        ``[G, L]`` (prompt + completion) and ``[G, L-1]``.
        """
        rollout = self.rollout(prompts, training)
        return rollout.per_prompt()

    def rollout(self, prompts: Sequence[dict], training: bool = True) -> Rollout:
        """This member's samples of ``prompts`` (``group_size`` per prompt when training, else one greedy)."""
        return generate_population([self], prompts, training)[self.index]

    # ------------------------------------------------------------------ learning
    def learn(self, experiences) -> dict[str, float]:
        """One GRPO update from ``(completion_ids, action_masks, rewards)``.

        ``completion_ids``/``action_masks``: per-prompt lists as returned by :meth:`get_action` (or
        stacked ``[P*G, L]`` / ``[P*G, L-1]`` tensors); ``rewards``: ``[P, G]``.
        """
        return grpo_update([self], [experiences])[0]

    @classmethod
    def learn_population(cls, agents: Sequence["GRPO"], experiences: Sequence) -> list[dict[str, float]]:
        """Update several members at once: members whose update settings agree share every forward
        and backward pass (one routed batch over the shared base); each still steps its own optimizer
        on its own loss, exactly as :meth:`learn` would."""
        results: dict[int, dict] = {}
        groups: dict[tuple, list[int]] = {}
        for i, agent in enumerate(agents):
            c = agent.config
            groups.setdefault((id(agent.shared), c.update_epochs, c.batch_size, c.temperature, c.logprob_chunk_rows,
                               agent.pad_token_id, c.disable_dropout), []).append(i)
        for members in groups.values():
            out = grpo_update([agents[i] for i in members], [experiences[i] for i in members])
            results.update(zip(members, out))
        return [results[i] for i in range(len(agents))]

    # ------------------------------------------------------------------ evaluation
    def test(self, env, loop: int = 1) -> float:
        """Fitness: mean reward on the env's FIXED test set with greedy decoding (appended to
        ``self.fitness``). Greedy decoding of fixed prompts is deterministic, so ``loop`` (kept for
        API compatibility) never changes the result and one pass is run."""
        return evaluate_population([self], env)[0]


class GSPO(GRPO):
    """GRPO with one importance ratio per sequence (``loss_type="gspo"``)."""

    def __init__(self, *args, **kwargs):
        kwargs["loss_type"] = "gspo"
        super().__init__(*args, **kwargs)


class CISPO(GRPO):
    """GRPO with the clipped importance-sampling-weight objective (``loss_type="cispo"``)."""

    def __init__(self, *args, **kwargs):
        kwargs["loss_type"] = "cispo"
        super().__init__(*args, **kwargs)


@dataclass
class _Prepared:
    seqs: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None


def _prepare(agent: GRPO, experiences) -> _Prepared:
    completion_ids, action_masks, rewards = experiences
    seqs = stack_rows(completion_ids, agent.pad_token_id)
    mask = stack_rows(action_masks, 0).to(seqs.device)
    rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    c = agent.config
    if rewards.numel() != seqs.shape[0]:
        raise ValueError(f"got {rewards.numel()} rewards for {seqs.shape[0]} completions")
    if rewards.numel() % c.group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of group_size={c.group_size}")
    return _Prepared(seqs, attention_from_sequences(seqs, agent.pad_token_id), mask,
                     F.group_advantages(rewards, c.group_size, scale=c.scale_rewards), rewards)


def _joint_logprobs(agents, seqs, attn, rows_each: int, grad: bool, reference: bool = False) -> torch.Tensor:
    """Log-probs of concatenated row blocks, block ``i`` under ``agents[i]`` (or the reference)."""
    a0, c = agents[0], agents[0].config
    return member_logprobs(a0.shared, [a.adapter_name("actor") for a in agents], seqs, attn, rows_each, grad,
                           reference, c.temperature, c.logprob_chunk_rows, c.logits_budget_mb, c.disable_dropout)


def _fits_one_forward(agents, tokens: int) -> bool:
    """Whether all members' rows (``tokens`` ids in all) can go through one forward pass within
    the logits memory budget (members are then not chunked apart)."""
    c = agents[0].config
    if len(agents) == 1:
        return True
    vocab = agents[0].shared.model.get_output_embeddings().weight.shape[0]
    return c.logprob_chunk_rows is None and 4 * tokens * vocab <= c.logits_budget_mb * 2**20


def grpo_update(agents: Sequence[GRPO], experiences: Sequence) -> list[dict[str, float]]:
    """The GRPO update of one or more members with equal update settings (see ``learn_population``)."""
    batches = [_prepare(a, e) for a, e in zip(agents, experiences)]
    n_rows = {b.seqs.shape[0] for b in batches}
    width = max(b.seqs.shape[1] for b in batches)
    if len(n_rows) > 1 or not _fits_one_forward(agents, sum(n_rows) * len(agents) * width):
        if len(agents) > 1:  # ragged or too large for one forward: member by member
            return [grpo_update([a], [e])[0] for a, e in zip(agents, experiences)]
    rows_total = batches[0].seqs.shape[0]
    pad = agents[0].pad_token_id
    for b in batches:  # common width (right padding is masked out and never attended to earlier)
        extra = width - b.seqs.shape[1]
        if extra:
            b.seqs = torch.nn.functional.pad(b.seqs, (0, extra), value=pad)
            b.attn = torch.nn.functional.pad(b.attn, (0, extra), value=1)
            b.mask = torch.nn.functional.pad(b.mask, (0, extra), value=0)
    c0 = agents[0].config
    all_seqs, all_attn = torch.cat([b.seqs for b in batches]), torch.cat([b.attn for b in batches])
    if c0.update_epochs > 1 or c0.batch_size < rows_total:
        for b, old in zip(batches, _joint_logprobs(agents, all_seqs, all_attn, rows_total, False).split(rows_total)):
            b.old = old
    with_ref = [i for i, a in enumerate(agents) if a.config.beta > 0]
    if with_ref:
        refs = _joint_logprobs(agents, torch.cat([batches[i].seqs for i in with_ref]),
                               torch.cat([batches[i].attn for i in with_ref]), rows_total, False, reference=True)
        for i, ref in zip(with_ref, refs.split(rows_total)):
            batches[i].ref = ref
    params = [a.shared.parameters(a.adapter_name("actor")) for a in agents]
    stats = [{"loss": [], "kl": [], "clip_fraction": [], "entropy": [], "grad_norm": []} for _ in agents]
    gens = [torch.Generator().manual_seed(a.config.seed + a.steps) for a in agents]
    for _ in range(c0.update_epochs):
        orders = [torch.randperm(rows_total, generator=g) for g in gens]
        for start in range(0, rows_total, c0.batch_size):
            rows = [o[start:start + c0.batch_size] for o in orders]
            logp = _joint_logprobs(agents, torch.cat([b.seqs[r] for b, r in zip(batches, rows)]),
                                   torch.cat([b.attn[r] for b, r in zip(batches, rows)]), len(rows[0]), True)
            total = 0.0
            for i, (a, b, r, lp) in enumerate(zip(agents, batches, rows, logp.split(len(rows[0])))):
                c, m = a.config, b.mask[r].to(lp.device)
                loss, st = F.policy_loss_with_stats(
                    lp, b.old[r] if b.old is not None else lp.detach(), b.advantages[r].to(lp.device), m,
                    loss_type=c.loss_type, clip=c.clip_bounds(), ref_logp=b.ref[r] if b.ref is not None else None,
                    beta=c.beta, max_completion_length=c.max_output_tokens)
                total = total + loss
                stats[i]["loss"].append(float(loss.detach()))
                stats[i]["kl"].append(st["kl"])
                stats[i]["clip_fraction"].append(st["clip_fraction"])
                stats[i]["entropy"].append(float(F.masked_mean(-lp.detach(), m)))
            for a in agents:
                a.optimizer.zero_grad(set_to_none=True)
            total.backward()  # each member's loss only reaches its own adapter
            for a, p, st in zip(agents, params, stats):
                st["grad_norm"].append(a.clip_and_step(p))
    out = []
    for a, b, st in zip(agents, batches, stats):
        a.steps += 1
        grouped = b.rewards.reshape(-1, a.config.group_size)
        metrics = {k: sum(v) / len(v) for k, v in st.items()}
        metrics.update(mean_reward=float(b.rewards.mean()),
                       zero_std_groups=float((grouped.max(1).values == grouped.min(1).values).float().mean()),
                       completion_length=float(b.mask.sum(1).float().mean()))
        out.append(metrics)
    return out
