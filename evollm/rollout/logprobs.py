"""Memory-bounded log-prob forwards for the loss: one member, a routed group of members, or the
reference policy (the shared base with every adapter disabled)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Sequence

import torch

from ..adapters.routing import ROUTED, batch_path, routed
from ..adapters.shared import checkpointing
from ..functional import entropy_from_logits, token_logprobs
from .prefix import Plan, prefix_plan, reentrant_checkpointing, shared_forward, shared_prompt_support, worth_sharing
from .tokens import position_ids_from_mask


def forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     temperature: float | torch.Tensor = 1.0, chunk_rows: int | None = None,
                     with_entropy: bool = False, logits_budget_mb: float = 256.0, start: int | None = None,
                     blocks: int = 1, info: dict | None = None, shared_prompt: bool | None = None):
    """Per-token log-probs ``[B, L-1]`` of ``input_ids[:, 1:]`` under ``model`` at ``temperature``
    (a float, or a ``[B]`` tensor: each row's own).

    ``start``: the first target position that matters (e.g. the prompt length, where the completion
    begins; :func:`first_target` reads it off an action mask). The output head and log-softmax then run
    only on positions ``>= start - 1`` (through the model's ``logits_to_keep`` where its forward takes
    it, else by slicing the logits) and the columns before ``start - 1`` are 0 (entropies too). Rows that
    share their tokens before ``start - 1`` (a group's prompt) compute them once (:func:`forward_logits`);
    ``blocks``: the rows are that many equal blocks, each through its own adapter (a routed forward),
    which never share; ``info["shared_prompt"]`` says (1.0/0.0) whether the prompts were shared.

    Rows are processed ``chunk_rows`` at a time so that at most ``[chunk_rows, L, V]`` logits
    exist at once; by default as many rows as fit ``logits_budget_mb`` of float32 logits (one row
    of a 150k-vocabulary model at 1k tokens is already 600 MB, so such models go row by row). Gradients flow when called with grad enabled. With ``with_entropy`` also
    returns the per-token entropy (detached) of the sampling distribution.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    device = next(model.parameters()).device
    first = min(max(int(start or 0) - 1, 0), input_ids.shape[1] - 1)  # first logits position needed
    keep = input_ids.shape[1] - first
    if blocks > 1:
        chunk_rows = input_ids.shape[0]  # each block through its own adapter: one pass
    elif chunk_rows is None:
        vocab = model.get_output_embeddings().weight.shape[0]
        row_bytes = 4 * keep * vocab
        chunk_rows = max(1, int(logits_budget_mb * 2**20 // row_bytes))
    outs, ents, shared = [], [], []
    for row in range(0, input_ids.shape[0], chunk_rows):
        ids = input_ids[row:row + chunk_rows].to(device)
        logits, _, used = forward_logits(model, ids, attention_mask[row:row + chunk_rows].to(device), first,
                                         blocks=blocks, shared_prompt=shared_prompt)
        shared.append(used)
        if isinstance(temperature, torch.Tensor):
            logits = logits / temperature[row:row + chunk_rows].to(logits.device, logits.dtype).view(-1, 1, 1)
        elif temperature != 1.0:
            logits = logits / temperature
        outs.append(token_logprobs(logits, ids[:, first + 1:]))
        if with_entropy:
            with torch.no_grad():
                lf = logits.detach().float()
                ents.append(torch.logsumexp(lf, -1) - (lf.softmax(-1) * lf).sum(-1))
        del logits
    if info is not None:
        info["shared_prompt"] = float(all(shared))
    logp = torch.nn.functional.pad(torch.cat(outs), (first, 0))
    return (logp, torch.nn.functional.pad(torch.cat(ents), (first, 0))) if with_entropy else logp


def forward_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, first: int, hidden: bool = False,
                   blocks: int = 1, shared_prompt: bool | None = None, head: bool = True):
    """``(logits, hidden, shared)``: the next-token logits of positions ``[first, L-1)`` (``[B, L-1-first, V]``,
    predicting ``input_ids[:, first+1:]``), with ``hidden`` the last hidden layer there (else None), and
    whether the rows' prefixes ``[:, :first]`` were computed once per distinct prefix (per block of
    ``blocks`` equal row blocks, each through its own adapter) and the rest run against their keys and
    values (:mod:`evollm.rollout.prefix`). ``shared_prompt``: None shares where the model supports it and
    it saves enough (:func:`~evollm.rollout.prefix.worth_sharing`), True wherever supported, False never.
    Without ``head`` (a critic) the output head does not run: logits are None and the hidden layer is
    returned. Gradients flow when called with grad enabled (into the shared prefix too)."""
    positions = position_ids_from_mask(attention_mask)
    plan = None
    if (first >= 1 and shared_prompt is not False and shared_prompt_support(model) is None
            and not (torch.is_grad_enabled() and reentrant_checkpointing(model))):
        if shared_prompt or worth_sharing(model, Plan(input_ids[:blocks, 0], input_ids[:, 0]), first):  # at most
            plan = prefix_plan(input_ids, attention_mask, first, blocks)  # this much saved: else skip the plan
        if plan is not None and not (shared_prompt or worth_sharing(model, plan, first)):
            plan = None
    if plan is not None:
        logits, states = shared_forward(model, input_ids, attention_mask, positions, first, plan, hidden or not head,
                                        head)
        return (logits[:, :-1] if head else None), (states[:, :-1] if hidden or not head else None), True
    if not head:
        decoder = (model.get_base_model() if hasattr(model, "get_base_model") else model).get_decoder()
        states = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                         use_cache=False).last_hidden_state
        return None, states[:, first:-1], False
    keep = input_ids.shape[1] - first
    extra = {"logits_to_keep": keep} if first and _takes_logits_to_keep(model) else {}
    with _contiguous_head_input(model, bool(extra)):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                    output_hidden_states=hidden, **extra)
    return out.logits[:, -keep:-1], (out.hidden_states[-1][:, first:-1] if hidden else None), False


def policy_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, first: int,
                   temperature: float = 1.0, entropy_grad: bool = False, hidden: bool = False, blocks: int = 1,
                   info: dict | None = None, shared_prompt: bool | None = None):
    """``(logp, entropy, hidden)`` for a policy loss, all ``[B, L-1(, H)]`` with zeros before column ``first``
    (the first action column: the logits, the output head and the log-softmax run only from there on, the
    prompt once per group, see :func:`forward_logits`): per-token log-probs of ``input_ids[:, 1:]`` at
    ``temperature``, per-token entropies (with gradients only with ``entropy_grad``) and, with ``hidden``,
    the last hidden layer (else None). ``info["shared_prompt"]``: 1.0 when the prompts were shared."""
    first = max(int(first), 0)
    logits, states, used = forward_logits(model, input_ids, attention_mask, first, hidden, blocks, shared_prompt)
    if info is not None:
        info["shared_prompt"] = float(used)
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, input_ids[:, first + 1:])
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logits(logits)
    del logits
    pad = torch.nn.functional.pad
    return (pad(logp, (first, 0)), pad(entropy, (first, 0)),
            pad(states, (0, 0, first, 0)) if hidden else None)


