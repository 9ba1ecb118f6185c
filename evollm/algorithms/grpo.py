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
from .rollout import action_mask_for, forward_logprobs, generate, sequence_attention_mask


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
        if self.loss_type not in F.LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not valid; choose one of {list(F.LOSS_TYPES)}")
        if self.scale_rewards not in F.ADVANTAGE_SCALES:
            raise ValueError(f"scale_rewards={self.scale_rewards!r} is not valid; "
                             f"choose one of {list(F.ADVANTAGE_SCALES)}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.batch_size < 1 or self.update_epochs < 1:
            raise ValueError(f"batch_size and update_epochs must be >= 1, got {self.batch_size}, "
                             f"{self.update_epochs}")
        lo, hi = self.clip_bounds()
        if not 0 <= lo <= 1 <= hi:
            raise ValueError(f"clip_coef={self.clip_coef!r} must give bounds lo <= 1 <= hi, got ({lo}, {hi})")


@dataclass
class Rollout:
    """One member's sampled completions for a batch of prompts."""

    sequences: torch.Tensor  # [P*G, L] prompt + completion ids
    attention_mask: torch.Tensor  # [P*G, L]
    action_mask: torch.Tensor  # [P*G, L-1] 1 on generated tokens (up to the first eos)
    prompt_len: int
    group_size: int

    def per_prompt(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        g = self.group_size
        n = self.sequences.shape[0] // g
        return ([self.sequences[i * g:(i + 1) * g] for i in range(n)],
                [self.action_mask[i * g:(i + 1) * g] for i in range(n)])


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
        ids, mask = self._collate(prompts)
        group = self.config.group_size if training else 1
        with self.shared.use(self.adapter_name("actor")) as model:
            model.eval()
            seqs = generate(model, ids, mask, self.sampling_config(training, group), self.pad_token_id,
                            self.eos_token_id)
        return Rollout(seqs, sequence_attention_mask(seqs, mask), action_mask_for(seqs, ids.shape[1],
                       self.eos_token_id), ids.shape[1], group)

    # ------------------------------------------------------------------ learning
    def learn(self, experiences) -> dict[str, float]:
        """One GRPO update from ``(completion_ids, action_masks, rewards)``.

        ``completion_ids``/``action_masks``: per-prompt lists as returned by :meth:`get_action` (or
        stacked ``[P*G, L]`` / ``[P*G, L-1]`` tensors); ``rewards``: ``[P, G]``.
        """
        completion_ids, action_masks, rewards = experiences
        seqs = _stack(completion_ids, self.pad_token_id)
        action_mask = _stack(action_masks, 0).to(seqs.device)
        rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
        c = self.config
        if rewards.numel() != seqs.shape[0]:
            raise ValueError(f"got {rewards.numel()} rewards for {seqs.shape[0]} completions")
        group = c.group_size
        if rewards.numel() % group:
            raise ValueError(f"{rewards.numel()} rewards do not split into groups of group_size={group}")
        attn = _attention_from_sequences(seqs, action_mask, self.pad_token_id)
        advantages = F.group_advantages(rewards, group, scale=c.scale_rewards)

        needs_old = c.update_epochs > 1 or c.batch_size < seqs.shape[0]
        old_logp = self.get_logprobs(seqs, attn) if needs_old else None
        ref_logp = self.get_logprobs(seqs, attn, use_reference=True) if c.beta > 0 else None
        params = self.shared.parameters(self.adapter_name("actor"))
        stats: dict[str, list[float]] = {"loss": [], "kl": [], "clip_fraction": [], "entropy": [], "grad_norm": []}
        gen = torch.Generator().manual_seed(c.seed + self.steps)
        with self.shared.use(self.adapter_name("actor"), train=True) as model:
            for _ in range(c.update_epochs):
                order = torch.randperm(seqs.shape[0], generator=gen)
                for start in range(0, seqs.shape[0], c.batch_size):
                    rows = order[start:start + c.batch_size]
                    logp = forward_logprobs(model, seqs[rows], attn[rows], c.temperature, c.logprob_chunk_rows)
                    m = action_mask[rows].to(logp.device)
                    loss, st = F.policy_loss_with_stats(
                        logp, old_logp[rows] if old_logp is not None else logp.detach(), advantages[rows].to(logp.device),
                        m, loss_type=c.loss_type, clip=c.clip_bounds(),
                        ref_logp=ref_logp[rows] if ref_logp is not None else None, beta=c.beta,
                        max_completion_length=c.max_output_tokens)
                    stats["grad_norm"].append(self.optimizer_step(loss, params))
                    stats["loss"].append(float(loss.detach()))
                    stats["kl"].append(st["kl"])
                    stats["clip_fraction"].append(st["clip_fraction"])
                    stats["entropy"].append(float(F.masked_mean(-logp.detach(), m)))
        self.steps += 1
        grouped = rewards.reshape(-1, group)
        metrics = {k: sum(v) / len(v) for k, v in stats.items()}
        metrics.update(
            mean_reward=float(rewards.mean()),
            zero_std_groups=float((grouped.max(1).values == grouped.min(1).values).float().mean()),
            completion_length=float(action_mask.sum(1).float().mean()),
        )
        return metrics

    # ------------------------------------------------------------------ evaluation
    def test(self, env, loop: int = 1) -> float:
        """Fitness: mean reward on the env's FIXED test set with greedy decoding (appended to
        ``self.fitness``)."""
        from ..training.batched import evaluate_population
        fitness = evaluate_population([self], env)[0]
        return fitness


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


def _stack(rows, pad_value: int) -> torch.Tensor:
    """Stack per-prompt tensors (or pass a tensor through), right-padding to a common width."""
    if torch.is_tensor(rows):
        return rows
    rows = [torch.as_tensor(r) for r in rows]
    rows = [r.unsqueeze(0) if r.dim() == 1 else r for r in rows]
    width = max(r.shape[1] for r in rows)
    padded = [torch.nn.functional.pad(r, (0, width - r.shape[1]), value=pad_value) for r in rows]
    return torch.cat(padded, dim=0)


def _attention_from_sequences(seqs: torch.Tensor, action_mask: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Recover the attention mask of left-padded prompt + completion rows: the leading pad run is
    masked, everything after the first real token is visible."""
    is_pad = seqs == pad_token_id
    leading_pad = is_pad.long().cumprod(dim=1).bool()
    return (~leading_pad).long()
