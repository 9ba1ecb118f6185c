"""Sampling: the settings of one ``generate`` call, owned by evollm, and the call itself (with
the prompt prefilled once per prompt when several samples are drawn from it).

The policy contract: the loss scores tokens with ``log_softmax(logits / temperature)``, so that is
the distribution ``generate`` samples from. Every call builds a fresh
:class:`transformers.GenerationConfig` and, for the duration of the call, hides the model's own
``generation_config``: transformers would otherwise fill every field evollm leaves unset from it
(``repetition_penalty``, ``min_p``, ``no_repeat_ngram_size``, ``typical_p``, epsilon/eta cutoffs,
bad words, forced or suppressed tokens, ``min_new_tokens``, and ``top_k=50`` by default).

``top_k`` / ``top_p`` and any other ``GenerationConfig`` field (``SamplingConfig.extra``) are an
explicit opt-in: they truncate or reshape the sampled distribution, which the loss does not model,
and evollm warns once per distinct setting naming them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StopStringCriteria

from .tokens import position_ids_from_mask

@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_cls: type) -> str:
    """The keyword under which ``generate`` of ``model_cls`` takes a prefilled cache: ``cache`` where the
    model's ``prepare_inputs_for_generation`` names it (transformers 5.2x), else ``past_key_values``
    (which newer versions still accept, with a deprecation warning)."""
    params = inspect.signature(model_cls.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_kwarg(type(base))

#: GenerationConfig fields evollm sets itself; ``extra`` may not override them
OWNED_FIELDS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "num_return_sequences",
                "eos_token_id", "pad_token_id", "stop_strings")
_WARNED: set = set()


@dataclass(frozen=True)
class SamplingConfig:
    """What ``generate`` needs; members with equal configs share one batched call.

    Args:
        max_new_tokens: Most tokens sampled per completion.
        temperature: Sampling temperature; the loss scores ``log_softmax(logits / temperature)``.
        top_p: Nucleus truncation; ``1.0`` (off) keeps the sampled policy equal to the trained one.
            Below 1 it is an opt-in that warns (the loss does not model the truncation).
        top_k: Top-k truncation; ``0`` (off) as for ``top_p``.
        do_sample: Sample (training) or greedy (evaluation).
        num_return_sequences: Samples per prompt.
        stop_strings: Strings that end a completion (as an eos would); needs a tokenizer.
        extra: Other ``GenerationConfig`` fields as ``(name, value)`` pairs (e.g.
            ``(("repetition_penalty", 1.1),)``): an opt-in that warns, the loss does not model them.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    num_return_sequences: int = 1
    stop_strings: tuple[str, ...] = ()
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        check_extra(dict(self.extra))

    def unmodelled(self) -> list[str]:
        """Settings that make the sampled distribution differ from ``softmax(logits / temperature)``."""
        out = [f"{k}={v!r}" for k, v in self.extra]
        if self.do_sample and self.top_p < 1.0:
            out.insert(0, f"top_p={self.top_p}")
        if self.do_sample and self.top_k:
            out.insert(0, f"top_k={self.top_k}")
        return out

    def generation_config(self, pad_token_id: int, eos_token_id: int | Sequence[int] | None) -> GenerationConfig:
        """A fresh ``GenerationConfig`` holding only what evollm decides (plus the opt-in ``extra``)."""
        kw: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens, do_sample=self.do_sample, num_return_sequences=1,
                                  pad_token_id=pad_token_id, eos_token_id=eos_ids(eos_token_id) or None,
                                  min_new_tokens=0, use_cache=True)
        if self.do_sample:
            kw.update(temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p))
        if self.stop_strings:
            kw["stop_strings"] = list(self.stop_strings)
        kw.update({k: _thawed(v) for k, v in self.extra})
        return GenerationConfig(**kw)


class RowTemperature(LogitsProcessor):
    """Divides each row's logits by that row's own temperature, so members that differ only in
    temperature share one ``generate`` call (each row still samples ``softmax(logits / T_row)``)."""

    def __init__(self, temperatures: torch.Tensor):
        self.temperatures = temperatures.float()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        t = self.temperatures.to(scores.device)
        if t.shape[0] != scores.shape[0]:
            raise ValueError(f"{t.shape[0]} row temperatures for {scores.shape[0]} rows")
        return scores / t.to(scores.dtype).unsqueeze(1)


def shares_rows(sampling: SamplingConfig) -> bool:
    """Whether members with this setting may share a ``generate`` call with members whose temperature
    differs (per-row temperature): only when temperature is the one transform of the logits (no top-k,
    top-p or other opt-in processors, whose order relative to the temperature would matter)."""
    return sampling.do_sample and not sampling.unmodelled()


def _thawed(value):
    return [_thawed(v) for v in value] if isinstance(value, tuple) else value


def check_extra(extra: dict) -> None:
    """One-line ``ValueError`` for an opt-in generation setting that is unknown or owned by evollm."""
    known = set(GenerationConfig().to_dict())
    for name in extra:
        if name in OWNED_FIELDS:
            raise ValueError(f"generation setting {name!r} is set by evollm; use the member's own field instead")
        if name not in known:
            raise ValueError(f"generation setting {name!r} is not a transformers GenerationConfig field")


