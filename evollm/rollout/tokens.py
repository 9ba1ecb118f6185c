"""Token layout of a rollout: left-padded prompt batches, attention and action masks, and the
:class:`Rollout` one member's samples are handed over in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class Rollout:
    """One member's sampled completions for a batch of prompts."""

    sequences: torch.Tensor  # [P*G, L] prompt + completion ids
    attention_mask: torch.Tensor  # [P*G, L]
    action_mask: torch.Tensor  # [P*G, L-1] 1 on generated tokens (up to the first eos)
    prompt_len: int
    group_size: int
    #: [P*G, L-1] the sampling engine's log-prob of every generated token (vLLM backend; else None)
    sampler_logp: torch.Tensor | None = None

    def per_prompt(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        g = self.group_size
        n = self.sequences.shape[0] // g
        return ([self.sequences[i * g:(i + 1) * g] for i in range(n)],
                [self.action_mask[i * g:(i + 1) * g] for i in range(n)])


def collate_prompts(prompts: Sequence[dict], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad a list of prompt dicts (``input_ids`` of shape ``[1, L]`` or ``[L]``) into a batch."""
    rows = [torch.as_tensor(p["input_ids"]).reshape(-1) for p in prompts]
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():] = r
        mask[i, width - r.numel():] = 1
    return ids, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that start at 0 on the first real token of each left-padded row."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def action_mask_for(sequences: torch.Tensor, prompt_len: int, eos_token_id: int | Sequence[int] | None,
                    stop_ends: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, L-1]`` mask over log-prob positions: 1 where position ``t+1`` is a generated token,
    up to and including the first eos (ANY id of ``eos_token_id``, an id or a list) or the last
    token of the first stop string (``stop_ends[i]``: its index within row ``i``'s completion, -1
    for none); 0 on the prompt and on padding after the end."""
    n, length = sequences.shape
    generated = torch.zeros((n, length), dtype=torch.bool, device=sequences.device)
    generated[:, prompt_len:] = True
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    completion = sequences[:, prompt_len:]
    is_end = torch.zeros_like(completion, dtype=torch.bool)
    if ids:
        is_end |= torch.isin(completion, torch.tensor(ids, dtype=completion.dtype, device=completion.device))
    if stop_ends is not None:
        stop_ends = stop_ends.to(completion.device)
        rows = torch.nonzero(stop_ends >= 0).flatten()
        is_end[rows, stop_ends[rows]] = True
    # tokens strictly after the first end are padding
    after_end = (is_end.long().cumsum(-1) - is_end.long()) > 0
    generated[:, prompt_len:] &= ~after_end
    return generated[:, 1:].long()


def sequence_attention_mask(sequences: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """Prompt padding masked out, every completion position visible (padding after eos never
    influences an earlier position under causal attention)."""
    rows = sequences.shape[0]
    reps = rows // prompt_mask.shape[0]
    pm = prompt_mask.to(sequences.device).repeat_interleave(reps, dim=0)
    tail = torch.ones((rows, sequences.shape[1] - pm.shape[1]), dtype=pm.dtype, device=sequences.device)
    return torch.cat([pm, tail], dim=1)


def stack_rows(rows, pad_value: int) -> torch.Tensor:
    """Stack per-prompt tensors (or pass a tensor through), right-padding to a common width."""
    if torch.is_tensor(rows):
        return rows
    rows = [torch.as_tensor(r) for r in rows]
    rows = [r.unsqueeze(0) if r.dim() == 1 else r for r in rows]
    width = max(r.shape[1] for r in rows)
    padded = [torch.nn.functional.pad(r, (0, width - r.shape[1]), value=pad_value) for r in rows]
    return torch.cat(padded, dim=0)


def attention_from_sequences(seqs: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Recover the attention mask of left-padded prompt + completion rows: the leading pad run is
    masked, everything after the first real token is visible."""
    is_pad = seqs == pad_token_id
    leading_pad = is_pad.long().cumprod(dim=1).bool()
    return (~leading_pad).long()
