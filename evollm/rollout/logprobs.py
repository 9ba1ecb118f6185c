"""Memory-bounded log-prob forwards for the loss: one member, a routed group of members, or the
reference policy (the shared base with every adapter disabled)."""

from __future__ import annotations

from typing import Sequence

import torch

from ..adapters.routing import routed
from ..functional import token_logprobs
from .tokens import position_ids_from_mask


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


def member_logprobs(shared, names: Sequence[str], seqs: torch.Tensor, attn: torch.Tensor, rows_each: int,
                    grad: bool, reference: bool = False, temperature: float = 1.0, chunk_rows: int | None = None,
                    logits_budget_mb: float = 256.0) -> torch.Tensor:
    """Log-probs of concatenated row blocks, block ``i`` (``rows_each`` rows) under adapter ``names[i]``
    of ``shared`` (or, with ``reference``, all of them under the base alone). Several members run as
    ONE routed forward; ``chunk_rows`` applies to a single member or the reference."""
    if reference:
        ctx = shared.reference()
    elif len(names) == 1:
        ctx = shared.use(names[0], train=grad)
    else:
        ctx = routed(shared, list(names), [rows_each] * len(names), differentiable=grad)
    chunk = chunk_rows if len(names) == 1 or reference else seqs.shape[0]
    with torch.set_grad_enabled(grad), ctx as model:
        if grad:
            model.train()
        return forward_logprobs(model, seqs, attn, temperature, chunk, logits_budget_mb=logits_budget_mb)
