"""Sampling: the settings of one ``generate`` call and the call itself (with the prompt
prefilled once per prompt when several samples are drawn from it)."""

from __future__ import annotations

import weakref
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


#: Prefill the prompt once and share its KV cache when the prompt tokens this saves, times the
#: model's parameter count, reach this: below it the extra forward costs more than it saves
#: (measured on 1.2M and 28M-parameter Llamas, CPU: break-even near 150 saved tokens at 1.2M;
#: 60 saved tokens already pay at 28M). See benchmarks/README.md, "Shared-prompt prefill".
PREFILL_MIN_TOKEN_PARAMS = 2e8
_PARAM_COUNTS: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()


def prefill_pays(model, rows: int, prompt_len: int, reps: int) -> bool:
    """Whether prefilling ``rows`` prompts once (instead of once per each of ``reps`` samples) pays."""
    if reps < 2 or prompt_len < 2:
        return False
    if model not in _PARAM_COUNTS:
        _PARAM_COUNTS[model] = sum(p.numel() for p in model.parameters())
    return (reps - 1) * rows * (prompt_len - 1) * _PARAM_COUNTS[model] >= PREFILL_MIN_TOKEN_PARAMS


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingConfig,
             pad_token_id: int, eos_token_id: int | None, share_prefix: bool | None = None) -> torch.Tensor:
    """One ``generate`` call; returns prompt + completion ids ``[rows * num_return_sequences, L]``.

    With several samples per prompt the prompt can be run through the model ONCE per prompt and its
    KV cache repeated for the samples (``share_prefix``), instead of once per sample; by default
    (``None``) only where that pays (:func:`prefill_pays`). The samples are the same either way.
    """
    device = next(model.parameters()).device
    ids, mask = input_ids.to(device), attention_mask.to(device)
    reps = sampling.num_return_sequences
    kwargs = dict(pad_token_id=pad_token_id, eos_token_id=eos_token_id, **sampling.generate_kwargs())
    if share_prefix is None:
        share_prefix = prefill_pays(model, ids.shape[0], ids.shape[1], reps)
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
