"""Pure tensor functions for the RL objectives used by evollm.

Everything here is stateless and works on plain ``torch.Tensor`` inputs, so
it can be unit-tested against hand-computed values and reused by every
algorithm (GRPO family, PPO, REINFORCE variants, multi-turn training).

Shape conventions
-----------------
``B``  number of sequences (samples) in the batch.
``G``  group size (completions per prompt) for group-relative methods.
``T``  number of completion (action) token positions per sequence.
``L``  sequence length of a logits tensor, ``V`` vocabulary size.
``K``  number of turns in a multi-turn episode.

Masks may be bool, integer or float tensors; a cell is *valid* when its mask
value is non-zero.  Values in invalid cells are never read arithmetically
(they may hold garbage, ``inf`` or ``NaN``) and outputs are 0 there.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "LOSS_TYPES", "ADVANTAGE_SCALES", "group_advantages", "k3_kl", "policy_loss",
    "policy_loss_with_stats", "gae", "rebn", "masked_mean", "masked_sum", "masked_whiten",
    "value_loss", "token_logprobs", "entropy_from_logits", "broadcast_turn_values",
    "turn_values_from_tokens", "SAMPLER_CORRECTIONS", "sampler_importance_weights",
]

#: Valid values of ``loss_type`` for :func:`policy_loss`.
LOSS_TYPES: Tuple[str, ...] = ("grpo", "gspo", "dr_grpo", "dapo", "bnpo", "cispo")
#: Valid values of ``scale`` for :func:`group_advantages`.
ADVANTAGE_SCALES: Tuple[str, ...] = ("group", "batch", "none")

ClipSpec = Union[float, Sequence[float]]
#: Valid values of ``mode`` for :func:`sampler_importance_weights` (TRL's ``vllm_importance_sampling_mode``).
SAMPLER_CORRECTIONS: Tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# --------------------------------------------------------------------------- #
# Masked reductions
# --------------------------------------------------------------------------- #
def _valid(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x`` over valid cells (all cells if ``dim`` is None, else along ``dim``).

    Invalid cells are excluded with ``torch.where``, so ``NaN``/``inf`` there
    do not leak into the result or its gradient.
    """
    x = torch.where(_valid(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over valid cells (whole tensor, or along ``dim``).

    The count is clamped to at least 1, so a reduction over zero valid cells
    returns 0 rather than NaN.
    """
    count = _valid(mask).to(x.dtype)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def _masked_std(x: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """(mean, unbiased std) over all valid cells; std is 0 with fewer than 2 cells."""
    valid = _valid(mask)
    n = valid.sum().to(x.dtype)
    mean = masked_sum(x, valid) / n.clamp(min=1)
    sq = masked_sum((x - mean) ** 2, valid)
    var = torch.where(n > 1, sq / (n - 1).clamp(min=1), torch.zeros_like(sq))
    return mean, var.sqrt()


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """Standardise ``x`` using mean/std computed over valid cells only.

    Returns ``(x - mean) / (std + eps)`` (std unbiased, 0 when fewer than two
    valid cells); with ``shift_mean=False`` the mean is added back, i.e. only
    the scale is normalised.  Invalid cells are 0.  Same shape as ``x``.
    """
    valid = _valid(mask)
    mean, std = _masked_std(x, valid)
    out = (x - mean) / (std + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, torch.zeros_like(out))


# --------------------------------------------------------------------------- #
# Advantages
# --------------------------------------------------------------------------- #
def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Group-relative advantages (GRPO-style).

    Args:
        rewards: flat ``[B*G]`` rewards; groups are contiguous, i.e. entries
            ``g*G .. g*G+G-1`` are the completions of prompt ``g``.
        group_size: ``G``.
        scale: ``"group"``: ``(r - mean_g) / (std_g + eps)``;
            ``"batch"``: ``(r - mean_g) / (std_batch + eps)``;
            ``"none"``: ``r - mean_g``.  Standard deviations are unbiased
            (``torch.std`` default); a std over a single element (``G == 1``,
            or a batch of one) is defined as 0 instead of NaN.
        eps: added to the std.

    Returns:
        ``[B*G]`` float advantages.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a flat [B*G] tensor, got shape {tuple(rewards.shape)}")
    if int(group_size) < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n = rewards.numel()
    if n % group_size != 0:
        raise ValueError(f"number of rewards ({n}) is not divisible by group_size ({group_size})")
    r = rewards if rewards.is_floating_point() else rewards.float()
    grouped = r.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    centred = (grouped - mean).reshape(-1)
    if scale == "none":
        return centred
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        std = std.expand_as(grouped).reshape(-1)
    else:
        std = r.std() if n > 1 else torch.zeros((), dtype=r.dtype, device=r.device)
    return centred / (std + eps)


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    last_values: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Generalised advantage estimation over ragged sequences.

    Args:
        rewards, values, mask: ``[B, T]``.  Played positions are those with a
            non-zero mask (contiguous from position 0, lengths may differ).
        gamma: discount, lam: GAE lambda.
        last_values: ``[B]`` bootstrap value ``V`` after each row's last played
            position; None means terminal (0).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and
    ``A_t = delta_t + gamma * lam * A_{t+1}``, where beyond the last played
    position ``V`` is ``last_values`` and ``A`` is 0.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``; ``returns = A + V``;
        0 where the mask is 0.  Callers normally pass detached tensors.
    """
    valid = _valid(mask)
    B, T = rewards.shape
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    r = torch.where(valid, rewards.to(values.dtype), zero)
    v = torch.where(valid, values, zero)
    boot = zero.expand(B) if last_values is None else last_values.to(values.dtype).reshape(B)
    next_adv = zero.expand(B)
    next_val = boot
    cols = []
    for t in reversed(range(T)):
        if t + 1 < T:
            nxt = valid[:, t + 1]
            next_val = torch.where(nxt, v[:, t + 1], boot)
            next_adv = torch.where(nxt, cols[-1], zero)
        delta = r[:, t] + gamma * next_val - v[:, t]
        cols.append(torch.where(valid[:, t], delta + gamma * lam * next_adv, zero))
    adv = torch.stack(cols[::-1], dim=1)
    returns = torch.where(valid, adv + v, zero)
    return adv, returns


def _discounted_returns(rewards: Tensor, valid: Tensor, gamma: float) -> Tensor:
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    r = torch.where(valid, rewards, zero)
    running = zero.expand(rewards.shape[0])
    cols = []
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], r[:, t] + gamma * running, zero)
        cols.append(running)
    return torch.stack(cols[::-1], dim=1)


