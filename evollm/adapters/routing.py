"""Mixed batches: each row of one forward pass routed to its own member's adapter.

PEFT's own mixed-batch path (``adapter_names=``) loops over the adapters inside
every LoRA layer, so its cost grows with the number of members. Here the
members' LoRA matrices are stacked per layer (ranks zero-padded to the largest,
each member's ``alpha / r`` folded into its B) and applied with one batched
matmul, so eight members cost about what one does.

Rows are given as contiguous blocks, one block per adapter (``counts``). A forward pass
may carry a whole multiple ``k`` of ``sum(counts)`` rows (e.g. ``k`` samples per prompt
after ``repeat_interleave``): block ``i`` then has ``k * counts[i]`` rows. When all
blocks have the same size the batch is simply reshaped to ``[N, rows*T, d]``;
otherwise each row gathers its member's matrices.

While routing is active the adapters are disabled in PEFT (so PEFT computes the
base output only) and a forward hook on each LoRA layer adds the routed update.
Dropout on the LoRA input is not applied on this path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from . import fastlora
from .shared import SharedBase


@dataclass
class _LayerStack:
    A: torch.Tensor  # [N, in, R]
    B: torch.Tensor  # [N, R, out]  (already scaled by alpha / r)


def _stack_layer(layer, names: Sequence[str]) -> _LayerStack:
    ranks = [layer.r[n] for n in names]
    R = max(ranks)
    As, Bs = [], []
    for name, r in zip(names, ranks):
        a = layer.lora_A[name].weight  # [r, in]
        b = layer.lora_B[name].weight * layer.scaling[name]  # [out, r]
        if r < R:
            a = F.pad(a, (0, 0, 0, R - r))
            b = F.pad(b, (0, R - r))
        As.append(a.t())
        Bs.append(b.t())
    return _LayerStack(torch.stack(As), torch.stack(Bs))


class _Router:
    def __init__(self, shared: SharedBase, names: Sequence[str], counts: Sequence[int], differentiable: bool):
        missing = [n for n in names if not shared.has_adapter(n)]
        if missing:
            raise KeyError(f"unknown adapters {missing}; this base has {shared.adapters()}")
        if len(names) != len(counts):
            raise ValueError("names and counts must have the same length")
        self.names = list(names)
        self.counts = [int(c) for c in counts]
        self.total = sum(self.counts)
        self.differentiable = differentiable
        self.uniform = len(set(self.counts)) == 1
        self.device = shared.device
        self._row_index: dict[int, torch.Tensor] = {}
        self.layers = [m for _, m in shared.lora_layers() if all(n in m.lora_A for n in names)]
        self.stacks: dict[int, _LayerStack] = {}
        if not differentiable:
            with torch.no_grad():
                self.stacks = {id(m): _stack_layer(m, self.names) for m in self.layers}

    def delta(self, layer, x: torch.Tensor) -> torch.Tensor:
        stack = self.stacks.get(id(layer)) if not self.differentiable else _stack_layer(layer, self.names)
        rows = x.shape[0]
        if rows % self.total:
            raise RuntimeError(f"routed batch has {rows} rows; the routing plan covers multiples of {self.total}")
        x = x.to(stack.A.dtype)
        shape = x.shape
        if self.uniform:
            n = len(self.names)
            xs = x.reshape(n, -1, shape[-1])  # [N, rows_per*T, in]
            out = torch.bmm(torch.bmm(xs, stack.A), stack.B)
        else:
            xs = x.reshape(rows, -1, shape[-1])
            index = self.row_index(rows // self.total)
            A = stack.A[index]
            B = stack.B[index]
            out = torch.bmm(torch.bmm(xs, A), B)
        return out.reshape(*shape[:-1], out.shape[-1])

    def row_index(self, factor: int) -> torch.Tensor:
        if factor not in self._row_index:
            counts = torch.tensor(self.counts, device=self.device) * factor
            self._row_index[factor] = torch.repeat_interleave(torch.arange(len(self.names), device=self.device), counts)
        return self._row_index[factor]

    def hook(self, layer, args, output):
        return output + self.delta(layer, args[0]).to(output.dtype)


@contextlib.contextmanager
def routed(shared: SharedBase, names: Sequence[str], counts: Sequence[int], differentiable: bool = False):
    """Within this context, rows ``[sum(counts[:i]), sum(counts[:i+1]))`` of every forward
    pass of ``shared.model`` use adapter ``names[i]``.

    ``differentiable=False`` (generation, evaluation) stacks the matrices once on entry;
    ``True`` restacks on every forward so gradients reach each member's own adapter.
    """
    router = _Router(shared, names, counts, differentiable)
    model = shared.model
    layers = [m for _, m in shared.lora_layers()]
    disabled = [m._disable_adapters for m in layers]
    for m in layers:  # PEFT computes the base output only; the hooks add the routed updates
        m.__dict__["_disable_adapters"] = True
    handles = [m.register_forward_hook(router.hook) for m in router.layers]
    fastlora.install(layers, shared._fast)  # the base output without PEFT's per-layer calls
    previous_mode, shared._fast.mode = shared._fast.mode, fastlora.BASE
    was_training = model.training
    if not differentiable and was_training:
        model.eval()
    if differentiable:  # inactive adapters are frozen by PEFT; the routed ones must get gradients
        for name in router.names:
            for p in shared.parameters(name):
                p.requires_grad_(True)
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
        shared._fast.mode = previous_mode
        for m, flag in zip(layers, disabled):
            m.__dict__["_disable_adapters"] = flag
        if model.training != was_training:
            model.train(was_training)
