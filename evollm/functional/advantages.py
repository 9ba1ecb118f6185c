"""Advantages and returns: group-relative (GRPO family), GAE (with the bootstrap of truncated episodes),
ReBN; DAPO's reward extras; the critic's explained variance."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .masked import Reduce, _masked_std, _valid, masked_whiten


#: Valid values of ``scale`` for :func:`group_advantages`.
ADVANTAGE_SCALES: Tuple[str, ...] = ("group", "batch", "none")


# --------------------------------------------------------------------------- #
# Advantages
# --------------------------------------------------------------------------- #
def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
                     reduce: Optional[Reduce] = None) -> Tensor:
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
        reduce: with ``scale="batch"``, the batch is split over processes (``rewards`` is this
            process's share) and ``std_batch`` is that of the whole batch (see
            :func:`~evollm.functional.masked.masked_whiten`).

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
        std = _masked_std(r, torch.ones_like(r, dtype=torch.bool), reduce)[1]
    return centred / (std + eps)


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to each completion's reward.

    With ``L`` the completion length, ``L_max = max_length`` and ``L_cache = buffer``:
    ``0`` for ``L <= L_max - L_cache``, ``penalty * (L_max - L_cache - L) / L_cache`` inside the
    buffer (falling linearly to ``-penalty`` at ``L_max``), ``-penalty`` beyond ``L_max``.
    ``buffer = 0`` turns it off (all zeros).
    """
    lengths = lengths.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_length:
        raise ValueError(f"overlong buffer ({buffer}) must be <= max_length ({max_length})")
    start = max_length - buffer
    inside = (start - lengths) / buffer
    out = torch.where(lengths <= start, torch.zeros_like(lengths), inside)
    return penalty * torch.where(lengths > max_length, torch.full_like(lengths, -1.0), out)


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """``[B*G]`` rewards -> ``[B]`` bool: groups whose rewards are not all equal.

    A group with zero reward spread has zero advantages and gives no policy gradient; DAPO's dynamic
    sampling drops such groups and refills the batch.
    """
    grouped = rewards.reshape(-1, group_size)
    return grouped.max(dim=1).values != grouped.min(dim=1).values


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


def rebn(rewards: Tensor, mask: Tensor, gamma: float, eps: float = 1e-8, reduce: Optional[Reduce] = None) -> Tensor:
    """REINFORCE with batch-normalised returns.

    Computes ``G_t = r_t + gamma * G_{t+1}`` within each row's played positions
    (``rewards``/``mask`` ``[B, T]``), then z-scores over all valid
    (sample, position) cells of the batch: ``(G - mean) / (std + eps)`` with
    the unbiased std (0 when there is a single valid cell).  Returns
    ``[B, T]``, 0 where the mask is 0. With ``reduce`` (see
    :func:`~evollm.functional.masked.masked_whiten`) the batch is split over
    processes and the z-score is over all of it.
    """
    valid = _valid(mask)
    r = rewards if rewards.is_floating_point() else rewards.float()
    return masked_whiten(_discounted_returns(r, valid, gamma), valid, eps=eps, reduce=reduce)


def truncation_bootstrap(token_values: Tensor, action_mask: Tensor, truncated: Optional[Tensor]) -> Tensor:
    """The ``last_values`` of :func:`gae` for episodes that may have been cut short.

    Args:
        token_values: ``[B, T]`` critic values, position ``t`` the value of the prefix ``ids[:, :t+1]`` (the
            state from which ``ids[:, t+1]`` is generated).
        action_mask: ``[B, T]``, 1 where ``ids[:, t+1]`` is the model's token.
        truncated: ``[B]`` bool (None: none were): the episode ended because a turn limit or the context
            length cut it, not because the environment ended it.

    Returns ``[B]``: for a truncated episode the value of the conversation through its last action token
    (``token_values[b, t_last + 1]``: the batch needs a column after it, e.g. one of right padding), else 0
    (terminal). Rows without an action token give 0.
    """
    B = token_values.shape[0]
    zero = torch.zeros(B, dtype=token_values.dtype, device=token_values.device)
    if truncated is None:
        return zero
    valid = _valid(action_mask)
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(1)
    keep = truncated.to(torch.bool).reshape(B).to(last.device) & (last >= 0)
    if bool((keep & (last + 1 >= token_values.shape[1])).any()):
        raise ValueError("a truncated episode's last action token is in the last column: its bootstrap value needs "
                         "one column after it (right-pad the batch)")
    value = token_values.gather(1, (last + 1).clamp(min=0, max=token_values.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return torch.where(keep, value, zero)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over valid cells (unbiased variances; NaN when fewer than two cells or
    the returns do not vary): 1 for a perfect critic, 0 for one that predicts the mean, < 0 worse."""
    m = _valid(mask)
    r, v = returns[m].float(), values[m].float()
    if r.numel() < 2 or float(r.var()) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var() / r.var())
