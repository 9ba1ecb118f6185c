"""Sampling: the settings of one ``generate`` call and the call itself (with the prompt
prefilled once per prompt when several samples are drawn from it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tokens import position_ids_from_mask


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
