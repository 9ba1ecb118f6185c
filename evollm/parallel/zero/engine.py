"""One member's AdamW inside a DeepSpeed ZeRO engine (see :mod:`evollm.parallel.zero` for the design)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import MutableMapping
from typing import Sequence

import torch

from evollm.parallel import distributed as dist

_MOMENTS = ("exp_avg", "exp_avg_sq")
PERSIST_ALL = 2 ** 62


def deepspeed_config(zero_stage: int, max_grad_norm: float | None) -> dict:
    """The DeepSpeed config of one member's engine. The batch sizes are bookkeeping only (evollm
    forms the batches); gradients are averaged over processes; clipping is the member's own. Stage 3:
    every adapter parameter is persistent (see the module docstring)."""
    zero = {"stage": int(zero_stage), "overlap_comm": False, "contiguous_gradients": True}
    if int(zero_stage) == 3:
        zero.update(stage3_param_persistence_threshold=PERSIST_ALL)
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": float(max_grad_norm or 0.0), "steps_per_print": 2 ** 62,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "wall_clock_breakdown": False}


class _Holder(torch.nn.Module):
    """The module DeepSpeed wraps for one member: its trainable parameters (the SAME Parameter objects
    that live in the shared base's LoRA layers). Its forward passes a loss through, so the engine's
    backward hooks see every loss the member is trained on."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        super().__init__()
        self.members_params = torch.nn.ParameterList(params)

    def forward(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * 1.0


class _Group(MutableMapping):
    """A param group as evollm sees it: ``params`` are the member's own parameters, every other key
    (``lr``, ``name``, ``betas``, ...) reads and writes the engine optimizer's group."""

    def __init__(self, group: dict, params: list):
        self._group, self._params = group, params

    def __getitem__(self, key):
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key, value):
        if key == "params":
            raise KeyError("the parameters of a ZeRO member's param group cannot be replaced; build a new optimizer")
        self._group[key] = value

    def __delitem__(self, key):
        del self._group[key]

    def __iter__(self):
        return iter(self._group)

    def __len__(self):
        return len(self._group)


class ZeroOptimizer:
    """One member's AdamW inside a DeepSpeed ZeRO engine, with the ``torch.optim.Optimizer`` surface
    evollm uses (``param_groups``, ``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, zero_stage: int, max_grad_norm: float | None):
        import deepspeed

        self.groups_params = [list(g["params"]) for g in optimizer.param_groups]
        self.params = [p for ps in self.groups_params for p in ps]
        self.zero_stage = int(zero_stage)
        self.max_grad_norm = max_grad_norm
        trainable = [p.requires_grad for p in self.params]
        for p in self.params:  # the shared base marks only the adapter in use trainable; DeepSpeed takes trainable ones
            p.requires_grad_(True)
        with _quiet():
            self.engine, self.zero, _, _ = deepspeed.initialize(
                model=_Holder(self.params), optimizer=optimizer,
                config=deepspeed_config(zero_stage, max_grad_norm), dist_init_required=False)
        for p, flag in zip(self.params, trainable):
            p.requires_grad_(flag)
        if self.zero_stage == 3:
            self._gather_params()
        self.param_groups = [_Group(g, ps) for g, ps in zip(self.zero.param_groups, self.groups_params)]
        self.last_grad_norm = float("nan")
        self._snapshot = None

    # ------------------------------------------------------------------ training
    def track(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` through the member's engine (same value): its backward reduces and partitions the
        member's gradients across processes."""
        return self.engine(loss)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> None:
        self.zero.clip_grad = float(self.max_grad_norm or 0.0)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self.last_grad_norm = float(norm) if norm is not None else float("nan")
        self._snapshot = None

    def register_step_post_hook(self, hook):
        """Accepted for the torch surface; step hooks (the fresh-Adam correction of directions born by a
        LoRA rank growth) do not run on a partitioned state: those entries keep their tensor's step count."""
        warnings.warn("ZeRO member: entries born by a LoRA rank growth share their tensor's Adam step count (the "
                      "fresh-Adam bias correction needs the unpartitioned state)", stacklevel=2)

    # ------------------------------------------------------------------ state
    def _partitions(self) -> list[torch.Tensor]:
        """This process's flat fp32 partition of each param group (the tensors its Adam state is keyed by)."""
        if self.zero_stage == 3:
            return list(self.zero.fp32_partitioned_groups_flat)
        return list(self.zero.single_partition_of_fp32_groups)

    def _gather_params(self) -> None:
        """Stage 3: make every adapter parameter whole again on this process (collective), as
        DeepSpeed does for its persistent parameters after every step."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        missing = [p for p in self.params if p.ds_status != ZeroParamStatus.AVAILABLE]
        if missing:
            missing[0].all_gather(missing)

    def local_state_numel(self) -> int:
        """Elements of optimizer state (Adam moments) this process holds for the member."""
        total = 0
        for flat in self._partitions():
            st = self.zero.optimizer.state.get(flat, {})
            total += sum(st[k].numel() for k in _MOMENTS if k in st)
        return total

    def local_master_numel(self) -> int:
        """Elements of the member's fp32 master parameters this process holds (its partition)."""
        return sum(flat.numel() for flat in self._partitions())

    def local_param_numel(self) -> int:
        """Elements of the member's parameters this process holds as its own: its shard under stage 3
        (DeepSpeed's ``ds_tensor``), every element under stages 1-2."""
        if self.zero_stage == 3:
            return sum(p.ds_tensor.numel() for p in self.params)
        return sum(p.numel() for p in self.params)

    def full_state_numel(self) -> int:
        """Elements of optimizer state the member has in all (both Adam moments of every parameter)."""
        return 2 * sum(p.numel() for p in self.params)

    def gather(self) -> dict:
        """The full optimizer state in torch's AdamW ``state_dict`` layout. Collective: every process
        must call it (they all get the full state)."""
        with _trainable(self.params):
            return self._gather()

    def _gather(self) -> dict:
        state, pid = {}, 0
        for g, (ps, flat) in enumerate(zip(self.groups_params, self._partitions())):
            st = self.zero.optimizer.state.get(flat, {})
            for p in ps:
                if "exp_avg" in st:
                    from deepspeed.utils import safe_get_full_optimizer_state

                    entry = {"step": st["step"].detach().clone() if torch.is_tensor(st["step"]) else
                             torch.tensor(float(st["step"]))}
                    for k in _MOMENTS:
                        entry[k] = safe_get_full_optimizer_state(p, k).detach().to(p.device).reshape(p.shape).clone()
                    state[pid] = entry
                pid += 1
        groups, pid = [], 0
        for group, ps in zip(self.zero.param_groups, self.groups_params):
            g = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            g["params"] = list(range(pid, pid + len(ps)))
            pid += len(ps)
            groups.append(g)
        return {"state": state, "param_groups": groups}

    def snapshot(self) -> None:
        """Gather the full state now (collective) and keep it until the next step, so that a single
        process (the one writing a checkpoint) can read :meth:`state_dict` without the others."""
        self._snapshot = self.gather()

    def state_dict(self) -> dict:
        """The full state (torch AdamW layout): the snapshot taken since the last step, else a
        collective gather (every process must call it then)."""
        return self._snapshot if self._snapshot is not None else self.gather()

    def load_state_dict(self, state: dict) -> None:
        """Load a full state (torch AdamW layout): every process keeps only its partition."""
        with _trainable(self.params):
            self._load(state)

    def _load(self, state: dict) -> None:

        for group, saved in zip(self.param_groups, state["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    group[k] = copy.deepcopy(v)
        pid = 0
        entries = state["state"]
        for ps, flat in zip(self.groups_params, self._partitions()):
            steps = [entries[i]["step"] for i in range(pid, pid + len(ps)) if i in entries]
            if steps:
                st = self.zero.optimizer.state[flat]
                if "exp_avg" not in st:  # torch's AdamW creates its state at the first step
                    st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(flat), exp_avg_sq=torch.zeros_like(flat))
                    if self.zero_stage < 3:  # stages 1-2 link each parameter's fragment of the state
                        self.zero._hp_optimizer_states_linked = False
                        self.zero._lazy_init_hp_params_optimizer_state()
                st["step"] = torch.tensor(float(steps[0]))
                for i, p in enumerate(ps, start=pid):
                    for k in _MOMENTS:
                        value = entries[i][k] if i in entries else torch.zeros_like(p)
                        self._set_full(p, value.to(flat.device, flat.dtype).reshape(-1), k)
            pid += len(ps)
        self._snapshot = None

    def _set_full(self, param: torch.nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
        """Give this process its partition of ``value``: the parameter's fp32 master copy (``key`` None)
        or an Adam moment. DeepSpeed's ``safe_set_full_*`` do it, except that under stage 3 a tensor
        with fewer elements than processes (a value head's bias) overruns its padded partitions; that
        case takes this process's slice here, zero-padded, as DeepSpeed lays it out."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if self.zero_stage < 3 or value.numel() % dist.num_processes() == 0:
            if key is None:
                safe_set_full_fp32_param(param, value)
            else:
                safe_set_full_optimizer_state(param, value, key)
            return
        part, _ = self.zero._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
        size = param.ds_tensor.numel()  # the padded partition of every process
        start = size * self.zero._get_param_partition_rank(param)
        piece = value.reshape(-1)[start:start + min(size, part.numel())]
        part.data.zero_()
        part.data[:piece.numel()].copy_(piece)

    def reset(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> None:
        """A fresh optimizer on the same engine: ``optimizer``'s group settings, Adam moments and step
        counts zero, the fp32 master copy taken from the parameters as they are now (e.g. just loaded)."""

        for group, fresh in zip(self.param_groups, optimizer.param_groups):
            for k, v in fresh.items():
                if k != "params":
                    group[k] = copy.deepcopy(v)
        with _trainable(self.params):
            for p in self.params:
                self._set_full(p, p.detach().clone())
        if self.zero_stage == 3:  # the parameters' own partitions follow their fp32 master copy
            for i in range(len(self.zero.fp16_groups)):
                self.zero._reassign_or_swap_out_partitioned_parameters(i)
        for flat in self._partitions():
            self.zero.optimizer.state.get(flat, {}).clear()
        self.zero._hp_optimizer_states_linked = False
        self.max_grad_norm = max_grad_norm
        self._snapshot = None

    def close(self) -> None:
        """Remove the engine's hooks from the member's parameters (before a new engine takes them)."""
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None


class _trainable:
    """Mark parameters trainable for a while: the shared base marks only the adapter in use trainable,
    and DeepSpeed reads and writes the state of trainable parameters only."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params, self.flags = params, [p.requires_grad for p in params]

    def __enter__(self):
        for p in self.params:
            p.requires_grad_(True)

    def __exit__(self, *exc):
        for p, flag in zip(self.params, self.flags):
            p.requires_grad_(flag)


class _quiet:
    """DeepSpeed logs every engine it builds at INFO; a population builds one per member."""

    def __enter__(self):
        import logging

        self.logger = logging.getLogger("DeepSpeed")
        self.level = self.logger.level
        self.logger.setLevel(logging.WARNING)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
