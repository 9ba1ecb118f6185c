"""DeepSpeed ZeRO for a population: every member's optimizer inside its own DeepSpeed engine.

Under ``accelerate launch --config_file configs/deepspeed/zero2.yaml`` (or ``zero1.yaml``, ``zero3.yaml``)
every member's trainable parameters (its LoRA adapters) and its AdamW are handed to
``deepspeed.initialize`` with the launch's ZeRO stage: stage 1 partitions the member's optimizer state
(and fp32 master copy) across processes, stage 2 its gradients too (reduce-scatter during the
backward), stage 3 its parameters too (below). The frozen base is never handed to DeepSpeed: it
is not copied, partitioned or wrapped; every process holds it once. Members with several param groups
(LLMPPO's and IPPO agents' ``actor`` and ``critic``) get one engine per group (:class:`ZeroGroups`),
so each group is clipped on its own.

evollm's losses pass through the member's engine (:meth:`ZeroOptimizer.track`, DeepSpeed's
torch-style backward: the engine's hooks reduce and partition the gradients during a plain
``loss.backward()``, also when several members' losses share one backward), and ``step()`` is
``engine.step()``. The member's hyperparameters reach the engine: its learning rate is the engine
optimizer's param-group ``lr`` and its ``max_grad_norm`` the ZeRO optimizer's clip value, set before
every step. :meth:`ZeroOptimizer.state_dict` gathers the full (unpartitioned) state in torch's AdamW
layout, so clones, LoRA-rank changes and safetensors checkpoints work unchanged;
:meth:`~ZeroOptimizer.load_state_dict` gives every process its own partition of a full state.

Stage 3 (``zero3.yaml``) partitions the member's parameters too: each process holds its shard of every
adapter parameter (DeepSpeed's ``ds_tensor``) beside its shard of the fp32 master copy, gradients and
Adam state. The working copy every forward reads is kept whole on every process between steps -- these
are DeepSpeed's *persistent* parameters (``stage3_param_persistence_threshold``), re-gathered after each
step -- because the members' adapters live inside the ONE shared base that every rollout token runs
through: gathering them per forward would cost an all-gather per generated token, while the adapters are
a small fraction of the (unpartitioned) base that every process holds anyway.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from evollm.parallel import distributed as dist
from evollm.parallel.zero.engine import PERSIST_ALL, ZeroOptimizer, deepspeed_config
from evollm.parallel.zero.groups import ZeroGroups

__all__ = ["PERSIST_ALL", "SUPPORTED_STAGES", "ZeroGroups", "ZeroOptimizer", "active", "deepspeed_config", "is_zero",
           "snapshot_members", "stage", "track", "wrap"]

SUPPORTED_STAGES = (1, 2, 3)


def stage() -> int | None:
    """The ZeRO stage of this launch (``None``: no DeepSpeed); offloading is refused."""
    s = dist.zero_stage()
    if s is None:
        return None
    if s not in SUPPORTED_STAGES:
        raise ValueError(f"DeepSpeed zero_stage={s} is not valid; use 1, 2 or 3 (configs/deepspeed/zero*.yaml)")
    if os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false").lower() == "true":
        raise ValueError("DeepSpeed zero3_init_flag=true is not supported for a population: the frozen base is shared "
                         "whole by every member on each process; set zero3_init_flag: false")
    for kind in ("OPTIMIZER", "PARAM"):
        device = os.environ.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind}_DEVICE", "none").lower()
        if device not in ("none", ""):
            raise ValueError(f"DeepSpeed offload_{kind.lower()}_device={device!r} is not supported for a population; "
                             "set it to none")
    return s


def active() -> bool:
    """Whether members' optimizers go into DeepSpeed engines (a ZeRO launch of several processes)."""
    return stage() is not None and dist.is_distributed()


def wrap(optimizer: torch.optim.Optimizer, max_grad_norm: float | None, previous=None):
    """``optimizer`` inside a DeepSpeed ZeRO engine when this is a ZeRO launch, else unchanged.
    ``previous``: the member's former optimizer. Over the same parameters (a reset, e.g. before a
    checkpoint is loaded) its engine is kept and reset to a fresh optimizer with ``optimizer``'s
    settings; otherwise it is closed first."""
    if is_zero(previous):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if previous.engine is not None and len(params) == len(previous.params) and all(
                a is b for a, b in zip(params, previous.params)):
            previous.reset(optimizer, max_grad_norm)
            return previous
        previous.close()
    s = stage()
    if s is None:
        return optimizer
    dist.init()
    if not dist.is_distributed():  # one process: nothing to partition, the plain optimizer is the same thing
        return optimizer
    if len(optimizer.param_groups) > 1:
        return ZeroGroups(optimizer, s, max_grad_norm)
    return ZeroOptimizer(optimizer, s, max_grad_norm)


def track(optimizer, loss: torch.Tensor, groups=None) -> torch.Tensor:
    """``loss`` through the member's engine when its optimizer is a ZeRO one (else unchanged).
    ``groups``: the names of the param groups whose parameters the loss's backward reaches (members
    with several groups, see :class:`ZeroGroups`; ``None``: all)."""
    if isinstance(optimizer, ZeroGroups):
        return optimizer.track(loss, groups)
    return optimizer.track(loss) if isinstance(optimizer, ZeroOptimizer) else loss


def is_zero(optimizer) -> bool:
    return isinstance(optimizer, (ZeroOptimizer, ZeroGroups))


def snapshot_members(agents: Sequence) -> None:
    """Gather every ZeRO member's full optimizer state (collective; call on every process before a
    checkpoint is written by the main process). A member made of agents (an IPPO team) gathers each
    agent's."""
    for a in agents:
        for agent in getattr(a, "agents", None) or [a]:
            opt = getattr(agent, "optimizer", None)
            if is_zero(opt):
                opt.snapshot()
