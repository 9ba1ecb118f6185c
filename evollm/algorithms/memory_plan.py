"""How members are grouped into fused learn passes under a memory budget.

A fused pass runs several members' minibatches as ONE routed forward and backward over the shared
base; its activations grow with the number of members in it. :func:`member_chunks` decides, from an
estimate of a member's activations (:func:`activation_bytes_per_token`) against its persistent state
and the ``logits_budget_mb`` / ``learn_chunk_members`` / ``logprob_chunk_rows`` settings, which
members share a pass; the update of every algorithm then runs its passes group by group.
"""

from __future__ import annotations

import torch

from ..adapters.shared import checkpointing


def activation_bytes_per_token(model, logits: bool = True) -> float:
    """Estimated bytes a training forward keeps per token for the backward pass (float32): per decoder
    layer the normed inputs, q/k/v/o, the MLP's gate/up/activation/product (``~8 h + 5 I``), plus, with
    ``logits``, the logits and their log-softmax (``3 V``: the loss forwards compute them only on
    completion tokens, see :func:`evollm.rollout.forward_logprobs`). Used to size fused learn passes; an
    estimate, not a bound."""
    cfg = getattr(model, "config", None)
    vocab = model.get_output_embeddings().weight.shape[0]
    hidden = getattr(cfg, "hidden_size", 0) or 0
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    layers = getattr(cfg, "num_hidden_layers", 0) or 0
    return 4.0 * (layers * (8 * hidden + 5 * inter) + (3 * vocab if logits else 0))


#: the default fused learn joins members in one pass only while one member's activations stay within
#: this fraction of its persistent state (adapter + Adam moments), so each extra member costs at most
#: ~1.5x its state at peak; above it (the usual case for LoRA) members learn one by one, which measured
#: as fast on CPU from ~8M parameters on (see benchmarks/README.md). ``learn_chunk_members`` overrides it.
FUSE_MAX_ACTIVATION_OVER_STATE = 0.5
#: ... or while they stay below this many MiB: such passes are bound by per-call overhead, where one
#: fused pass measured 1.4x faster than member by member (1M-parameter model, ~10 MiB per member), and
#: the memory they add is small in absolute terms
FUSE_SMALL_ACTIVATION_MB = 16.0


def member_state_bytes(agent) -> int:
    """Bytes of a member's persistent learn state: its trainable adapter tensors plus their optimizer
    state (two Adam moments each until the optimizer has state to count)."""
    params = agent.shared.parameters(agent.adapter_name("actor"))
    own = sum(p.numel() * p.element_size() for p in params)
    state = sum(t.numel() * t.element_size() for p in params for t in agent.optimizer.state.get(p, {}).values()
                if torch.is_tensor(t) and t.dim() > 0)
    return own + (state or 2 * own)


def member_chunks(agents, rows_each: int, width: int, logit_width: int | None = None) -> list[list[int]]:
    """Consecutive groups of members that learn in one fused forward and backward (``rows_each`` rows of
    ``width`` tokens each, logits on the last ``logit_width`` of them).

    ``learn_chunk_members`` when set (capped by ``logprob_chunk_rows``); by default members fuse only
    while a member's estimated activations are at most :data:`FUSE_MAX_ACTIVATION_OVER_STATE` of its
    persistent state or below :data:`FUSE_SMALL_ACTIVATION_MB`, and then as many as fit
    ``logits_budget_mb``; otherwise one by one. So beyond small models the learn's peak memory does not
    grow with the population beyond each member's own state."""
    c = agents[0].config
    n = len(agents)
    if n == 1:
        return [[0]]
    if checkpointing(agents[0].shared.model.get_base_model()):
        return [[i] for i in range(n)]  # the routing hooks are gone when backward recomputes the forward
    model = agents[0].shared.model
    logit_width = width if logit_width is None else logit_width
    body = activation_bytes_per_token(model, logits=False)
    per_member = rows_each * (width * body + logit_width * (activation_bytes_per_token(model) - body))
    if c.learn_chunk_members:
        k = c.learn_chunk_members
    elif (per_member <= FUSE_SMALL_ACTIVATION_MB * 2**20
          or per_member <= FUSE_MAX_ACTIVATION_OVER_STATE * member_state_bytes(agents[0])):
        k = max(1, int(c.logits_budget_mb * 2**20 // per_member))
    else:
        k = 1
    if c.logprob_chunk_rows is not None and c.logprob_chunk_rows < rows_each * min(k, n):
        k = max(1, c.logprob_chunk_rows // rows_each)  # an explicit row cap also bounds a fused pass
    k = min(k, n)
    chunks = -(-n // k)  # as few passes as the budget allows, members spread evenly over them
    size = -(-n // chunks)
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def learn_path(n_members: int, n_chunks: int) -> str:
    """How a (population) learn ran: ``single``, ``fused`` (one pass), ``fused_chunked`` or ``member_by_member``."""
    if n_members == 1:
        return "single"
    return "fused" if n_chunks == 1 else ("member_by_member" if n_chunks == n_members else "fused_chunked")