def rebn(rewards: Tensor, mask: Tensor, gamma: float, eps: float = 1e-8) -> Tensor:
    """REINFORCE with batch-normalised returns.

    Computes ``G_t = r_t + gamma * G_{t+1}`` within each row's played positions
    (``rewards``/``mask`` ``[B, T]``), then z-scores over all valid
    (sample, position) cells of the batch: ``(G - mean) / (std + eps)`` with
    the unbiased std (0 when there is a single valid cell).  Returns
    ``[B, T]``, 0 where the mask is 0.
    """
    valid = _valid(mask)
    r = rewards if rewards.is_floating_point() else rewards.float()
    return masked_whiten(_discounted_returns(r, valid, gamma), valid, eps=eps)


# --------------------------------------------------------------------------- #
# Policy / value losses
# --------------------------------------------------------------------------- #
def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Elementwise k3 KL estimator ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, 0 at equality)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def _clip_range(clip: ClipSpec) -> Tuple[float, float]:
    if isinstance(clip, (int, float)):
        c = float(clip)
        return 1.0 - c, 1.0 + c
    lo, hi = (float(c) for c in clip)
    if lo > hi:
        raise ValueError(f"clip range must satisfy lo <= hi, got ({lo}, {hi})")
    return lo, hi


def policy_loss_with_stats(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    clip: ClipSpec = (0.8, 1.2),
    ref_logp: Optional[Tensor] = None,
    beta: float = 0.0,
    max_completion_length: Optional[int] = None,
    is_weights: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, float]]:
    """Clipped policy-gradient loss for the GRPO family, plus diagnostics.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy
            (carries the gradient).
        old_logp: ``[B, T]`` log-probs under the sampling policy.
        advantages: ``[B]`` (one per sequence, broadcast to its tokens) or
            ``[B, T]`` per-token advantages.
        mask: ``[B, T]`` completion-token mask.
        loss_type: one of :data:`LOSS_TYPES`.
        clip: ``(lo, hi)`` ratio bounds, or a float ``c`` meaning ``(1-c, 1+c)``.
        ref_logp: ``[B, T]`` reference-model log-probs (needed when beta > 0).
        beta: weight of the per-token k3 KL penalty.
        max_completion_length: divisor length for ``dr_grpo``.
        is_weights: optional ``[B, T]`` sampler-correction weights (see
            :func:`sampler_importance_weights`, detached); the policy term of every
            token is multiplied by its weight before the KL penalty is added.

    Per-token term, with ratio ``rho = exp(logp - old_logp)`` (for ``gspo``
    one ratio per sequence, ``exp`` of the masked mean of ``logp - old_logp``,
    broadcast to its tokens):

    * grpo, gspo, dr_grpo, dapo, bnpo: ``-min(rho*A, clip(rho, lo, hi)*A)``
    * cispo: ``-sg(min(rho, hi)) * A * logp`` (sg = stop-gradient)

    plus ``beta * k3_kl(logp, ref_logp)`` when ``beta > 0``.

    Reduction over valid tokens:

    * grpo, gspo: mean over the ``B`` sequences of each sequence's token mean;
      a sequence with no valid token contributes 0 (count clamped to 1) and
      still counts in the ``B`` divisor.
    * dapo, bnpo, cispo: token sum / token count (0 if no valid tokens).
    * dr_grpo: token sum / ``(B * max_completion_length)``.

    Returns:
        ``(loss, stats)``: scalar loss and a dict of Python floats:
        ``kl`` (masked token mean of k3, 0.0 without ``ref_logp``),
        ``clip_fraction`` (fraction of valid tokens where clipping changed
        the objective: for the min-clipped losses, ``A > 0 and rho > hi`` or
        ``A < 0 and rho < lo``, i.e. where the clipped term is the one strictly
        selected and the gradient is zero; for cispo, ``rho > hi``, i.e. the
        importance weight was truncated), and ``ratio_mean`` (masked token mean
        of ``rho``; the sequence ratio for gspo).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("is_weights", is_weights)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 requires ref_logp")
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length <= 0):
        raise ValueError("loss_type 'dr_grpo' requires a positive max_completion_length")
    lo, hi = _clip_range(clip)
    B, T = logp.shape
    valid = _valid(mask)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)

    if advantages.dim() == 1 and advantages.shape[0] == B:
        adv = advantages.to(logp.dtype)[:, None].expand(B, T)
    elif advantages.shape == logp.shape:
        adv = advantages.to(logp.dtype)
    else:
        raise ValueError(f"advantages must be [B] or [B, T], got {tuple(advantages.shape)} for logp {(B, T)}")
    adv = adv.detach()

    # Sanitise invalid cells so inf/NaN there cannot poison values or gradients.
    lp = torch.where(valid, logp, zero)
    log_ratio = lp - torch.where(valid, old_logp.to(logp.dtype), zero).detach()
    if loss_type == "gspo":
        log_ratio = masked_mean(log_ratio, valid, dim=1)[:, None].expand(B, T)
    ratio = torch.exp(log_ratio)

    if loss_type == "cispo":
        per_token = -ratio.clamp(max=hi).detach() * adv * lp
        clipped = ratio > hi
    else:
        per_token = -torch.min(ratio * adv, ratio.clamp(lo, hi) * adv)
        clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
    if is_weights is not None:
        per_token = per_token * torch.where(valid, is_weights.to(logp.dtype), zero).detach()

    kl_tok = None
    if ref_logp is not None:
        kl_tok = k3_kl(lp, torch.where(valid, ref_logp.to(logp.dtype), zero).detach())
        if beta > 0:
            per_token = per_token + beta * kl_tok

    if loss_type in ("grpo", "gspo"):
        loss = masked_mean(per_token, valid, dim=1).mean()
    elif loss_type == "dr_grpo":
        loss = masked_sum(per_token, valid) / (B * max_completion_length)
    else:
        loss = masked_mean(per_token, valid)

    with torch.no_grad():
        stats = {
            "kl": float(masked_mean(kl_tok, valid)) if kl_tok is not None else 0.0,
            "clip_fraction": float(masked_mean(clipped.to(logp.dtype), valid)),
            "ratio_mean": float(masked_mean(ratio, valid)),
        }
    return loss, stats


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    clip: ClipSpec = (0.8, 1.2),
    ref_logp: Optional[Tensor] = None,
    beta: float = 0.0,
    max_completion_length: Optional[int] = None,
    is_weights: Optional[Tensor] = None,
) -> Tensor:
    """Scalar policy loss; see :func:`policy_loss_with_stats` for the semantics."""
    return policy_loss_with_stats(
        logp, old_logp, advantages, mask, loss_type=loss_type, clip=clip,
        ref_logp=ref_logp, beta=beta, max_completion_length=max_completion_length, is_weights=is_weights,
    )[0]


def sampler_importance_weights(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    mode: str = "token_truncate",
    cap: Optional[float] = 2.0,
    floor: Optional[float] = None,
) -> Tuple[Tensor, Dict[str, float]]:
    """Importance weights correcting a sampler/trainer mismatch (e.g. vLLM vs the HF forward).

    The completions were drawn from the sampling engine's distribution ``q`` (its log-probs
    ``sampler_logp``) while the loss treats them as drawn from the trainer's ``pi`` (its log-probs
    ``trainer_logp``, no gradient). The weight of a token is ``rho = exp(trainer_logp -
    sampler_logp)`` (``token_*`` modes), or one ratio per sequence, ``exp`` of the masked SUM of the
    differences, broadcast to its tokens (``sequence_*`` modes). Then, as TRL's
    ``vllm_importance_sampling_correction`` with ``vllm_importance_sampling_mode``:

    * ``*_truncate``: ``rho = clamp(rho, floor, cap)`` (truncated importance sampling);
    * ``*_mask``: ``rho = 0`` where ``rho > cap`` or ``rho < floor`` (the token / sequence is dropped).

    ``None`` disables a bound. Returns ``(weights [B, T], stats)``; weights are 0 on invalid
    cells. ``stats`` (Python floats, over valid tokens): ``logp_diff_mean`` / ``logp_diff_max``
    (``|trainer_logp - sampler_logp|``), ``is_ratio_min`` / ``_mean`` / ``_max`` (after the bounds;
    per sequence in the sequence modes) and ``is_corrected_fraction`` (fraction of ratios a bound
    changed).
    """
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(f"sampler correction mode {mode!r} is not valid; choose one of {list(SAMPLER_CORRECTIONS)}")
    if cap is not None and floor is not None and floor > cap:
        raise ValueError(f"sampler correction floor={floor} is above cap={cap}")
    for name, t in (("sampler_logp", sampler_logp), ("mask", mask)):
        if t.shape != trainer_logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != trainer_logp shape {tuple(trainer_logp.shape)}")
    valid = _valid(mask)
    zero = torch.zeros((), dtype=torch.float32, device=trainer_logp.device)
    diff = torch.where(valid, trainer_logp.detach().float() - sampler_logp.detach().float().to(trainer_logp.device),
                       zero)
    per_sequence = mode.startswith("sequence")
    log_ratio = diff.sum(dim=1, keepdim=True) if per_sequence else diff
    raw = torch.exp(log_ratio)
    lo = -math.inf if floor is None else float(floor)
    hi = math.inf if cap is None else float(cap)
    out_of_bounds = (raw < lo) | (raw > hi)
    ratio = raw.clamp(lo, hi) if mode.endswith("truncate") else raw.masked_fill(out_of_bounds, 0.0)
    weights = torch.where(valid, ratio.expand_as(diff), zero)
    cells = valid.any(dim=1, keepdim=True) if per_sequence else valid
    flat, corrected = ratio[cells], out_of_bounds[cells]
    abs_diff = diff.abs()[valid]

    def _stat(x: Tensor, fn) -> float:
        return float(fn(x)) if x.numel() else 0.0

    stats = {
        "logp_diff_mean": _stat(abs_diff, torch.mean), "logp_diff_max": _stat(abs_diff, torch.max),
        "is_ratio_min": _stat(flat, torch.min), "is_ratio_mean": _stat(flat, torch.mean),
        "is_ratio_max": _stat(flat, torch.max), "is_corrected_fraction": _stat(corrected.float(), torch.mean),
    }
    return weights, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: Optional[float] = None,
) -> Tensor:
    """PPO value loss (without ``vf_coef``), masked mean over ``[B, T]`` cells.

    Per cell ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``,
    or ``0.5 * (V - R)^2`` when ``clip`` is None.
    """
    returns = returns.detach()
    loss = (values - returns) ** 2
    if clip is not None:
        old = old_values.detach()
        v_clipped = torch.max(torch.min(values, old + clip), old - clip)
        loss = torch.max(loss, (v_clipped - returns) ** 2)
    return masked_mean(0.5 * loss, mask)


# --------------------------------------------------------------------------- #
# Logits helpers
# --------------------------------------------------------------------------- #
def token_logprobs(logits: Tensor, labels: Tensor, chunk_size: int = 8) -> Tensor:
    """Log-probability of ``labels`` under ``logits``: ``[B, L, V]``, ``[B, L]`` -> ``[B, L]``.

    Computed as ``gather(logits, labels) - logsumexp(logits)`` in float32,
    ``chunk_size`` rows (of ``B``) at a time, so only one chunk is ever upcast
    and no full log-softmax tensor is materialised.  Negative labels (e.g. an
    ignore index of -100) give 0.  Output is float32.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape)}")
    ignore = labels < 0
    idx = labels.clamp(min=0).long().unsqueeze(-1)
    out = []
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start:start + chunk_size].float()
        picked = torch.gather(chunk, -1, idx[start:start + chunk_size]).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    res = torch.cat(out, dim=0) if out else logits.new_zeros(labels.shape, dtype=torch.float32)
    return res.masked_fill(ignore, 0.0)


