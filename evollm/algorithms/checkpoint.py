"""Agent checkpoints: safetensors + JSON only (no pickle anywhere).

Layout of ``save_agent(agent, path)``::

    path/adapter/            PEFT adapter dir (adapter_config.json + adapter_model.safetensors),
                             loadable with ``PeftModel.from_pretrained(base, path/adapter)``
    path/<role>/             further adapters (e.g. ``critic``), same format
    path/modules.safetensors extra trainable modules (e.g. a value head), if any
    path/optimizer.safetensors + optimizer.json   optimizer state and param groups (and the
                             LoRA directions born by a rank growth that still take a fresh
                             Adam's steps, see :func:`evollm.adapters.resize.track_fresh_directions`)
    path/agent.json          class, id, hyperparameters, hp_config, fitness, step counters and flags
    path/manifest.json       sha256 of every file, written last (see :mod:`evollm.utils.atomic`)

Saves are atomic (temporary folder, fsync, rename). Loads verify the manifest, then refuse in one
line: missing or extra adapter tensors, shapes that disagree with the recorded rank, hyperparameters
that fail ``validate()``, and (for populations) a base model other than the recorded one.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file

from evollm.adapters.resize import FRESH_ATTR, track_fresh_directions
from evollm.utils.atomic import CheckpointError, atomic_folder, jsonable, save_tensors, verify

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def role_dir(role: str) -> str:
    return "adapter" if role == "actor" else role


def save_adapter(shared, adapter_name: str, directory: Path) -> None:
    """Write one adapter exactly as PEFT lays it out on disk."""
    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(shared.config(adapter_name))
    config.base_model_name_or_path = getattr(shared.model.get_base_model().config, "_name_or_path", None)
    config.inference_mode = True
    config.save_pretrained(str(directory))
    state = {k: v.contiguous() for k, v in shared.state_dict(adapter_name).items()}
    save_tensors(state, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})


def read_adapter(directory: Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    config = LoraConfig.from_pretrained(str(directory))
    return config, load_file(str(directory / ADAPTER_WEIGHTS))


MAX_HEADER = 100 << 20  # bytes: safetensors' own limit for a header
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2,
               "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class _Shape:
    """A tensor's shape as its safetensors header states it (checked before anything is allocated)."""

    def __init__(self, shape):
        self.shape = torch.Size(shape)


