"""Shared-prompt loss forwards: each distinct prompt runs through the model once, and the rows that
continue it (a GRPO group's completions) run against its keys and values.

A loss forward needs logits only from the last prompt position on (``first``, see
:func:`evollm.rollout.first_target`). Rows whose first ``first`` tokens (and attention mask) are equal
share that prefix: it is computed once (with gradients where the loss needs them), its per-layer keys
and values are gathered to every row that continues it, and the rows' suffixes ``[first, L)`` attend
to them. Gathering is differentiable, so gradients reach the prefix through its keys and values; the
result equals the unshared forward up to float rounding (tests/rollout/test_shared_prompt.py).

The caches here never grow: the prefix pass records each layer's keys/values (overwriting, so a
checkpointed layer that is recomputed in backward records the same again) and the suffix pass reads
the gathered prefix and returns ``prefix + new`` without storing it. Both are therefore safe under
gradient checkpointing, where a layer's forward runs twice.

Only models whose attention is plain causal self-attention over a positional cache take this path
(:func:`shared_prompt_support`); others, and batches where sharing saves too little, use the plain
forward. Rows through different adapters (a routed forward's member blocks, ``blocks``) never share.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..adapters.shared import checkpointing

#: Model types whose decoder was checked to give the same log-probs and gradients through a shared prefix
#: (tests/rollout/test_shared_prompt.py): every layer plain causal attention over a positional cache.
SHARED_PROMPT_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
#: Attention kernels the shared suffix pass was checked with (left padding in the prefix included).
_ATTENTION = (None, "eager", "sdpa")
#: Share a prompt when the prompt tokens this saves, times the model's parameter count, reach this; below it
#: the extra forward call costs more than it saves (see benchmarks/README.md, "Shared-prompt loss forwards").
SHARED_MIN_TOKEN_PARAMS = 2e8
_PARAM_COUNTS: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()


class _RecordLayer(DynamicLayer):
    """Keeps the last keys/values a layer computed (overwrites: a recomputed layer records the same)."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _ReadLayer(DynamicLayer):
    """Returns ``prefix + new`` keys/values without storing them (a recomputed layer reads the same)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


class Plan(NamedTuple):
    """Which rows compute a prefix (``sources``, one per distinct prefix) and which prefix each row reads
    (``index`` into ``sources``)."""

    sources: torch.Tensor  # [U]
    index: torch.Tensor  # [B]


def prefix_plan(input_ids: torch.Tensor, attention_mask: torch.Tensor, first: int, blocks: int = 1) -> Plan | None:
    """The distinct prefixes ``[:, :first]`` (ids and mask) of each of ``blocks`` equal row blocks, padded to
    the same count per block (a routed forward needs equal blocks); None when no two rows share one."""
    rows = input_ids.shape[0]
    if first < 1 or blocks < 1 or rows % blocks:
        return None
    key = torch.cat([input_ids[:, :first], attention_mask[:, :first].to(input_ids.dtype)], 1).cpu()
    per = rows // blocks
    found = []
    for b in range(blocks):
        uniq, inv = torch.unique(key[b * per:(b + 1) * per], dim=0, return_inverse=True)
        src = torch.full((uniq.shape[0],), per, dtype=torch.long).scatter_reduce(0, inv, torch.arange(per), "amin")
        found.append((src, inv))
    width = max(src.numel() for src, _ in found)
    if width * blocks >= rows:
        return None
    sources, index = [], []
    for b, (src, inv) in enumerate(found):
        src = torch.cat([src, src[:1].expand(width - src.numel())])  # equal blocks: repeat a prefix
        sources.append(src + b * per)
        index.append(inv + b * width)
    return Plan(torch.cat(sources), torch.cat(index))


def worth_sharing(model, plan: Plan | None, first: int) -> bool:
    """Whether computing ``plan``'s prefixes once saves enough (see :data:`SHARED_MIN_TOKEN_PARAMS`)."""
    if plan is None:
        return False
    if model not in _PARAM_COUNTS:
        _PARAM_COUNTS[model] = sum(p.numel() for p in model.parameters())
    saved = (plan.index.numel() - plan.sources.numel()) * first
    return saved * _PARAM_COUNTS[model] >= SHARED_MIN_TOKEN_PARAMS


