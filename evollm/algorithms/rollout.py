"""Token-level plumbing shared by every algorithm: collating prompts, sampling
completions on the shared base, masks, and memory-bounded log-probs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..functional import token_logprobs


@dataclass(frozen=True)
class SamplingConfig:
    """What ``generate`` needs; members with equal configs can share one batched call."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    num_return_sequences: int = 1

    def generate_kwargs(self) -> dict:
        kw = dict(max_new_tokens=self.max_new_tokens, do_sample=self.do_sample)
        if self.do_sample:
            kw.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        return kw


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


def action_mask_for(sequences: torch.Tensor, prompt_len: int, eos_token_id: int | None) -> torch.Tensor:
    """``[N, L-1]`` mask over log-prob positions: 1 where position ``t+1`` is a generated token,
    up to and including the first eos; 0 on the prompt and on padding after eos."""
    n, length = sequences.shape
    generated = torch.zeros((n, length), dtype=torch.bool, device=sequences.device)
    generated[:, prompt_len:] = True
    if eos_token_id is not None:
        completion = sequences[:, prompt_len:]
        is_eos = completion == eos_token_id
        # tokens strictly after the first eos are padding
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        generated[:, prompt_len:] &= ~after_eos
    return generated[:, 1:].long()


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingConfig,
             pad_token_id: int, eos_token_id: int | None, share_prefix: bool = True) -> torch.Tensor:
    """One ``generate`` call; returns prompt + completion ids ``[rows * num_return_sequences, L]``.

    With several samples per prompt the prompt is run through the model ONCE per prompt and its
    KV cache repeated for the samples (``share_prefix``), instead of once per sample.
    """
    device = next(model.parameters()).device
    ids, mask = input_ids.to(device), attention_mask.to(device)
    reps = sampling.num_return_sequences
    kwargs = dict(pad_token_id=pad_token_id, eos_token_id=eos_token_id, **sampling.generate_kwargs())
    if reps > 1 and share_prefix and ids.shape[1] > 1:
        prefix = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                       position_ids=position_ids_from_mask(mask[:, :-1]), use_cache=True)
        cache = prefix.past_key_values
        cache.batch_repeat_interleave(reps)
        out = model.generate(input_ids=ids.repeat_interleave(reps, 0), attention_mask=mask.repeat_interleave(reps, 0),
                             past_key_values=cache, num_return_sequences=1, **kwargs)
    else:
        out = model.generate(input_ids=ids, attention_mask=mask, num_return_sequences=reps, **kwargs)
    width = input_ids.shape[1] + sampling.max_new_tokens
    if out.shape[1] < width:  # every row stopped early: pad to a fixed width
        pad = torch.full((out.shape[0], width - out.shape[1]), pad_token_id, dtype=out.dtype, device=out.device)
        out = torch.cat([out, pad], dim=1)
    return out


def sequence_attention_mask(sequences: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """Prompt padding masked out, every completion position visible (padding after eos never
    influences an earlier position under causal attention)."""
    rows = sequences.shape[0]
    reps = rows // prompt_mask.shape[0]
    pm = prompt_mask.to(sequences.device).repeat_interleave(reps, dim=0)
    tail = torch.ones((rows, sequences.shape[1] - pm.shape[1]), dtype=pm.dtype, device=sequences.device)
    return torch.cat([pm, tail], dim=1)


def forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     temperature: float = 1.0, chunk_rows: int | None = None, with_entropy: bool = False,
                     logits_budget_mb: float = 256.0):
    """Per-token log-probs ``[B, L-1]`` of ``input_ids[:, 1:]`` under ``model``.

    Rows are processed ``chunk_rows`` at a time so that at most ``[chunk_rows, L, V]`` logits
    exist at once; by default as many rows as fit ``logits_budget_mb`` of float32 logits (one row
    of a 150k-vocabulary model at 1k tokens is already 600 MB, so such models go row by row). Gradients flow when called with grad enabled. With ``with_entropy`` also
    returns the per-token entropy (detached) of the sampling distribution.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    device = next(model.parameters()).device
    if chunk_rows is None:
        vocab = model.get_output_embeddings().weight.shape[0]
        row_bytes = 4 * input_ids.shape[1] * vocab
        chunk_rows = max(1, int(logits_budget_mb * 2**20 // row_bytes))
    outs, ents = [], []
    for start in range(0, input_ids.shape[0], chunk_rows):
        ids = input_ids[start:start + chunk_rows].to(device)
        am = attention_mask[start:start + chunk_rows].to(device)
        logits = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am),
                       use_cache=False).logits[:, :-1]
        if temperature != 1.0:
            logits = logits / temperature
        outs.append(token_logprobs(logits, ids[:, 1:]))
        if with_entropy:
            with torch.no_grad():
                lf = logits.detach().float()
                ents.append(torch.logsumexp(lf, -1) - (lf.softmax(-1) * lf).sum(-1))
        del logits
    logp = torch.cat(outs)
    return (logp, torch.cat(ents)) if with_entropy else logp
