"""Members with several param groups under DeepSpeed ZeRO: one engine per group."""

from __future__ import annotations

from typing import Sequence

import torch

from evollm.parallel.zero.engine import ZeroOptimizer


class ZeroGroups:
    """A member with several named param groups (PPO's and IPPO's ``actor`` and ``critic``): one
    :class:`ZeroOptimizer` (one DeepSpeed engine) per group, so each group's gradient is clipped to
    ``max_grad_norm`` on its own, as evollm's PPO does without DeepSpeed. The same ``torch.optim``
    surface as :class:`ZeroOptimizer`; ``state_dict`` is the groups' states in one torch AdamW layout."""

    def __init__(self, optimizer: torch.optim.Optimizer, zero_stage: int, max_grad_norm: float | None):
        self.parts = [ZeroOptimizer(_one_group(optimizer, g), zero_stage, max_grad_norm) for g in optimizer.param_groups]
        self.names = [g.get("name", str(i)) for i, g in enumerate(optimizer.param_groups)]
        self.zero_stage = int(zero_stage)
        self.params = [p for part in self.parts for p in part.params]
        self.last_grad_norms: dict[str, float] = {}

    @property
    def param_groups(self) -> list:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def max_grad_norm(self) -> float | None:
        return self.parts[0].max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        for part in self.parts:
            part.max_grad_norm = value

    @property
    def last_grad_norm(self) -> float:
        """The norm of all groups' gradients together (before clipping)."""
        return sum(n ** 2 for n in self.last_grad_norms.values()) ** 0.5

    def _parts(self, groups) -> list[ZeroOptimizer]:
        if groups is None:
            return list(self.parts)
        groups = (groups,) if isinstance(groups, str) else tuple(groups)
        return [part for part, name in zip(self.parts, self.names) if name in groups]

    def track(self, loss: torch.Tensor, groups=None) -> torch.Tensor:
        """``loss`` through the engines of ``groups`` (names; ``None``: every group): those whose
        parameters its backward reaches."""
        for part in self._parts(groups):
            loss = part.track(loss)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def step(self, closure=None) -> None:
        for name, part in zip(self.names, self.parts):
            part.step()
            self.last_grad_norms[name] = part.last_grad_norm

    def register_step_post_hook(self, hook):
        self.parts[0].register_step_post_hook(hook)

    def local_state_numel(self) -> int:
        return sum(part.local_state_numel() for part in self.parts)

    def local_master_numel(self) -> int:
        return sum(part.local_master_numel() for part in self.parts)

    def local_param_numel(self) -> int:
        return sum(part.local_param_numel() for part in self.parts)

    def full_state_numel(self) -> int:
        return sum(part.full_state_numel() for part in self.parts)

    def gather(self) -> dict:
        """Every group's full state, in one torch AdamW layout (parameter ids counted across groups).
        Collective, as :meth:`ZeroOptimizer.gather`."""
        return _merge([part.gather() for part in self.parts], [len(part.params) for part in self.parts])

    def snapshot(self) -> None:
        for part in self.parts:
            part.snapshot()

    def state_dict(self) -> dict:
        """The snapshots taken since the last step, else a collective gather (see :class:`ZeroOptimizer`)."""
        return _merge([part.state_dict() for part in self.parts], [len(part.params) for part in self.parts])

    def load_state_dict(self, state: dict) -> None:
        offset = 0
        for part, group in zip(self.parts, state["param_groups"]):
            n = len(part.params)
            ids = group["params"]
            part.load_state_dict({"state": {i - offset: state["state"][i] for i in ids if i in state["state"]},
                                  "param_groups": [{**group, "params": [i - offset for i in ids]}]})
            offset += n

    def reset(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> None:
        for part, group in zip(self.parts, optimizer.param_groups):
            part.reset(_one_group(optimizer, group), max_grad_norm)

    def close(self) -> None:
        for part in self.parts:
            part.close()

    @property
    def engine(self):
        return self.parts[0].engine


def _one_group(optimizer: torch.optim.Optimizer, group: dict) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s type over ``group`` alone (its settings kept)."""
    return type(optimizer)([dict(group)])  # the group carries every setting


def _merge(states: Sequence[dict], sizes: Sequence[int]) -> dict:
    state, groups, offset = {}, [], 0
    for sub, n in zip(states, sizes):
        state.update({offset + i: entry for i, entry in sub["state"].items()})
        groups += [{**g, "params": [offset + i for i in g["params"]]} for g in sub["param_groups"]]
        offset += n
    return {"state": state, "param_groups": groups}
