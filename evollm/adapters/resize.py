"""Changing the LoRA rank of a live member without changing what it computes.

* Grow ``r0 -> r1``: the new rows of A get LoRA's usual random init and the new
  columns of B are zero, with ``alpha`` rescaled so the scale ``alpha / r`` is
  unchanged: B·A, hence every log-prob, is exactly the same, and the new
  directions can still learn (B's new columns receive gradient through A).
* Shrink ``r0 -> r1``: the adapter becomes the best rank-``r1`` approximation of
  its current update ``s·B·A`` (truncated SVD, Eckart–Young), split evenly as
  ``B = U√Σ/√s``, ``A = √Σ Vᵀ/√s`` with the scale ``s`` kept.
* Optimizer state: on growth the Adam moments are zero-padded (the old
  directions keep their moments, the new ones start from zero). One tensor holds
  both, but Adam keeps one step count per tensor: with the old count ``t`` the
  new entries' bias corrections would be ``1 - beta^t`` instead of a fresh
  ``1 - beta^k``, and their first steps 2-4x the learning rate. A step hook
  (:func:`track_fresh_directions`) therefore corrects the new entries after
  every optimizer step to exactly what a fresh Adam would have done with its own
  count ``k``; the old entries are untouched. The tracking travels with clones
  and with checkpoints (``optimizer.safetensors``), so a resumed run keeps it. On shrink the basis changes, so
  the moments of the resized tensors are reset (a fresh Adam for the whole
  tensor). Learning rates and other param-group settings are kept in both cases.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _scale(layer, name: str) -> float:
    return float(layer.scaling[name])


def _alpha_for(config, rank: int, scale: float) -> float:
    return scale * (math.sqrt(rank) if getattr(config, "use_rslora", False) else rank)


def lora_factors(shared, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{layer: (A [r, in], B [out, r], scale)}`` for one adapter."""
    return {lname: (layer.lora_A[name].weight.detach().clone(), layer.lora_B[name].weight.detach().clone(),
                    _scale(layer, name))
            for lname, layer in shared.lora_layers() if name in layer.lora_A}


def svd_truncate(A: torch.Tensor, B: torch.Tensor, scale: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors (A', B') with ``scale·B'A'`` the best approximation of ``scale·B·A``."""
    delta = scale * (B.double() @ A.double())
    U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
    root = S[:rank].sqrt()
    B_new = U[:, :rank] * root / math.sqrt(scale)
    A_new = root[:, None] * Vh[:rank] / math.sqrt(scale)
    return A_new.to(A.dtype), B_new.to(B.dtype)


def grow_factors(A: torch.Tensor, B: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to ``rank``: new A rows LoRA-initialised (kaiming-uniform), new B columns zero."""
    extra = rank - A.shape[0]
    new_rows = torch.empty(extra, A.shape[1], dtype=A.dtype, device=A.device)
    torch.nn.init.kaiming_uniform_(new_rows, a=math.sqrt(5))
    return torch.cat([A, new_rows]), F.pad(B, (0, extra))


def set_adapter_factors(shared, name: str, rank: int, alpha: float,
                        factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Rebuild adapter ``name`` at ``rank`` / ``alpha`` with the given ``(A, B)`` per layer."""
    config = shared.config(name)
    for lname, layer in shared.lora_layers():
        if name not in layer.lora_A:
            continue
        A, B = factors[lname]
        old_a, old_b = layer.lora_A[name], layer.lora_B[name]
        new_a = torch.nn.Linear(A.shape[1], rank, bias=False, device=A.device, dtype=old_a.weight.dtype)
        new_b = torch.nn.Linear(rank, B.shape[0], bias=False, device=B.device, dtype=old_b.weight.dtype)
        with torch.no_grad():
            new_a.weight.copy_(A)
            new_b.weight.copy_(B)
        new_a.weight.requires_grad_(old_a.weight.requires_grad)
        new_b.weight.requires_grad_(old_b.weight.requires_grad)
        layer.lora_A[name], layer.lora_B[name] = new_a, new_b
        layer.r[name] = rank
        layer.lora_alpha[name] = alpha
        layer.scaling[name] = alpha / (math.sqrt(rank) if getattr(config, "use_rslora", False) else rank)
    config.r = rank
    config.lora_alpha = alpha
    config.rank_pattern, config.alpha_pattern = {}, {}
    shared.invalidate()


def resize_adapter(shared, name: str, rank: int) -> str:
    """Resize one adapter in place, function-preserving. Returns ``"grow"``, ``"shrink"`` or ``"same"``."""
    if rank < 1:
        raise ValueError(f"lora rank must be >= 1, got {rank}")
    config = shared.config(name)
    old_rank = int(config.r)
    if rank == old_rank:
        return "same"
    factors = lora_factors(shared, name)
    scales = {s for _, _, s in factors.values()}
    if len(scales) != 1:
        raise ValueError(f"adapter {name!r} has per-layer scales {sorted(scales)}; resizing needs one scale")
    scale = scales.pop()
    if rank > old_rank:
        new = {k: grow_factors(A, B, rank) for k, (A, B, _) in factors.items()}
    else:
        new = {k: svd_truncate(A, B, s, rank) for k, (A, B, s) in factors.items()}
    set_adapter_factors(shared, name, rank, _alpha_for(config, rank, scale), new)
    return "grow" if rank > old_rank else "shrink"


def resize_member(agent, rank: int) -> None:
    """``agent.set_lora_rank(rank)``: resize every adapter of the member and carry its optimizer over."""
    rank = int(rank)
    old_state = agent.optimizer.state_dict()
    old_params = [p for g in agent.optimizer.param_groups for p in g["params"]]
    old_shapes = [tuple(p.shape) for p in old_params]
    kinds = {resize_adapter(agent.shared, agent.adapter_name(role), rank) for role in agent.ROLES}
    if kinds == {"same"}:
        return
    old_fresh = getattr(agent.optimizer, FRESH_ATTR, {})
    agent.reinit_optimizers()
    new_params = [p for g in agent.optimizer.param_groups for p in g["params"]]
    state = {"param_groups": old_state["param_groups"], "state": {}}
    fresh: dict[int, list] = {}
    for pid, entry in old_state["state"].items():
        new_shape = tuple(new_params[pid].shape)
        if new_shape == old_shapes[pid]:
            state["state"][pid] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in entry.items()}
            if pid in old_fresh:
                fresh[pid] = old_fresh[pid]
        elif "grow" in kinds:
            state["state"][pid] = {k: (_pad_to(v, new_shape) if k in _ADAM_MOMENTS else
                                       (v.clone() if torch.is_tensor(v) else v)) for k, v in entry.items()}
            step = int(entry["step"]) if "step" in entry else 0
            old_entries = _pad_to(torch.ones(old_shapes[pid]), new_shape) > 0
            fresh[pid] = [(_pad_to(m.float(), new_shape) > 0, b) for m, b in old_fresh.get(pid, [])] \
                + [(~old_entries, step)]
        # shrink: no entry, so the optimizer starts these tensors' moments afresh
    agent.optimizer.load_state_dict(state)
    track_fresh_directions(agent.optimizer, fresh)


FRESH_ATTR = "_evollm_fresh_directions"


def track_fresh_directions(optimizer: torch.optim.Optimizer, fresh: dict[int, list]) -> None:
    """Give the entries born by a rank growth a fresh Adam's bias corrections.

    ``fresh``: parameter position (in ``param_groups`` order) -> list of ``(mask, step_at_birth)``.
    After every ``optimizer.step()`` each masked entry's update is replaced by a fresh Adam's: with
    ``t`` the tensor's step count and ``k = t - step_at_birth`` the entry's own,
    ``lr * (m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) + eps)`` instead of the same with ``t``.
    Entries drop out once the two agree to 1e-7.
    """
    if not fresh:
        return
    setattr(optimizer, FRESH_ATTR, fresh)
    optimizer.register_step_post_hook(_fresh_adam_correction)


def carry_fresh_directions(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Copy the tracking of :func:`track_fresh_directions` to an optimizer over a copy of the params."""
    fresh = getattr(source, FRESH_ATTR, None)
    if fresh:
        track_fresh_directions(target, {pid: [(m.clone(), b) for m, b in v] for pid, v in fresh.items()})


@torch.no_grad()
def _fresh_adam_correction(optimizer, args, kwargs) -> None:
    fresh = getattr(optimizer, FRESH_ATTR, {})
    pos = 0
    for group in optimizer.param_groups:
        b1, b2 = group["betas"]
        for p in group["params"]:
            entries, st = fresh.get(pos), optimizer.state.get(p)
            pos += 1
            if not entries or not st or "exp_avg" not in st:
                continue
            t = int(st["step"])
            m, v = st["exp_avg"], st["exp_avg_sq"]
            kept = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + group["eps"])
            left = []
            for mask, born in entries:
                k = t - born
                if k <= 0:
                    left.append((mask, born))
                    continue
                own = (m / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + group["eps"])
                p.sub_(group["lr"] * (own - kept) * mask.to(p.device))
                if abs(b1 ** k - b1 ** t) > 1e-7 or abs(b2 ** k - b2 ** t) > 1e-7:
                    left.append((mask, born))
            fresh[pos - 1] = left


