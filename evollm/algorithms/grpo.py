"""GRPO and its loss variants (GSPO, CISPO, Dr. GRPO, DAPO, BNPO).

Read top to bottom: sample ``group_size`` completions per prompt, score them,
turn the rewards into group-relative advantages, and take clipped policy-gradient
steps on this member's LoRA adapter. The maths lives in :mod:`evollm.functional`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .. import functional as F
from evollm.parallel import distributed as dist, zero
from .acting import Acting, ActionResult  # noqa: F401 - ActionResult: what get_action returns
from .base import AgentConfig, LLMAgent
from ..utils.fields import documented
from .compat import agilerl_style_test, is_evollm_env
from .memory_plan import learn_path, member_chunks
from .updates import (chunked_step, mean_metrics, optimizer_only_update, record, run_epochs, with_idle_members,
                      zero_gradient)
from ..rollout import attention_from_sequences, evaluate_population, first_target, member_logprobs, stack_rows


@dataclass
class GRPOConfig(AgentConfig):
    """GRPO hyperparameters (see :class:`AgentConfig` for the shared ones).

    ``loss_type`` picks a row of :data:`evollm.functional.LOSS_PRESETS`; its clip range and
    reward scaling apply to every field left at ``None`` here (``clip_coef``, ``clip_low``,
    ``clip_high``, ``scale_rewards``), also after ``loss_type`` mutates. A field the user sets
    wins over the preset.
    """

    group_size: int = documented(8, "Completions sampled per prompt; advantages are relative to the other "
                                 "completions of the same prompt (>= 2).")
    loss_type: str = documented("grpo", "grpo, dr_grpo, dapo, gspo or cispo: a row of "
                                "evollm.functional.LOSS_PRESETS (loss aggregation, clip range, reward scaling).")
    scale_rewards: str | None = documented(None, "Divisor of the group-centred rewards: 'group' (the group's std), "
                                           "'batch' (the batch's std) or 'none'; None: the loss type's preset.")
    lr: float = 5e-5
    beta: float = 0.0
    clip_coef: float | tuple[float, float] | None = documented(
        None, "Alias of the clip offsets (a float sets both, a tuple is (clip_low, clip_high)); None: the loss type's "
        "preset offsets (clip_low/clip_high still win where set).")
    dynamic_sampling: bool = documented(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and "
                                        "refill the batch from further prompts.")
    dynamic_sampling_max_batches: int = documented(3, "Most extra batches of prompts dynamic sampling draws per "
                                                   "step.")
    overlong_buffer: int = documented(0, "DAPO overlong reward shaping: a soft penalty over the last overlong_buffer "
                                      "tokens before max_output_tokens; 0: off.")
    overlong_penalty: float = documented(1.0, "The overlong penalty reached at max_output_tokens (-overlong_penalty).")

    def preset(self) -> dict:
        """This loss type's row of :data:`evollm.functional.LOSS_PRESETS` (grpo's for an unknown
        name, which :meth:`validate` then rejects)."""
        return F.LOSS_PRESETS.get(self.loss_type, F.LOSS_PRESETS["grpo"])

    def default_clip(self) -> tuple[float, float]:
        """The loss type's preset ``(clip_low, clip_high)``."""
        p = self.preset()
        return float(p["clip_low"]), float(p["clip_high"])

    def reward_scaling(self) -> str:
        """``scale_rewards``, or the loss type's preset when unset."""
        return self.scale_rewards if self.scale_rewards is not None else str(self.preset()["scale_rewards"])

    sampler_correction: str = documented(
        "token_truncate", "Correction of a sampler/trainer mismatch when the rollouts carry the sampling engine's "
        "log-probs (rollout_backend='vllm'): TRL's vllm_importance_sampling_mode (token_truncate, token_mask, "
        "sequence_truncate, sequence_mask) or 'none'.")
    sampler_correction_cap: float | None = documented(2.0, "Upper bound of the sampler importance weight (TRL's "
                                                      "vllm_importance_sampling_cap); None: no bound.")
    sampler_correction_floor: float | None = documented(None, "Lower bound of the sampler importance weight; None: "
                                                        "no bound.")

    def validate(self) -> None:
        super().validate()
        if self.sampler_correction not in F.SAMPLER_CORRECTIONS + ("none",):
            raise ValueError(f"sampler_correction={self.sampler_correction!r} is not valid; choose one of "
                             f"{list(F.SAMPLER_CORRECTIONS) + ['none']}")
        if self.loss_type not in F.LOSS_TYPES:
            removed = "; 'bnpo' was removed (it was 'dapo' without clip-higher): use 'dapo'" \
                if self.loss_type == "bnpo" else ""
            raise ValueError(f"loss_type={self.loss_type!r} is not valid; choose one of {list(F.LOSS_TYPES)}"
                             + removed)
        if self.overlong_buffer < 0 or self.overlong_buffer > self.max_output_tokens:
            raise ValueError(f"overlong_buffer must be in [0, max_output_tokens={self.max_output_tokens}], "
                             f"got {self.overlong_buffer}")
        if self.scale_rewards is not None and self.scale_rewards not in F.ADVANTAGE_SCALES:
            raise ValueError(f"scale_rewards={self.scale_rewards!r} is not valid; "
                             f"choose one of {list(F.ADVANTAGE_SCALES)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for GRPO-style group-relative advantages (relative to the "
                             f"other samples of the same prompt), got {self.group_size}")
        if self.batch_size < 1 or self.update_epochs < 1:
            raise ValueError(f"batch_size and update_epochs must be >= 1, got {self.batch_size}, "
                             f"{self.update_epochs}")


