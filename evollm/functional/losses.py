"""Policy and value losses: the GRPO-family presets, k3 KL, clipped objectives, sampler correction."""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .masked import _valid, masked_mean, masked_sum


#: The loss variants of the GRPO family, each with the settings its paper (or TRL, where the
#: paper leaves them open) uses. ``clip_low``/``clip_high``: the ratio is clipped to
#: ``[1 - clip_low, 1 + clip_high]``; for ``cispo`` only the cap ``1 + clip_high`` on the
#: importance weight is used (4.0 gives TRL's cap of 5, its ``epsilon_high=5``).
#: ``scale_rewards``: divisor of the group-centred rewards (:func:`group_advantages`).
#: ``normalisation``: how per-token terms are reduced to the loss (``"sequence"``: mean over
#: sequences of each sequence's token mean; ``"token"``: sum over tokens / token count;
#: ``"constant"``: sum / (B * max_completion_length)). ``ratio``: ``"token"`` or one
#: ``"sequence"`` ratio (geometric mean of the token ratios). ``extras``: options that belong
#: to the variant but stay off unless asked for (:class:`~evollm.algorithms.grpo.GRPOConfig`).
#:
#: * grpo: DeepSeekMath's GRPO, ±0.2, group std scaling, sequence-mean normalisation.
#: * dr_grpo: "Understanding R1-Zero-like training": no std scaling, constant normaliser.
#: * dapo: clip-higher 0.2/0.28, token-level normalisation; dynamic sampling (drop groups whose
#:   rewards are all equal, refill the batch) and overlong reward shaping are its extras.
#: * gspo: sequence-level ratio with the GSPO paper's range 3e-4/4e-4.
#: * cispo: MiniMax-M1's clipped IS-weight objective, cap 5 as in TRL, token normalisation.
#:
#: ``bnpo`` is not offered: the Beta-normalisation method of its paper is not implemented, and
#: the token-mean loss that went by that name is ``dapo`` without clip-higher.
LOSS_PRESETS: Dict[str, Dict[str, object]] = {
    "grpo": {"clip_low": 0.2, "clip_high": 0.2, "scale_rewards": "group", "normalisation": "sequence",
             "ratio": "token", "extras": ()},
    "dr_grpo": {"clip_low": 0.2, "clip_high": 0.2, "scale_rewards": "none", "normalisation": "constant",
                "ratio": "token", "extras": ()},
    "dapo": {"clip_low": 0.2, "clip_high": 0.28, "scale_rewards": "group", "normalisation": "token",
             "ratio": "token", "extras": ("dynamic_sampling", "overlong_buffer", "overlong_penalty")},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "scale_rewards": "group", "normalisation": "sequence",
             "ratio": "sequence", "extras": ()},
    "cispo": {"clip_low": 0.2, "clip_high": 4.0, "scale_rewards": "group", "normalisation": "token",
              "ratio": "token", "extras": ()},
}
#: Valid values of ``loss_type`` for :func:`policy_loss`.
LOSS_TYPES: Tuple[str, ...] = tuple(LOSS_PRESETS)

#: The statistics :func:`sampler_importance_weights` returns (the learners log them as ``sampler_<name>``).
SAMPLER_STATS = ("logp_diff_mean", "logp_diff_max", "is_ratio_min", "is_ratio_mean", "is_ratio_max",
                 "is_corrected_fraction")
#: Valid values of ``mode`` for :func:`sampler_importance_weights` (TRL's ``vllm_importance_sampling_mode``).
SAMPLER_CORRECTIONS: Tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# --------------------------------------------------------------------------- #
# Policy / value losses
# --------------------------------------------------------------------------- #
def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Elementwise k3 KL estimator ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, 0 at equality).

    On tokens sampled from the policy (``logp``), its mean is an unbiased estimate of the REVERSE
    KL, ``KL(pi || ref) = E_pi[log pi - log ref]``: with ``d = ref - logp``, ``E_pi[exp(d)] = 1``, so
    ``E_pi[exp(d) - d - 1] = E_pi[-d]``. Its GRADIENT is not that of the reverse KL: used as a loss,
    ``grad k3 = (1 - exp(d)) grad logp = (1 - ref / pi) grad logp`` per sampled token, whose expectation
    under pi is ``sum_y (pi - ref) grad log pi = -sum_y ref grad log pi = grad KL(ref || pi)``: the
    gradient of the FORWARD KL. In a sequence this holds token by token: at each visited context the
    expected gradient is that of the forward KL between the two next-token distributions (the
    dependence of the visited contexts on pi is not differentiated). evollm, like the GRPO paper, TRL
    and AgileRL, adds k3 to the loss as is.
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def approx_kl(log_ratio: Tensor) -> Tensor:
    """Elementwise ``exp(r) - 1 - r`` of ``r = logp - old_logp`` (PPO's ``approx_kl``, >= 0, 0 at equality).

    On tokens sampled from the OLD policy its mean estimates ``KL(old || new)`` (the k3 estimator with
    the roles swapped); the update uses it to report, and with ``target_kl`` to limit, how far the
    policy moved from the one that sampled.
    """
    return torch.exp(log_ratio) - 1 - log_ratio


