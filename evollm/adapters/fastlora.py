"""A cheap forward for evollm's own LoRA layers, with PEFT's tensors and semantics.

PEFT's ``lora.Linear.forward`` calls four sub-modules (base layer, dropout, A, B) and checks its
arguments on every call; with a population the active adapter is switched by ``set_adapter``,
which walks every module. Here each LoRA layer of the shared base gets an instance ``forward``
installed ONCE that reads the adapter to apply from one shared :class:`FastState`:

- ``state.mode is None``: PEFT's own forward (routing, mixed batches, user code, any variant);
- ``state.mode == BASE``: the base layer only (the reference policy);
- ``state.mode == name``: ``base(x) + B(A(x)) * scaling`` with adapter ``name``'s tensors,
  computed with the same ops PEFT uses (so the result is identical), without the sub-module calls.

Switching the member is then one attribute assignment. Only plain LoRA on ``nn.Linear`` layers
without dropout (or with dropout off) and without hooks on the base layer takes this path
(:func:`eligible`); anything else keeps PEFT's forward. The adapters themselves are untouched
PEFT modules: they save and load with PEFT as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BASE = "\0base"  # mode: the base model alone (no adapter)


class FastState:
    """Which adapter the installed forwards apply (``None``: defer to PEFT)."""

    __slots__ = ("mode",)

    def __init__(self):
        self.mode: str | None = None


def _plain_linear(module) -> bool:
    return (type(module) is torch.nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
            and not hasattr(module, "_hf_hook"))


def layer_support(layer, name: str) -> str:
    """Whether ``layer``'s adapter ``name`` (if it has one) can take the fast path: ``"yes"``, ``"no"``,
    or ``"eval"`` (LoRA dropout > 0: only while the layer is in eval mode, where dropout is off)."""
    from peft.tuners.lora import Linear as LoraLinear

    if type(layer) is not LoraLinear or not _plain_linear(layer.base_layer) or layer.merged:
        return "no"
    if name not in layer.lora_A:
        return "yes"  # the base output, as PEFT gives for a layer without this adapter
    if (name in layer.lora_variant or getattr(layer, "fan_in_fan_out", False)
            or not (_plain_linear(layer.lora_A[name]) and _plain_linear(layer.lora_B[name]))):
        return "no"
    dropout = layer.lora_dropout[name]
    return "yes" if isinstance(dropout, torch.nn.Identity) or dropout.p == 0 else "eval"


def support(layers, name: str) -> str:
    """The fast path's support for adapter ``name`` (or the base, ``BASE``) over all LoRA layers."""
    verdicts = {layer_support(m, name) for m in layers}
    return "no" if "no" in verdicts else ("eval" if "eval" in verdicts else "yes")


def _fast_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    mode = self._evollm_fast.mode
    if mode is None or args or kwargs or (self._disable_adapters and mode is not BASE):
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    result = F.linear(x, base.weight, base.bias)
    if mode is BASE:
        return result
    lora_A = self.lora_A._modules.get(mode)
    if lora_A is None:
        return result
    if x.dtype != lora_A.weight.dtype:  # PEFT casts; keep its exact path for mixed dtypes
        return type(self).forward(self, x)
    lora_B = self.lora_B._modules[mode]
    return result + F.linear(F.linear(x, lora_A.weight, lora_A.bias), lora_B.weight, lora_B.bias) * self.scaling[mode]


def install(layers, state: FastState) -> None:
    """Give every eligible LoRA layer the state-driven forward (idempotent)."""
    from peft.tuners.lora import Linear as LoraLinear

    for m in layers:
        if type(m) is LoraLinear and m.__dict__.get("_evollm_fast") is not state:
            m.__dict__["_evollm_fast"] = state
            m.forward = _fast_forward.__get__(m)


def installed(layer) -> bool:
    return "_evollm_fast" in layer.__dict__