def action_start(action_mask: torch.Tensor) -> int:
    """The first column any row of ``action_mask`` (``[B, L-1]``) scores (0 when none does): the ``first``
    of :func:`forward_logits` / :func:`policy_forward`."""
    return max(first_target(action_mask) - 1, 0)


@contextlib.contextmanager
def _contiguous_head_input(model, active: bool):
    """While ``active``, the output head gets a contiguous input: ``logits_to_keep`` hands it a slice of the
    hidden states, on which a CPU matmul with a 49k-row head measured 3x slower (forward and backward)."""
    head = model.get_output_embeddings() if active else None
    handle = head.register_forward_pre_hook(_make_contiguous) if head is not None else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def _make_contiguous(module, args):
    return (args[0].contiguous(), *args[1:]) if args and not args[0].is_contiguous() else None


def first_target(action_mask: torch.Tensor) -> int:
    """The ``start`` for :func:`forward_logprobs` from an action mask ``[B, L-1]``: one past the first
    column any row scores (every earlier column is masked out in all rows); 0 for an empty mask."""
    cols = action_mask.reshape(-1, action_mask.shape[-1]).ne(0).any(0).nonzero()
    return int(cols[0]) + 1 if cols.numel() else 0


def _takes_logits_to_keep(model) -> bool:
    """Whether the (PEFT-wrapped) model's forward computes logits only for the last ``logits_to_keep``
    positions (transformers' causal LMs do)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _forward_takes(type(inner))


@functools.lru_cache(maxsize=None)
def _forward_takes(cls) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


@contextlib.contextmanager
def _checkpointing(model, keep: bool, suppress: bool = False):
    """``keep``: in eval mode, flag the gradient-checkpointing layers (themselves, not their children)
    as training, so checkpointing still runs while every dropout stays off. ``suppress``: no
    checkpointing (a checkpointed segment is recomputed during backward, after the context that
    selected the member's adapter has been left)."""
    layers = []
    if (keep or suppress) and checkpointing(model):
        layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    saved = [(m, m.training) for m in layers]
    for m in layers:
        if suppress:
            m.gradient_checkpointing = False
        else:
            m.training = True
    try:
        yield
    finally:
        for m, training in saved:
            m.gradient_checkpointing, m.training = True, training


@contextlib.contextmanager
def loss_forward(shared, name: str, grad: bool = True, disable_dropout: bool = True,
                 suppress_checkpointing: bool = False):
    """Run the shared model as member ``name`` for a forward that feeds a loss.

    With ``disable_dropout`` (the default everywhere) the model runs in eval mode, so LoRA dropout
    and the base model's own dropout (attention, hidden, embedding) are off and the loss scores
    exactly the policy that sampled; gradients flow all the same. Layers that use gradient
    checkpointing are flagged as training on their own (not their children), so checkpointing
    still runs (unless ``suppress_checkpointing``: needed when the backward runs after another
    member's adapter was selected). Without ``disable_dropout`` a gradient forward runs in train mode
    (dropout on)."""
    with shared.use(name, train=grad and not disable_dropout) as model, \
            _checkpointing(model, keep=grad and disable_dropout, suppress=suppress_checkpointing):
        yield model


def member_logprobs(shared, names: Sequence[str], seqs: torch.Tensor, attn: torch.Tensor, rows_each: int,
                    grad: bool, reference: bool = False, temperature: float | Sequence[float] = 1.0,
                    chunk_rows: int | None = None, logits_budget_mb: float = 256.0,
                    disable_dropout: bool = True, start: int | None = None, with_entropy: bool = False,
                    info: dict | None = None, shared_prompt: bool | None = None):
    """Log-probs of concatenated row blocks, block ``i`` (``rows_each`` rows) under adapter ``names[i]``
    of ``shared`` (or, with ``reference``, all of them under the base alone), with dropout off unless
    ``disable_dropout`` is False (see :func:`loss_forward`). ``temperature`` is one value or one per
    block (each member scores at its own sampling temperature); ``start`` and ``with_entropy`` (also return
    the per-token entropy of the scored distribution, detached) as in :func:`forward_logprobs`.

    Several members run as ONE routed forward when their adapters are routed exactly and dropout
    is off; otherwise (DoRA, or dropout on) each block runs through PEFT's own forward in turn.
    ``chunk_rows`` applies to a single member or the reference. Each block's rows that share a prompt
    compute it once (the reference: all rows, whichever block); ``info["shared_prompt"]`` says whether they
    did (see :func:`forward_logprobs`, ``shared_prompt`` as there)."""
    temps = [float(temperature)] * len(names) if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
    if len(set(temps)) == 1:
        temperature = temps[0]
    else:
        temperature = torch.tensor(temps).repeat_interleave(rows_each)
    if reference:
        with torch.set_grad_enabled(grad), shared.reference() as model:
            return forward_logprobs(model, seqs, attn, temperature, chunk_rows, with_entropy,
                                    logits_budget_mb=logits_budget_mb, start=start, info=info,
                                    shared_prompt=shared_prompt)
    if len(names) > 1 and (batch_path(shared, names) != ROUTED or (grad and not disable_dropout)):
        out, parts = [], []  # one member at a time through PEFT's own forward (no checkpointing: one backward later)
        for i, name in enumerate(names):
            rows = slice(i * rows_each, (i + 1) * rows_each)
            parts.append({})
            with torch.set_grad_enabled(grad), loss_forward(shared, name, grad, disable_dropout, True) as model:
                out.append(forward_logprobs(model, seqs[rows], attn[rows], temps[i], chunk_rows, with_entropy,
                                            logits_budget_mb=logits_budget_mb, start=start, info=parts[-1],
                                            shared_prompt=shared_prompt))
        if info is not None:
            info["shared_prompt"] = min(p["shared_prompt"] for p in parts)
        if grad:  # selecting the next member froze the previous one's tensors in PEFT; the backward needs them
            for name in names:
                for p in shared.parameters(name):
                    p.requires_grad_(True)
        return tuple(torch.cat(cols) for cols in zip(*out)) if with_entropy else torch.cat(out)
    if len(names) == 1:
        ctx = loss_forward(shared, names[0], grad, disable_dropout)
        chunk = chunk_rows
    else:
        ctx = routed(shared, list(names), [rows_each] * len(names), differentiable=grad)
        chunk = seqs.shape[0]
    with torch.set_grad_enabled(grad), ctx as model:
        if len(names) > 1 and grad and (model.training or checkpointing(model)):
            model.eval()  # dropout off (routing never applies LoRA dropout), and no checkpointing (the backward
            # runs after the routing hooks are gone); each eval() walks every module, so only when needed
        return forward_logprobs(model, seqs, attn, temperature, chunk, with_entropy, logits_budget_mb=logits_budget_mb,
                                start=start, blocks=len(names), info=info, shared_prompt=shared_prompt)