class GRPO(Acting, LLMAgent):
    """Group Relative Policy Optimization on a LoRA adapter of a shared base model.

    ``GRPO(model, pad_token_id, pad_token, group_size=8, lr=5e-5, loss_type="grpo", ...)``: any
    :class:`GRPOConfig` field may be given as a keyword, or pass ``config=GRPOConfig(...)``.
    """

    config_cls = GRPOConfig
    USES_SAMPLER_LOGP = True  # learn() takes the sampling engine's log-probs as a 4th experience element
    MUTABLE = LLMAgent.MUTABLE + ("loss_type", "scale_rewards", "group_size")

    def set_hyperparameter(self, name: str, value) -> None:
        if name == "group_size":  # read at the next rollout (sampler) and learn (advantage groups)
            if int(value) < 2:
                raise ValueError(f"group_size must be >= 2 to evolve (advantages are relative to the group), "
                                 f"got {value}")
            value = int(value)
        super().set_hyperparameter(name, value)

    def get_hyperparameter(self, name: str):
        if name == "scale_rewards":  # the value in effect, preset included
            return self.config.reward_scaling()
        return super().get_hyperparameter(name)

    # ------------------------------------------------------------------ learning
    def learn(self, experiences) -> dict[str, float]:
        """One GRPO update from ``(completion_ids, action_masks, rewards)``, or
        ``(completion_ids, action_masks, rewards, sampler_logp)`` when a sampling engine (vLLM) produced
        the completions: its log-probs ``[P*G, L-1]`` then drive the ``sampler_correction``.

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
            groups.setdefault((id(agent.shared), c.update_epochs, c.batch_size, c.logprob_chunk_rows,
                               c.logits_budget_mb, c.learn_chunk_members, agent.pad_token_id, c.disable_dropout),
                              []).append(i)
        for members in groups.values():
            out = grpo_update([agents[i] for i in members], [experiences[i] for i in members])
            results.update(zip(members, out))
        return [results[i] for i in range(len(agents))]

    # ------------------------------------------------------------------ evaluation
    def test(self, env, loop: int = 1) -> float:
        """Fitness: mean reward on the env's FIXED test set with greedy decoding (appended to
        ``self.fitness``). Greedy decoding of fixed prompts is deterministic, so ``loop`` (kept for
        API compatibility) never changes the result and one pass is run. An env written for AgileRL
        (see :func:`evollm.algorithms.compat.agilerl_style_test`) is played ``loop`` times."""
        if is_evollm_env(env) and hasattr(env, "test_prompts"):
            return np.float64(evaluate_population([self], env)[0])  # a float with AgileRL's .shape == ()
        if is_evollm_env(env):
            from .multiturn_rollout import EpisodeAgent
            return EpisodeAgent.test(self, env, loop)
        return agilerl_style_test(self, env, loop)


class GSPO(GRPO):
    """GRPO with one importance ratio per sequence (``loss_type="gspo"``; preset clip range
    3e-4/4e-4 as in the GSPO paper unless ``clip_coef``/``clip_low``/``clip_high`` are given)."""

    def __init__(self, *args, **kwargs):
        kwargs["loss_type"] = "gspo"
        super().__init__(*args, **kwargs)


class CISPO(GRPO):
    """GRPO with the clipped importance-sampling-weight objective (``loss_type="cispo"``; preset
    cap 5 on the IS weight, i.e. ``clip_high=4.0``, as TRL's ``epsilon_high=5``)."""

    def __init__(self, *args, **kwargs):
        kwargs["loss_type"] = "cispo"
        super().__init__(*args, **kwargs)


#: the per-minibatch metrics of a GRPO update (``kl``: k3 to the reference; ``approx_kl``: to the sampling
#: policy; ``entropy``: of the scored distribution, at the sampling temperature)
METRICS = ("loss", "kl", "approx_kl", "clip_fraction", "entropy", "grad_norm", "shared_prompt")


@dataclass
class _Prepared:
    seqs: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    sampler: torch.Tensor | None = None  # the sampling engine's log-probs, when they came with the rollout


def _prepare(agent: GRPO, experiences) -> _Prepared:
    completion_ids, action_masks, rewards = experiences[:3]
    sampler = experiences[3] if len(experiences) > 3 and agent.config.sampler_correction != "none" else None
    seqs = stack_rows(completion_ids, agent.pad_token_id)
    mask = stack_rows(action_masks, 0).to(seqs.device)
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() == 2 and rewards.shape[0] == seqs.shape[0] != rewards.numel():
        rewards = rewards.sum(-1)  # multi-turn: one reward per turn -> the trajectory's return
    rewards = rewards.reshape(-1)
    c = agent.config
    if rewards.numel() != seqs.shape[0]:
        raise ValueError(f"Rewards must provide one scalar per trajectory: got {rewards.numel()} rewards for "
                         f"{seqs.shape[0]} completions")
    if rewards.numel() % c.group_size:
        raise ValueError(f"the batch of {rewards.numel()} completions must be divisible by group_size="
                         f"{c.group_size}")
    if c.overlong_buffer:
        rewards = rewards + F.overlong_penalty(mask.sum(1).cpu(), c.max_output_tokens, c.overlong_buffer,
                                               c.overlong_penalty)
    sampler = None if sampler is None else stack_rows(sampler, 0).float()
    if c.dynamic_sampling:  # keep the groups that carry a learning signal
        keep = F.informative_groups(rewards, c.group_size).repeat_interleave(c.group_size)
        seqs, mask, rewards = seqs[keep.to(seqs.device)], mask[keep.to(mask.device)], rewards[keep]
        if sampler is not None:
            sampler = sampler[keep.to(sampler.device)]
    advantages = F.group_advantages(rewards, c.group_size, scale=c.reward_scaling(), reduce=dist.batch_reduce())
    clip = agent.__dict__.get("adv_clip_range")  # AgileRL's advantage clipping
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return _Prepared(seqs, attention_from_sequences(seqs, agent.pad_token_id), mask, advantages, rewards,
                     sampler=sampler)


def _joint_logprobs(agents, seqs, attn, rows_each: int, grad: bool, reference: bool = False,
                    start: int | None = None, with_entropy: bool = False, info: dict | None = None):
    """Log-probs of concatenated row blocks, block ``i`` under ``agents[i]`` (or the reference); the
    output head runs only from ``start`` on (the first completion position: the loss reads no column
    before it), and each group's prompt is computed once where the model takes it (``info["shared_prompt"]``
    says whether it did; see :func:`evollm.rollout.forward_logprobs`)."""
    a0, c = agents[0], agents[0].config
    return member_logprobs(a0.shared, [a.adapter_name("actor") for a in agents], seqs, attn, rows_each, grad,
                           reference, [a.config.temperature for a in agents], c.logprob_chunk_rows, c.logits_budget_mb,
                           c.disable_dropout, start=start, with_entropy=with_entropy, info=info)


def grpo_update(agents: Sequence[GRPO], experiences: Sequence) -> list[dict[str, float]]:
    """The GRPO update of one or more members with equal update settings (see ``learn_population``).

    Members are learned in groups sized to the activation budget (:func:`member_chunks`): one routed
    forward and backward per group and minibatch. Each member's loss reaches only its own adapter, so
    the result equals learning member by member. The metrics say which path ran (``learn_path``) and
    in how many passes per minibatch (``learn_chunks``)."""
    batches = [_prepare(a, e) for a, e in zip(agents, experiences)]
    idle = [i for i, (a, b) in enumerate(zip(agents, batches)) if zero_gradient(a, b.advantages, b.seqs.shape[0])]
    if idle:  # no signal: these members' loss and gradient are exactly zero, only their optimizers step
        return with_idle_members(agents, experiences, idle, lambda i: _optimizer_only_update(agents[i], batches[i]),
                                 grpo_update)
    if any(b.seqs.shape[0] == 0 for b in batches):  # dynamic sampling left a member nothing to learn from
        return [_no_update(a, b) if b.seqs.shape[0] == 0 else grpo_update([a], [e])[0]
                for a, b, e in zip(agents, batches, experiences)]
    if len({b.seqs.shape[0] for b in batches}) > 1 and len(agents) > 1:  # ragged: member by member
        out = [grpo_update([a], [e])[0] for a, e in zip(agents, experiences)]
        for m in out:
            m.update(learn_path="member_by_member", learn_chunks=float(len(agents)))
        return out
    width = max(b.seqs.shape[1] for b in batches)
    rows_total = batches[0].seqs.shape[0]
    pad = agents[0].pad_token_id
    for b in batches:  # common width (right padding is masked out and never attended to earlier)
        extra = width - b.seqs.shape[1]
        if extra:
            b.seqs = torch.nn.functional.pad(b.seqs, (0, extra), value=pad)
            b.attn = torch.nn.functional.pad(b.attn, (0, extra), value=1)
            b.mask = torch.nn.functional.pad(b.mask, (0, extra), value=0)
            if b.sampler is not None:
                b.sampler = torch.nn.functional.pad(b.sampler, (0, extra), value=0.0)
    c0 = agents[0].config
    starts = [first_target(b.mask) for b in batches]  # the loss reads no column before a member's start
    chunks = member_chunks(agents, min(c0.batch_size, rows_total), width, width - min(starts) + 1)
    for ch in chunks:
        ags, bs, start = [agents[i] for i in ch], [batches[i] for i in ch], min(starts[i] for i in ch)
        if c0.update_epochs > 1 or c0.batch_size < rows_total:
            olds = _joint_logprobs(ags, torch.cat([b.seqs for b in bs]), torch.cat([b.attn for b in bs]),
                                   rows_total, False, start=start)
            for b, old in zip(bs, olds.split(rows_total)):
                b.old = old
        ref_idx = [i for i in ch if agents[i].config.beta > 0]
        with_ref = [batches[i] for i in ref_idx]
        if with_ref:
            refs = _joint_logprobs([agents[i] for i in ref_idx], torch.cat([b.seqs for b in with_ref]),
                                   torch.cat([b.attn for b in with_ref]), rows_total, False, reference=True,
                                   start=min(starts[i] for i in ref_idx))
            for b, ref in zip(with_ref, refs.split(rows_total)):
                b.ref = ref
    params = [a.shared.parameters(a.adapter_name("actor")) for a in agents]

    def learn_chunk(ch: list[int], rows: list, counts: list, stats) -> None:
        _learn_chunk([agents[i] for i in ch], [batches[i] for i in ch], rows, [stats[i] for i in ch], counts)

    step = chunked_step(agents, chunks, params, lambda i, r: batches[i].mask[r], learn_chunk)
    stats = run_epochs(agents, rows_total, step, [{k: [] for k in METRICS} for _ in agents])
    out = []
    path = learn_path(len(agents), len(chunks))
    for a, b, st in zip(agents, batches, stats):
        a.steps += 1
        grouped = b.rewards.reshape(-1, a.config.group_size)
        metrics = mean_metrics(st)
        metrics.update(mean_reward=float(b.rewards.mean()),
                       zero_std_groups=float((grouped.max(1).values == grouped.min(1).values).float().mean()),
                       completion_length=float(b.mask.sum(1).float().mean()),
                       learn_path=path, learn_chunks=float(len(chunks)))
        out.append(metrics)
    return out


def _learn_chunk(agents, batches, rows, stats, counts) -> None:
    """One fused forward + backward over a group of members' minibatch rows (gradients accumulate;
    each member's loss reaches only its own adapter); ``counts``: each member's token-mean divisor (None:
    its own rows' count)."""
    info: dict = {}
    logp, entropy = _joint_logprobs(agents, torch.cat([b.seqs[r] for b, r in zip(batches, rows)]),
                                    torch.cat([b.attn[r] for b, r in zip(batches, rows)]), len(rows[0]), True,
                                    start=min(first_target(b.mask[r]) for b, r in zip(batches, rows)),
                                    with_entropy=True, info=info)
    total = 0.0
    for a, b, r, lp, ent, st, count in zip(agents, batches, rows, logp.split(len(rows[0])),
                                           entropy.split(len(rows[0])), stats, counts):
        c, m = a.config, b.mask[r].to(lp.device)
        old = b.old[r] if b.old is not None else lp.detach()
        weights = None
        if b.sampler is not None:  # the engine sampled: correct its mismatch with the trainer
            weights, ist = F.sampler_importance_weights(old, b.sampler[r].to(lp.device), m, c.sampler_correction,
                                                        c.sampler_correction_cap, c.sampler_correction_floor)
            record(st, **{f"sampler_{k}": v for k, v in ist.items()})
        low, high = c.clip_range()
        loss, s = F.policy_loss_with_stats(
            lp, old, b.advantages[r].to(lp.device), m, loss_type=c.loss_type, clip_low=low, clip_high=high,
            ref_logp=b.ref[r] if b.ref is not None else None, beta=c.beta, max_completion_length=c.max_output_tokens,
            is_weights=weights, token_count=count)
        total = total + zero.track(a.optimizer, loss)  # under DeepSpeed ZeRO: through the member's engine
        # shared_prompt 1: the group's prompt ran once (0: plain forward)
        record(st, loss=loss.detach(), kl=s["kl"], approx_kl=s["approx_kl"], clip_fraction=s["clip_fraction"],
               entropy=F.masked_mean(ent, m), shared_prompt=info["shared_prompt"])
    total.backward()


def _optimizer_only_update(agent: GRPO, batch: _Prepared) -> dict[str, float]:
    """The update of a member whose gradient is exactly zero, without its forwards and backward
    (:func:`~evollm.algorithms.updates.optimizer_only_update`). Entropy and ``approx_kl`` are not
    measured (``nan``)."""
    c = agent.config
    optimizer_only_update(agent, agent.shared.parameters(agent.adapter_name("actor")), batch.seqs.shape[0])
    agent.steps += 1
    grouped = batch.rewards.reshape(-1, c.group_size)
    return {**_unmeasured_sampler(batch), "loss": 0.0, "kl": 0.0, "approx_kl": float("nan"), "clip_fraction": 0.0, "entropy": float("nan"),
            "grad_norm": 0.0, "epochs": float(c.update_epochs), "mean_reward": float(batch.rewards.mean()),
            "zero_std_groups": float((grouped.max(1).values == grouped.min(1).values).float().mean()),
            "completion_length": float(batch.mask.sum(1).float().mean()), "learn_path": "no_gradient",
            "learn_chunks": 0.0}


def _unmeasured_sampler(batch: _Prepared) -> dict[str, float]:
    """``sampler_*`` metrics of a step that ran no trainer forward: the engine sampled, but its mismatch
    with the trainer was not measured (``nan``; no update needed a correction). Every step of a run
    with engine rollouts carries the same columns."""
    return {} if batch.sampler is None else {f"sampler_{k}": float("nan") for k in F.SAMPLER_STATS}


def _no_update(agent: GRPO, batch: _Prepared) -> dict[str, float]:
    """Metrics of a step with no informative group (every group's rewards equal): no update."""
    agent.steps += 1
    return {**_unmeasured_sampler(batch), "loss": 0.0, "kl": 0.0, "approx_kl": 0.0, "clip_fraction": 0.0, "entropy": float("nan"),
            "grad_norm": 0.0, "epochs": 0.0, "mean_reward": float("nan"), "zero_std_groups": 1.0,
            "completion_length": float("nan")}

