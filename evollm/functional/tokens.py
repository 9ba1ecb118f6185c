"""Per-token log-probs and entropies from logits (chunked), and turn-level value plumbing."""
from __future__ import annotations

import torch
from torch import Tensor


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