def entropy_from_logits(logits: Tensor, chunk_size: int = 8) -> Tensor:
    """Entropy of the softmax distribution at each position: ``[B, L, V]`` -> ``[B, L]`` (float32).

    ``logsumexp(l) - sum(softmax(l) * l)``, computed ``chunk_size`` rows at a time.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out = []
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start:start + chunk_size].float()
        out.append(torch.logsumexp(chunk, dim=-1) - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
    return torch.cat(out, dim=0) if out else logits.new_zeros(logits.shape[:-1], dtype=torch.float32)


# --------------------------------------------------------------------------- #
# Multi-turn helpers
# --------------------------------------------------------------------------- #
def broadcast_turn_values(turn_values: Tensor, turn_ids: Tensor) -> Tensor:
    """Spread per-turn values to tokens.

    Args:
        turn_values: ``[B, K]`` one value per turn.
        turn_ids: ``[B, T]`` long, turn index of each token, -1 for tokens
            that are not action tokens.

    Returns:
        ``[B, T]``: ``turn_values[b, turn_ids[b, t]]``, 0 where ``turn_ids == -1``.
    """
    ids = turn_ids.long()
    if ids.numel() and int(ids.max()) >= turn_values.shape[1]:
        raise ValueError(f"turn id {int(ids.max())} out of range for {turn_values.shape[1]} turns")
    out = torch.gather(turn_values, 1, ids.clamp(min=0))
    return torch.where(ids >= 0, out, torch.zeros_like(out))


def turn_values_from_tokens(
    token_values: Tensor, turn_ids: Tensor, num_turns: int, reduce: str = "last"
) -> Tensor:
    """Collapse per-token values to per-turn values: ``[B, T]`` -> ``[B, K]`` (``K = num_turns``).

    ``reduce="last"`` takes the value at the turn's last token (highest
    position), ``"mean"`` the mean over the turn's tokens.  Turns that do not
    occur in a row give 0; tokens with ``turn_id`` of -1 (or >= num_turns) are
    ignored.
    """
    if reduce not in ("last", "mean"):
        raise ValueError(f"reduce must be one of ('last', 'mean'), got {reduce!r}")
    B, T = token_values.shape
    ids = turn_ids.long()
    turns = torch.arange(num_turns, device=ids.device)
    member = ids.unsqueeze(-1) == turns  # [B, T, K]
    if reduce == "mean":
        vals = torch.where(member, token_values.unsqueeze(-1), torch.zeros((), dtype=token_values.dtype,
                                                                           device=token_values.device))
        count = member.sum(1).to(token_values.dtype)
        return vals.sum(1) / count.clamp(min=1)
    pos = torch.arange(T, device=ids.device).view(1, T, 1)
    last = torch.where(member, pos, torch.full_like(pos, -1)).amax(1)  # [B, K]
    out = torch.gather(token_values, 1, last.clamp(min=0))
    return torch.where(last >= 0, out, torch.zeros_like(out))