def safetensors_shapes(path: Path) -> dict[str, _Shape]:
    """Every tensor's shape from the header of the safetensors file ``path``, after checking the header
    against the file: its stated size, its JSON, each tensor's dtype, shape and byte range. A header that
    claims more than the file holds (a corrupted or hostile file) is a :class:`CheckpointError`."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file ({size} bytes, shorter than its header length)")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER, size - 8):
            raise CheckpointError(f"{path}: the safetensors header claims {n} bytes, but the file has {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a mapping")
    data = size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
            ok = all(isinstance(d, int) and d >= 0 for d in [*shape, begin, end]) and dtype in DTYPE_BYTES
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok or end > data or end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointError(f"{path}: tensor {name!r} ({str(entry)[:80]}) does not fit the file's {data} "
                                  "data bytes")
        out[name] = _Shape(shape)
    return out


def check_recorded_rank(member_dir: Path, rank, roles=("actor",)) -> int:
    """The LoRA rank a member's ``agent.json`` records, checked against its adapters' configs and the
    shapes in their safetensors headers before anything of that rank is allocated."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CheckpointError(f"checkpoint {member_dir}: lora_rank {rank!r} is not an integer >= 1")
    for role in roles:
        directory = member_dir / role_dir(role)
        try:
            config = json.loads((directory / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {directory}: adapter_config.json is unreadable ({e})") from None
        if config.get("rank_pattern"):
            continue
        shapes = safetensors_shapes(directory / ADAPTER_WEIGHTS)
        ranks = {v.shape[0] for k, v in shapes.items() if "lora_A" in k and len(v.shape) == 2}
        if config.get("r") != rank or ranks != {rank}:
            raise CheckpointError(f"checkpoint {member_dir}: lora_rank {rank} in agent.json disagrees with its "
                                  f"{role} adapter (adapter_config r={config.get('r')!r}, tensors of rank "
                                  f"{sorted(ranks)})")
    return rank


def optimizer_to_safetensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors, scalars, born = {}, {}, {}
    for pid, entries in (getattr(optimizer, FRESH_ATTR, None) or {}).items():
        for j, (mask, step) in enumerate(entries):
            tensors[f"{FRESH_PREFIX}{pid}.{j}"] = mask.to(torch.uint8).contiguous()
            born.setdefault(str(pid), []).append(int(step))
    for pid, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().contiguous().clone()
            else:
                scalars[f"{pid}.{key}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars, "fresh_directions": born}


FRESH_PREFIX = "fresh_direction."


def fresh_from_safetensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict[int, list]:
    """The rank-growth tracking saved by :func:`optimizer_to_safetensors`: position -> [(mask, birth step)]."""
    return {int(pid): [(tensors[f"{FRESH_PREFIX}{pid}.{j}"].bool(), int(step)) for j, step in enumerate(steps)]
            for pid, steps in meta.get("fresh_directions", {}).items()}


def optimizer_from_safetensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith(FRESH_PREFIX):
            continue
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for name, value in meta.get("scalars", {}).items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def save_agent(agent, path: str | Path) -> Path:
    """Write one member atomically (a complete folder with a manifest, or nothing)."""
    with atomic_folder(path, "agent") as tmp:
        write_agent(agent, tmp)
    return Path(path)


def write_agent(agent, path: Path) -> Path:
    """The files of one member into ``path`` (no manifest: part of a larger checkpoint). A member made of
    several agents (an IPPO team) writes itself (its ``write_checkpoint``)."""
    if hasattr(agent, "write_checkpoint"):
        return agent.write_checkpoint(path)
    path.mkdir(parents=True, exist_ok=True)
    for role in agent.ROLES:
        save_adapter(agent.shared, agent.adapter_name(role), path / role_dir(role))
    extra = {f"{key}.{i}": p.detach().contiguous().clone()
             for key, params in agent.extra_parameters().items() for i, p in enumerate(params)}
    if extra:
        save_tensors(extra, str(path / "modules.safetensors"))
    tensors, meta = optimizer_to_safetensors(agent.optimizer)
    meta["lr_factor"] = float(getattr(agent, "lr_factor", 1.0))  # train.lr_cooldown: the groups' rates are scaled
    save_tensors(tensors, str(path / "optimizer.safetensors"))
    (path / "optimizer.json").write_text(json.dumps(meta, indent=1))
    info = {
        "algorithm": type(agent).__name__,
        "index": agent.index,
        "config": jsonable(agent.config),
        "hp_config": agent.hp_config.to_dict() if agent.hp_config is not None else None,
        "fitness": agent.fitness,
        "scores": [jsonable(s) for s in agent.scores],
        "steps": agent.steps,
        "lora_rank": agent.lora_rank,
        "quarantined": bool(agent.quarantined),
        "quarantine_reason": agent.quarantine_reason,
        "default_founder": bool(agent.default_founder),
        "base_fingerprint": shared_fingerprint(agent.shared),
    }
    (path / "agent.json").write_text(json.dumps(info, indent=1))
    return path


def load_agent(agent, path: str | Path, merge_lora_configs: bool = False, verify_manifest: bool = True) -> None:
    """Load a checkpoint written by :func:`save_agent` into a live member (on its shared base).
    Everything is checked before the member is touched."""
    from evollm.adapters.resize import check_or_merge_rank

    path = Path(path)
    if verify_manifest:
        verify(path, "agent")
    info = json.loads((path / "agent.json").read_text())
    if info["algorithm"] != type(agent).__name__:
        raise CheckpointError(f"checkpoint at {path} holds a {info['algorithm']} agent, not a {type(agent).__name__}")
    if info.get("base_fingerprint"):
        check_fingerprint(info["base_fingerprint"], agent.shared.model, path, shared_fingerprint(agent.shared))
    fields = {f.name for f in dataclasses.fields(agent.config)}
    cfg = {k: (tuple(v) if isinstance(v, list) else v) for k, v in info["config"].items() if k in fields}
    new_config = dataclasses.replace(agent.config, **cfg)
    try:
        if hasattr(new_config, "validate"):
            new_config.validate()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path / 'agent.json'}: invalid hyperparameters: {e}") from None
    for role in agent.ROLES:  # from the headers: nothing is allocated for tensors that do not fit
        check_adapter_tensors(agent, role, LoraConfig.from_pretrained(str(path / role_dir(role))),
                              safetensors_shapes(path / role_dir(role) / ADAPTER_WEIGHTS), path / role_dir(role))
    for name in ("optimizer.safetensors", "modules.safetensors"):
        if (path / name).exists():
            safetensors_shapes(path / name)
    meta = json.loads((path / "optimizer.json").read_text())
    check_optimizer_lrs(agent, new_config, meta, path)
    agent.lr_factor = float(meta.get("lr_factor", 1.0))
    adapters = {}
    for role in agent.ROLES:
        config, state = read_adapter(path / role_dir(role))
        check_adapter_tensors(agent, role, config, state, path / role_dir(role))
        adapters[role] = (config, state)
    for role, (config, state) in adapters.items():
        name = agent.adapter_name(role)
        state = check_or_merge_rank(agent, role, config, state, merge_lora_configs)
        agent.shared.load_state_dict(name, state)
    if (path / "modules.safetensors").exists():
        extra = load_file(str(path / "modules.safetensors"))
        with torch.no_grad():
            for key, params in agent.extra_parameters().items():
                for i, p in enumerate(params):
                    p.copy_(extra[f"{key}.{i}"])
    agent.config = new_config
    agent.quarantined = bool(info.get("quarantined", False))
    agent.quarantine_reason = info.get("quarantine_reason")
    if info.get("hp_config") is not None:
        from evollm.hpo import HyperparameterConfig
        agent.hp_config = HyperparameterConfig.from_dict(info["hp_config"])
    agent.fitness = list(info["fitness"])
    agent.scores = [s if s is not None else float("nan") for s in info["scores"]]
    agent.steps = int(info["steps"])
    agent.default_founder = bool(info.get("default_founder", agent.default_founder))
    agent.reinit_optimizers()
    tensors = load_file(str(path / "optimizer.safetensors"))
    opt_state = optimizer_from_safetensors(tensors, meta)
    if _optimizer_shapes_match(agent.optimizer, opt_state):
        agent.optimizer.load_state_dict(opt_state)
        track_fresh_directions(agent.optimizer, fresh_from_safetensors(tensors, meta))
    else:  # the adapter was resized while loading: moments no longer fit, start them afresh
        for group, saved in zip(agent.optimizer.param_groups, opt_state["param_groups"]):
            group["lr"] = saved["lr"]


def check_optimizer_lrs(agent, config, meta: dict, where: Path) -> None:
    """The learning rates saved with the optimizer must be those the member's hyperparameters give its
    param groups: a disagreement (a tampered or foreign optimizer.json) would train at another rate than
    the run reports."""
    from evollm.parallel import zero

    if zero.is_zero(agent.optimizer):
        return  # a DeepSpeed engine keeps its own groups
    try:
        old, agent.config = agent.config, config
        try:
            expected = [(g.get("name"), float(g["lr"])) for g in agent._param_groups()]
        finally:
            agent.config = old
        saved = [(g.get("name"), g.get("lr")) for g in meta["param_groups"]]
    except (AttributeError, KeyError, TypeError):
        return  # a member without per-role param groups: nothing to compare
    if len(saved) != len(expected):
        raise CheckpointError(f"checkpoint {where}: optimizer.json has {len(saved)} param groups, the member has "
                              f"{len(expected)}")
    factor = meta.get("lr_factor", 1.0)  # train.lr_cooldown, hpo.narrowing.decay / lift save their scaled rates
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0.0 <= factor < math.inf:
        raise CheckpointError(f"checkpoint {where}: optimizer.json gives lr_factor {factor!r}; valid: a finite number >= 0")
    expected = [(name, want * factor) for name, want in expected]
    for (name, want), (_, got) in zip(expected, saved):
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-6):
            raise CheckpointError(f"checkpoint {where}: optimizer.json gives param group {name!r} lr {got!r}, but "
                                  f"the member's hyperparameters give {want!r} (changed after the save?)")


def check_adapter_tensors(agent, role: str, config: LoraConfig, state: dict, where: Path) -> None:
    """Refuse an adapter whose tensors are not exactly the live adapter's (names and rank-consistent shapes)."""
    live = agent.shared.state_dict(agent.adapter_name(role))
    missing = sorted(set(live) - set(state))
    extra = sorted(set(state) - set(live))
    if missing:
        raise CheckpointError(f"checkpoint {where}: {len(missing)} of {len(live)} adapter tensors are missing "
                              f"(e.g. {missing[0]})")
    if extra:
        raise CheckpointError(f"checkpoint {where}: {len(extra)} adapter tensors this model does not have "
                              f"(e.g. {extra[0]}); was it trained on another architecture or target_modules?")
    r = int(config.r)
    same_rank = int(agent.shared.config(agent.adapter_name(role)).r) == r
    for key, value in state.items():
        if not getattr(config, "rank_pattern", None) and (
                ("lora_A" in key and value.shape[0] != r) or ("lora_B" in key and value.shape[1] != r)):
            raise CheckpointError(f"checkpoint {where}: {key} has shape {list(value.shape)}, which does not fit "
                                  f"the recorded rank r={r}")
        if same_rank and value.shape != live[key].shape:
            raise CheckpointError(f"checkpoint {where}: {key} has shape {list(value.shape)}, the model expects "
                                  f"{list(live[key].shape)}")


def _optimizer_shapes_match(optimizer, state: dict) -> bool:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, entry in state["state"].items():
        if pid >= len(params):
            return False
        for key in ("exp_avg", "exp_avg_sq"):
            if key in entry and entry[key].shape != params[pid].shape:
                return False
    return True


def base_fingerprint(model) -> dict:
    """What identifies a base model: its class, its config and a hash of a few of its weight tensors
    (first, middle and last; a strided sample of each when large)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.to_dict() if hasattr(base, "config") else {}
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "use_cache"):
        config.pop(key, None)
    named = [(n.replace(".base_layer", ""), p) for n, p in base.named_parameters() if "lora_" not in n]
    picks = [named[0], named[len(named) // 2], named[-1]] if named else []
    digest = hashlib.sha256()
    for name, p in picks:
        flat = p.detach().reshape(-1)
        if flat.numel() > 1 << 20:
            flat = flat[:: flat.numel() // (1 << 20) + 1]
        digest.update(name.encode())
        digest.update(flat.to("cpu", torch.float32).contiguous().numpy().tobytes())
    return {"architecture": type(base).__name__, "config_sha256": hashlib.sha256(
        json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "weights_sha256": digest.hexdigest(), "tensors": [n for n, _ in picks]}


def shared_fingerprint(shared) -> dict:
    """:func:`base_fingerprint` of a shared base, computed once (the base is frozen)."""
    return shared.computed_once("fingerprint", lambda: base_fingerprint(shared.model))


def check_fingerprint(saved: dict | None, model, where: Path, live: dict | None = None) -> None:
    if not saved:
        return
    live = live or base_fingerprint(model)
    for key, what in (("architecture", "architecture"), ("config_sha256", "model config"),
                      ("weights_sha256", "base weights")):
        if saved.get(key) != live[key]:
            detail = f" ({saved.get(key)} vs {live[key]})" if key == "architecture" else ""
            raise CheckpointError(f"checkpoint {where} was trained on a different base model: the {what} "
                                  f"differ{detail}; load it onto the base it was trained on")


def member_ids(values, where: Path) -> list[int]:
    """Member ids read from a checkpoint, checked to be non-negative integers before they name folders."""
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"checkpoint {where}: member id {value!r} is not a non-negative integer")
        out.append(value)
    if len(set(out)) != len(out):
        raise CheckpointError(f"checkpoint {where}: duplicate member ids {out}")
    return out