def policy_loss_with_stats(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logp: Optional[Tensor] = None,
    beta: float = 0.0,
    max_completion_length: Optional[int] = None,
    is_weights: Optional[Tensor] = None,
    token_count: Optional[float] = None,
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
        clip_low, clip_high: the clip offsets: the ratio is clipped to
            ``[lo, hi] = [1 - clip_low, 1 + clip_high]`` (``clip_high=inf``: no upper clip).
        ref_logp: ``[B, T]`` reference-model log-probs (needed when beta > 0).
        beta: weight of the per-token k3 KL penalty.
        max_completion_length: divisor length for ``dr_grpo``.
        is_weights: optional ``[B, T]`` sampler-correction weights (see
            :func:`sampler_importance_weights`, detached); the policy term of every
            token is multiplied by its weight before the KL penalty is added.
        token_count: the divisor of the token normalisation (dapo, cispo) in place of
            this batch's valid-token count. When a minibatch is split over processes
            whose gradients are averaged, the mean count per process makes that
            average the gradient of the token mean over the whole minibatch.

    Per-token term, with ratio ``rho = exp(logp - old_logp)`` (for ``gspo``
    one ratio per sequence, ``exp`` of the masked mean of ``logp - old_logp``,
    broadcast to its tokens):

    * grpo, gspo, dr_grpo, dapo: ``-min(rho*A, clip(rho, lo, hi)*A)``
    * cispo: ``-sg(min(rho, hi)) * A * logp`` (sg = stop-gradient)

    plus ``beta * k3_kl(logp, ref_logp)`` when ``beta > 0``.

    Reduction over valid tokens (``normalisation`` in :data:`LOSS_PRESETS`):

    * grpo, gspo: mean over the ``B`` sequences of each sequence's token mean;
      a sequence with no valid token contributes 0 (count clamped to 1) and
      still counts in the ``B`` divisor.
    * dapo, cispo: token sum / token count (0 if no valid tokens; ``token_count``
      when given).
    * dr_grpo: token sum / ``(B * max_completion_length)``.

    Returns:
        ``(loss, stats)``: scalar loss and a dict of Python floats:
        ``kl`` (masked token mean of k3, 0.0 without ``ref_logp``),
        ``approx_kl`` (masked token mean of :func:`approx_kl` of the token
        log-ratios: how far the policy moved from the sampling policy),
        ``clip_fraction`` (fraction of valid tokens where clipping changed
        the objective: for the min-clipped losses, ``A > 0 and rho > hi`` or
        ``A < 0 and rho < lo``, i.e. where the clipped term is the one strictly
        selected and the gradient is zero; for cispo, ``rho > hi``, i.e. the
        importance weight was truncated), and ``ratio_mean`` (masked token mean
        of ``rho``; the sequence ratio for gspo).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}"
                         + ("; 'bnpo' was removed (use 'dapo')" if loss_type == "bnpo" else ""))
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("is_weights", is_weights)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 requires ref_logp")
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length <= 0):
        raise ValueError("loss_type 'dr_grpo' requires a positive max_completion_length")
    if not (0.0 <= clip_low <= 1.0 and clip_high >= 0.0):
        raise ValueError(f"clip offsets must satisfy 0 <= clip_low <= 1 and clip_high >= 0, "
                         f"got ({clip_low}, {clip_high})")
    lo, hi = 1.0 - float(clip_low), 1.0 + float(clip_high)
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
    token_log_ratio = log_ratio.detach()
    preset = LOSS_PRESETS[loss_type]
    if preset["ratio"] == "sequence":
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

    if preset["normalisation"] == "sequence":
        loss = masked_mean(per_token, valid, dim=1).mean()
    elif preset["normalisation"] == "constant":
        loss = masked_sum(per_token, valid) / (B * max_completion_length)
    elif token_count is not None:
        loss = masked_sum(per_token, valid) / max(float(token_count), 1.0)
    else:
        loss = masked_mean(per_token, valid)

    with torch.no_grad():
        stats = {
            "kl": float(masked_mean(kl_tok, valid)) if kl_tok is not None else 0.0,
            "clip_fraction": float(masked_mean(clipped.to(logp.dtype), valid)),
            "ratio_mean": float(masked_mean(ratio, valid)),
            "approx_kl": float(masked_mean(approx_kl(token_log_ratio), valid)),
        }
    return loss, stats


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logp: Optional[Tensor] = None,
    beta: float = 0.0,
    max_completion_length: Optional[int] = None,
    is_weights: Optional[Tensor] = None,
) -> Tensor:
    """Scalar policy loss; see :func:`policy_loss_with_stats` for the semantics."""
    return policy_loss_with_stats(
        logp, old_logp, advantages, mask, loss_type=loss_type, clip_low=clip_low, clip_high=clip_high,
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
    count: Optional[float] = None,
) -> Tensor:
    """PPO value loss (without ``vf_coef``), masked mean over ``[B, T]`` cells.

    Per cell ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``,
    or ``0.5 * (V - R)^2`` when ``clip`` is None. ``count``: the divisor in place
    of the number of valid cells (see ``token_count`` of :func:`policy_loss_with_stats`).
    """
    returns = returns.detach()
    loss = (values - returns) ** 2
    if clip is not None:
        old = old_values.detach()
        v_clipped = torch.max(torch.min(values, old + clip), old - clip)
        loss = torch.max(loss, (v_clipped - returns) ** 2)
    if count is not None:
        return masked_sum(0.5 * loss, mask) / max(float(count), 1.0)
    return masked_mean(0.5 * loss, mask)
