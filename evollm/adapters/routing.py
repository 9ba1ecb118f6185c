"""Mixed batches: each row of one forward pass routed to its own member's adapter.

PEFT's own mixed-batch path (``adapter_names=``) loops over the adapters inside
every LoRA layer, so its cost grows with the number of members. Here the
members' LoRA matrices are stacked per layer (ranks zero-padded to the largest,
each member's ``alpha / r`` folded into its B) and applied with one batched
matmul, so eight members cost about what one does.

Rows are given as contiguous blocks, one block per adapter (``counts``). A forward pass
may carry a whole multiple ``k`` of ``sum(counts)`` rows (e.g. ``k`` samples per prompt
after ``repeat_interleave``): block ``i`` then has ``k * counts[i]`` rows. When all
blocks have the same size the batch is simply reshaped to ``[N, rows*T, d]`` (so any ``N``
equal blocks pass, e.g. one row per distinct prompt of each member in a shared-prompt forward);
otherwise each row gathers its member's matrices.

While routing is active the adapters are disabled in PEFT (so PEFT computes the
base output only) and a forward hook on each LoRA layer adds the routed update.
Dropout on the LoRA input is not applied on this path: evollm runs every forward that
samples or feeds a loss with dropout off (``disable_dropout``), where LoRA dropout is the
identity; with dropout on, callers use each member's own PEFT forward instead.

Which ``LoraConfig`` settings take which path (:func:`check_lora_config`, :func:`batch_path`):

* routed exactly: LoRA on any ``nn.Linear`` (attention/MLP projections, ``lm_head``),
  ``lora_dropout``, ``use_rslora``, ``rank_pattern`` / ``alpha_pattern``, ``layers_to_transform``,
  members of different ranks, and members whose adapters cover different layers;
* one forward per member through PEFT's own layers: ``use_dora`` (DoRA's weight-norm is not a
  plain low-rank update, and PEFT's mixed-batch path ``adapter_names=`` refuses DoRA);
* a one-line ``ValueError`` when the member is built: everything else (LoRA on embeddings or
  convolutions, ``modules_to_save``, ``bias``, ``lora_bias``, initialisations that edit the shared
  base such as PiSSA/OLoRA/LoftQ/EVA/CorDA, ``layer_replication``, ``target_parameters``,
  ``trainable_token_indices``, QALoRA, aLoRA, ...).
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


#: LoraConfig fields that must keep their default for a member on the shared base, with why.
_UNSUPPORTED = {
    "modules_to_save": "full module copies per member are not routed, cloned or resized",
    "trainable_token_indices": "per-member token embeddings are not routed",
    "layer_replication": "it changes the shared base's layers",
    "target_parameters": "LoRA on bare parameters is not routed",
    "loftq_config": "LoftQ rewrites the shared base weights",
    "eva_config": "EVA initialisation is not supported", "corda_config": "CorDA rewrites the shared base weights",
    "lora_ga_config": "LoRA-GA initialisation is not supported", "use_qalora": "QALoRA is not routed",
    "alora_invocation_tokens": "aLoRA is not routed", "megatron_config": "Megatron layers are not routed",
    "use_bdlora": "BD-LoRA is not routed", "arrow_config": "Arrow routing is not supported",
    "kasa_config": "KaSA is not routed", "velora_config": "VeLoRA is not routed",
    "monteclora_config": "MonteCLoRA is not routed", "lora_bias": "a LoRA bias is not routed",
}
_INITS = (True, False, "gaussian")

ROUTED, PER_MEMBER = "routed", "per_member"


def check_lora_config(config) -> str:
    """The batch path of a member with this ``LoraConfig`` (``"routed"`` or ``"per_member"``), or a
    one-line ``ValueError`` naming the setting that evollm cannot run exactly on a shared base."""
    for name, why in _UNSUPPORTED.items():
        if getattr(config, name, None) not in (None, False, {}, [], ()):
            raise ValueError(f"LoraConfig.{name}={getattr(config, name)!r} is not supported: {why}; "
                             f"leave it at its default")
    if getattr(config, "bias", "none") != "none":
        raise ValueError(f"LoraConfig.bias={config.bias!r} is not supported: the bias belongs to the shared base; "
                         f"use bias='none'")
    if getattr(config, "init_lora_weights", True) not in _INITS:
        raise ValueError(f"LoraConfig.init_lora_weights={config.init_lora_weights!r} is not supported: it edits "
                         f"the shared base or is not routed; use one of {list(_INITS)}")
    return PER_MEMBER if getattr(config, "use_dora", False) else ROUTED


def check_adapter_layers(shared: SharedBase, name: str) -> None:
    """A one-line ``ValueError`` when adapter ``name`` sits on a layer kind routing does not handle
    (LoRA on embeddings or convolutions): only ``nn.Linear`` layers are accepted."""
    for lname, layer in shared.lora_layers():
        if name in getattr(layer, "lora_embedding_A", {}):
            raise ValueError(f"LoRA on the embedding layer {lname!r} is not supported (not routed, not resized); "
                             f"drop it from target_modules")
        if name in layer.lora_A and not isinstance(layer.get_base_layer(), torch.nn.Linear):
            raise ValueError(f"LoRA on {type(layer.get_base_layer()).__name__} layer {lname!r} is not supported; "
                             f"target nn.Linear layers only")


def batch_path(shared: SharedBase, names: Sequence[str]) -> str:
    """``"routed"`` when every adapter in ``names`` is routed exactly, else ``"per_member"``."""
    return PER_MEMBER if any(check_lora_config(shared.config(n)) == PER_MEMBER for n in names) else ROUTED


def _stack_layer(layer, names: Sequence[str]) -> _LayerStack:
    """Members without an adapter on this layer (``layers_to_transform``, other target modules)
    contribute zeros."""
    present = [n for n in names if n in layer.lora_A]
    R = max(layer.r[n] for n in present)
    ref = layer.lora_A[present[0]].weight
    d_in, d_out = ref.shape[1], layer.lora_B[present[0]].weight.shape[0]
    As, Bs = [], []
    for name in names:
        if name not in layer.lora_A:
            As.append(ref.new_zeros(d_in, R))
            Bs.append(ref.new_zeros(R, d_out))
            continue
        r = layer.r[name]
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
        self.layers = [m for _, m in shared.lora_layers() if any(n in m.lora_A for n in names)]
        self.stacks: dict[int, _LayerStack] = {}
        if not differentiable:
            with torch.no_grad():
                self.stacks = {id(m): _stack_layer(m, self.names) for m in self.layers}

    def delta(self, layer, x: torch.Tensor) -> torch.Tensor:
        stack = self.stacks.get(id(layer))
        if stack is None:  # differentiable: stacked on first use in this context, so each forward pass of it (a
            # shared prompt's and its completions') reads one stack and the backward reaches every member's tensors
            stack = self.stacks[id(layer)] = _stack_layer(layer, self.names)
        rows, n = x.shape[0], len(self.names)
        if rows % (n if self.uniform else self.total):  # equal blocks: any n equal blocks of rows
            raise RuntimeError(f"routed batch has {rows} rows; the routing plan covers multiples of "
                               f"{n if self.uniform else self.total}")
        x = x.to(stack.A.dtype)
        shape = x.shape
        if self.uniform:
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
    ``True`` stacks them (with gradients to each member's own adapter) on first use within the context:
    one context serves the forward passes of ONE backward (an optimizer step inside it would leave the
    stacks stale).
    """
    if batch_path(shared, names) != ROUTED:
        raise ValueError(f"adapters {[n for n in names if check_lora_config(shared.config(n)) != ROUTED]} cannot "
                         f"be routed (DoRA); run them one member at a time")
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
