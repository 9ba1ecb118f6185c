"""Greedy evaluation that runs the prompts' common prefix once per member.

Every member answers the same test prompts, and those prompts usually start alike: the chat
template's header, a system prompt, the fixed words of the user template. That common prefix is run
through the model ONCE per member (a member's LoRA changes its keys and values, so it cannot be
shared across members), and its cache is repeated for the member's rows. Each row is laid out as
``[common prefix | left padding | rest of the prompt]``: the padding is masked and the rest takes
positions ``k, k+1, ...`` (positions come from the attention mask), so every row attends to exactly
the keys and values it attends to in the plain left-padded layout, at the same positions. The
prompt part of the returned ids is the caller's own layout again.

:func:`common_prefix_length` decides (the prefix tokens this saves, times the model's parameters,
must reach :data:`~evollm.rollout.sampling.PREFILL_MIN_TOKEN_PARAMS`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .sampling import PREFILL_MIN_TOKEN_PARAMS, _model_defaults_hidden, cache_kwarg


def common_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Tokens every (left-padded) row starts with, leaving each row at least one token of its own."""
    lengths = attention_mask.sum(1)
    shortest = int(lengths.min())
    if shortest < 2:
        return 0
    width = input_ids.shape[1]
    starts = width - lengths
    first = input_ids[0, int(starts[0]):int(starts[0]) + shortest - 1]
    k = first.shape[0]
    for row, start in zip(input_ids, starts.tolist()):
        own = row[start:start + k]
        same = (own == first[:k]).long()
        k = int(same.cumprod(0).sum())
        if k == 0:
            return 0
    return k


def prefix_pays(model, rows: int, members: int, k: int) -> bool:
    """Whether running ``k`` prefix tokens once per member instead of once per row pays."""
    from .sampling import _PARAM_COUNTS

    if k < 2 or rows <= members:
        return False
    if model not in _PARAM_COUNTS:
        _PARAM_COUNTS[model] = sum(p.numel() for p in model.parameters())
    return (rows - members) * k * _PARAM_COUNTS[model] >= PREFILL_MIN_TOKEN_PARAMS


def prefix_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int, pad_token_id: int):
    """``(ids, mask)`` with each row as ``[prefix (k) | padding | rest]`` (same width)."""
    ids, mask = input_ids.clone(), attention_mask.clone()
    width = ids.shape[1]
    for i in range(ids.shape[0]):
        n = int(attention_mask[i].sum())
        start = width - n
        tokens = input_ids[i, start:]
        ids[i] = pad_token_id
        mask[i] = 0
        ids[i, :k], mask[i, :k] = tokens[:k], 1
        ids[i, start + k:], mask[i, start + k:] = tokens[k:], 1
    return ids, mask


@torch.no_grad()
def generate_with_common_prefix(model, route, counts: Sequence[int], input_ids: torch.Tensor,
                                attention_mask: torch.Tensor, k: int, generate_kwargs: dict,
                                pad_token_id: int) -> torch.Tensor:
    """Greedy ``generate`` of rows in member blocks (``counts``), the first ``k`` common tokens run once
    per member. ``route(counts)`` is a context manager routing rows to members (yields the model)."""
    device = next(model.parameters()).device
    ids, mask = input_ids.to(device), attention_mask.to(device)
    laid, laid_mask = prefix_layout(ids, mask, k, pad_token_id)
    first = torch.tensor([sum(counts[:i]) for i in range(len(counts))], device=device)
    with route([1] * len(counts)) as m, _model_defaults_hidden(m):
        out = m(input_ids=laid[first, :k], attention_mask=laid_mask[first, :k], use_cache=True)
    cache = out["cache"] if "cache" in out else out.past_key_values  # 5.2x name
    repeat = torch.tensor(list(counts), device=device)
    _repeat_rows(cache, repeat)
    with route(list(counts)) as m, _model_defaults_hidden(m):
        seqs = m.generate(input_ids=laid, attention_mask=laid_mask, **{cache_kwarg(m): cache}, **generate_kwargs)
    seqs = seqs.clone()
    seqs[:, :ids.shape[1]] = ids  # the caller's prompt layout
    return seqs


def _repeat_rows(cache, repeats: torch.Tensor) -> None:
    """Repeat row ``i`` of every layer's keys and values ``repeats[i]`` times (in place)."""
    if bool((repeats == repeats[0]).all()) and hasattr(cache, "batch_repeat_interleave"):
        cache.batch_repeat_interleave(int(repeats[0]))
        return
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(repeats, dim=0)
        layer.values = layer.values.repeat_interleave(repeats, dim=0)


def greedy_shared_prefix(shared, names: Sequence[str], counts: Sequence[int], input_ids: torch.Tensor,
                         attention_mask: torch.Tensor, sampling, pad_token_id: int, eos_token_id,
                         tokenizer=None) -> torch.Tensor | None:
    """Greedy completions of member blocks with their common prompt prefix run once per member, or
    ``None`` where that does not apply (sampling, several samples per prompt, adapters that cannot be
    routed) or does not pay (:func:`prefix_pays`). Same output as :func:`~evollm.rollout.sampling.generate`."""
    from ..adapters.routing import ROUTED, batch_path, routed

    if sampling.do_sample or sampling.num_return_sequences != 1 or sampling.extra:
        return None
    if len(names) == 1:
        def route(_counts):
            return shared.use(names[0])
    elif batch_path(shared, names) == ROUTED:
        def route(c):
            return routed(shared, names, c)
    else:
        return None
    k = common_prefix_length(input_ids, attention_mask)
    if not prefix_pays(shared.model, input_ids.shape[0], len(names), k):
        return None
    kwargs = dict(generation_config=sampling.generation_config(pad_token_id, eos_token_id))
    if sampling.stop_strings:
        kwargs["tokenizer"] = tokenizer
    out = generate_with_common_prefix(shared.model, route, counts, input_ids, attention_mask, k, kwargs, pad_token_id)
    width = input_ids.shape[1] + sampling.max_new_tokens
    if out.shape[1] < width:  # every row stopped early: pad to a fixed width
        out = torch.cat([out, out.new_full((out.shape[0], width - out.shape[1]), pad_token_id)], dim=1)
    return out