def _inner(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def shared_prompt_support(model) -> str | None:
    """None when ``model`` can take the shared-prompt forward, else a short reason why not."""
    inner = _inner(model)
    cfg = getattr(inner, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SHARED_PROMPT_MODEL_TYPES:
        return f"model type {kind!r} is not one of {list(SHARED_PROMPT_MODEL_TYPES)}"
    if getattr(cfg, "_attn_implementation", None) not in _ATTENTION:
        return f"attention kernel {cfg._attn_implementation!r}"
    sliding = getattr(cfg, "use_sliding_window", getattr(cfg, "sliding_window", None) is not None)
    if sliding or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return "sliding-window attention"
    get_decoder = getattr(inner, "get_decoder", None)
    if get_decoder is None or _cache_keyword(type(get_decoder())) is None:
        return "the decoder takes no cache"
    return None


def reentrant_checkpointing(model) -> bool:
    """Whether a layer of ``model`` recomputes in backward through reentrant checkpointing, which computes
    gradients only for the layer's inputs: the shared prefix's keys and values would get none (such a gradient
    forward falls back to the plain one; evollm enables checkpointing non-reentrant)."""
    if not checkpointing(_inner(model)):
        return False
    for m in _inner(model).modules():
        if getattr(m, "gradient_checkpointing", False) is True and m.training:
            keywords = getattr(getattr(m, "_gradient_checkpointing_func", None), "keywords", None) or {}
            if keywords.get("use_reentrant", True) is not False:
                return True
    return False


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls) -> str | None:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return None
    return "cache" if "cache" in params else ("past_key_values" if "past_key_values" in params else None)


@contextlib.contextmanager
def _layers_keep_cache(decoder):
    """Checkpointed layers keep the cache argument (transformers drops it by default because a growing cache
    would be updated twice; the caches here do not grow)."""
    layers = [m for m in decoder.modules() if hasattr(type(m), "_can_checkpoint_with_cache")]
    saved = [m.__dict__.get("_can_checkpoint_with_cache") for m in layers]
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m, s in zip(layers, saved):
            if s is None:
                del m._can_checkpoint_with_cache
            else:
                m._can_checkpoint_with_cache = s


def shared_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   first: int, plan: Plan, hidden: bool = False, head: bool = True):
    """``(logits, hidden)`` of positions ``[first, L)`` (``[B, L-first, V]``; the last hidden layer likewise
    with ``hidden``, else None), the prefix ``[:, :first]`` computed once per ``plan.sources`` row. Without
    ``head`` the output head does not run: ``(None, last hidden layer)``."""
    inner = _inner(model)
    decoder = inner.get_decoder()
    key = _cache_keyword(type(decoder))
    src = plan.sources.to(input_ids.device)
    index = plan.index.to(input_ids.device)
    record = Cache(layer_class_to_replicate=_RecordLayer)
    with _layers_keep_cache(decoder):
        decoder(input_ids=input_ids[src, :first], attention_mask=attention_mask[src, :first],
                position_ids=position_ids[src, :first], use_cache=False, **{key: record})
        past = Cache(layers=[_ReadLayer(layer.keys.index_select(0, index), layer.values.index_select(0, index))
                             for layer in record.layers])
        del record
        suffix = dict(input_ids=input_ids[:, first:], attention_mask=attention_mask,
                      position_ids=position_ids[:, first:], use_cache=False)
        if not head:
            return None, decoder(**suffix, **{key: past}).last_hidden_state
        out = model(**suffix, output_hidden_states=hidden, **{_cache_keyword(type(inner)) or key: past})
    return out.logits, (out.hidden_states[-1] if hidden else None)