def eos_ids(eos_token_id) -> list[int]:
    """``eos_token_id`` (an id, a list of ids, or None) as a list of distinct ids, in order."""
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


@contextlib.contextmanager
def _model_defaults_hidden(model):
    """Within this context the model's own ``generation_config`` is a blank one, so ``generate``
    takes nothing from it (transformers fills every unset field from the model's config)."""
    holders = [m for m in (model, getattr(model, "get_base_model", lambda: None)()) if m is not None
               and isinstance(getattr(m, "generation_config", None), GenerationConfig)]
    saved = [(m, m.__dict__.get("generation_config")) for m in holders if "generation_config" in m.__dict__]
    for m, _ in saved:
        m.generation_config = GenerationConfig()
    try:
        yield
    finally:
        for m, config in saved:
            m.generation_config = config


def _warn_unmodelled(sampling: SamplingConfig) -> None:
    names = sampling.unmodelled()
    key = tuple(names)
    if names and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"sampling with {', '.join(names)}: the loss scores log_softmax(logits / temperature), so the "
                      f"sampled policy is not the trained one (biased importance ratios and KL)", stacklevel=3)


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
             pad_token_id: int, eos_token_id: int | Sequence[int] | None, share_prefix: bool | None = None,
             tokenizer=None, return_scores: bool = False, row_temperatures: torch.Tensor | None = None):
    """One ``generate`` call; returns prompt + completion ids ``[rows * num_return_sequences, L]``
    (``L = prompt + max_new_tokens``, padded with ``pad_token_id`` after a row ends).

    Generation stops at ANY id of ``eos_token_id`` (an id or a list) and at ``sampling.stop_strings``
    (which need ``tokenizer``). With several samples per prompt the prompt is run through the model
    ONCE per prompt and its KV cache repeated for the samples (``share_prefix``); by default (``None``)
    only where that pays (:func:`prefill_pays`); the samples are the same either way. With
    ``return_scores`` also returns the log-probs ``[rows, new_tokens, V]`` of the distribution each
    token was drawn from (for checks and importance corrections). ``row_temperatures`` (one per input
    row) replaces ``sampling.temperature`` row by row (see :func:`shares_rows`).
    """
    if sampling.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer; pass tokenizer= to the member")
    _warn_unmodelled(sampling)
    device = next(model.parameters()).device
    ids, mask = input_ids.to(device), attention_mask.to(device)
    reps = sampling.num_return_sequences
    config = sampling.generation_config(pad_token_id, eos_token_id)
    kwargs: dict[str, Any] = dict(generation_config=config)
    if tokenizer is not None and sampling.stop_strings:
        kwargs["tokenizer"] = tokenizer
    if return_scores:
        config.output_scores = config.return_dict_in_generate = True
    if row_temperatures is not None:
        if not shares_rows(sampling):
            raise ValueError("row_temperatures need plain sampling (no top_k, top_p or extra generation settings)")
        config.temperature = 1.0  # no TemperatureLogitsWarper: RowTemperature applies each row's own
        kwargs["logits_processor"] = LogitsProcessorList(
            [RowTemperature(torch.as_tensor(row_temperatures, dtype=torch.float32).repeat_interleave(reps))])
    if share_prefix is None:
        share_prefix = prefill_pays(model, ids.shape[0], ids.shape[1], reps)
    rows_ids, rows_mask = ids.repeat_interleave(reps, 0), mask.repeat_interleave(reps, 0)
    with _model_defaults_hidden(model):
        if reps > 1 and share_prefix and ids.shape[1] > 1:
            prefix = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                           position_ids=position_ids_from_mask(mask[:, :-1]), use_cache=True)
            cache = prefix["cache"] if "cache" in prefix else prefix.past_key_values  # 5.2x name
            cache.batch_repeat_interleave(reps)
            kwargs[cache_kwarg(model)] = cache
        out = model.generate(input_ids=rows_ids, attention_mask=rows_mask, **kwargs)
    scores = None
    if return_scores:
        scores = torch.stack(out.scores, 1).float().log_softmax(-1)
        out = out.sequences
    width = input_ids.shape[1] + sampling.max_new_tokens
    if out.shape[1] < width:  # every row stopped early: pad to a fixed width
        pad = torch.full((out.shape[0], width - out.shape[1]), pad_token_id, dtype=out.dtype, device=out.device)
        out = torch.cat([out, pad], dim=1)
    return (out, scores) if return_scores else out


def stop_string_ends(sequences: torch.Tensor, prompt_len: int, tokenizer, stop_strings: Sequence[str]) -> torch.Tensor:
    """``[N]`` index (within the completion) of the token that completes the first stop string of each
    row, or ``-1`` when none occurs. Uses transformers' own ``StopStringCriteria``."""
    ends = torch.full((sequences.shape[0],), -1, dtype=torch.long)
    if not stop_strings:
        return ends
    criteria = StopStringCriteria(tokenizer, list(stop_strings))
    for t in range(prompt_len + 1, sequences.shape[1] + 1):
        hit = criteria(sequences[:, :t], None).cpu() & (ends < 0)
        ends[hit] = t - 1 - prompt_len
        if bool((ends >= 0).all()):
            break
    return ends