def _pad_to(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    pads = []
    for have, want in reversed(list(zip(t.shape, shape))):
        pads += [0, want - have]
    return F.pad(t, pads)


def check_or_merge_rank(agent, role: str, config, state: dict, merge_lora_configs: bool) -> dict:
    """Reconcile a checkpoint's adapter config with the live member's before loading ``state``.

    Equal ranks load as-is. Otherwise, without ``merge_lora_configs`` a ``ValueError`` names both
    configurations; with it the larger rank wins and the smaller side is padded, the checkpoint's
    scale ``alpha / r`` kept so the loaded adapter computes what it computed when saved.
    """
    name = agent.adapter_name(role)
    live = agent.shared.config(name)
    live_r, ckpt_r = int(live.r), int(config.r)
    if live_r == ckpt_r and float(live.lora_alpha) == float(config.lora_alpha):
        return state
    if not merge_lora_configs:
        raise ValueError(f"checkpoint {role} adapter has r={ckpt_r}, lora_alpha={config.lora_alpha} but the live "
                         f"member has r={live_r}, lora_alpha={live.lora_alpha}; pass merge_lora_configs=True "
                         "to load across ranks")
    ckpt_scale = float(config.lora_alpha) / (math.sqrt(ckpt_r) if getattr(config, "use_rslora", False) else ckpt_r)
    rank = max(live_r, ckpt_r)
    if rank != live_r:
        agent.set_lora_rank(rank)
    # give the live adapter the checkpoint's scale at the winning rank (weights are overwritten next)
    factors = {k: (A, B) for k, (A, B, _) in lora_factors(agent.shared, name).items()}
    set_adapter_factors(agent.shared, name, rank, _alpha_for(live, rank, ckpt_scale), factors)
    if ckpt_r == rank:
        return state
    padded = {}
    for key, value in state.items():
        if "lora_A" in key:
            extra = torch.zeros(rank - ckpt_r, value.shape[1], dtype=value.dtype)
            torch.nn.init.kaiming_uniform_(extra, a=math.sqrt(5))
            padded[key] = torch.cat([value, extra])
        elif "lora_B" in key:
            padded[key] = F.pad(value, (0, rank - ckpt_r))
        else:
            padded[key] = value
    return padded
