"""Agent checkpoints: safetensors + JSON only (no pickle anywhere).

Layout of ``save_agent(agent, path)``::

    path/adapter/            PEFT adapter dir (adapter_config.json + adapter_model.safetensors),
                             loadable with ``PeftModel.from_pretrained(base, path/adapter)``
    path/<role>/             further adapters (e.g. ``critic``), same format
    path/modules.safetensors extra trainable modules (e.g. a value head), if any
    path/optimizer.safetensors + optimizer.json   optimizer state and param groups
    path/agent.json          class, id, hyperparameters, hp_config, fitness and step counters
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

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
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def read_adapter(directory: Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    config = LoraConfig.from_pretrained(str(directory))
    return config, load_file(str(directory / ADAPTER_WEIGHTS))


def optimizer_to_safetensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().contiguous().clone()
            else:
                scalars[f"{pid}.{key}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_safetensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
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


def _jsonable(value):
    if dataclasses.is_dataclass(value):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and value != value:
        return None
    return value


def save_agent(agent, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for role in agent.ROLES:
        save_adapter(agent.shared, agent.adapter_name(role), path / role_dir(role))
    extra = {f"{key}.{i}": p.detach().contiguous().clone()
             for key, params in agent._extra_parameters().items() for i, p in enumerate(params)}
    if extra:
        save_file(extra, str(path / "modules.safetensors"))
    tensors, meta = optimizer_to_safetensors(agent.optimizer)
    save_file(tensors, str(path / "optimizer.safetensors"))
    (path / "optimizer.json").write_text(json.dumps(meta, indent=1))
    info = {
        "algorithm": type(agent).__name__,
        "index": agent.index,
        "config": _jsonable(agent.config),
        "hp_config": agent.hp_config.to_dict() if agent.hp_config is not None else None,
        "fitness": agent.fitness,
        "scores": [_jsonable(s) for s in agent.scores],
        "steps": agent.steps,
    }
    (path / "agent.json").write_text(json.dumps(info, indent=1))
    return path


def load_agent(agent, path: str | Path, merge_lora_configs: bool = False) -> None:
    """Load a checkpoint written by :func:`save_agent` into a live member (on its shared base)."""
    from .adapters.resize import check_or_merge_rank

    path = Path(path)
    info = json.loads((path / "agent.json").read_text())
    if info["algorithm"] != type(agent).__name__:
        raise ValueError(f"checkpoint at {path} holds a {info['algorithm']} agent, not a {type(agent).__name__}")
    for role in agent.ROLES:
        config, state = read_adapter(path / role_dir(role))
        name = agent.adapter_name(role)
        state = check_or_merge_rank(agent, role, config, state, merge_lora_configs)
        agent.shared.load_state_dict(name, state)
    if (path / "modules.safetensors").exists():
        extra = load_file(str(path / "modules.safetensors"))
        with torch.no_grad():
            for key, params in agent._extra_parameters().items():
                for i, p in enumerate(params):
                    p.copy_(extra[f"{key}.{i}"])
    fields = {f.name for f in dataclasses.fields(agent.config)}
    cfg = {k: (tuple(v) if isinstance(v, list) else v) for k, v in info["config"].items() if k in fields}
    agent.config = dataclasses.replace(agent.config, **cfg)
    if info.get("hp_config") is not None:
        from .hpo import HyperparameterConfig
        agent.hp_config = HyperparameterConfig.from_dict(info["hp_config"])
    agent.fitness = list(info["fitness"])
    agent.scores = [s if s is not None else float("nan") for s in info["scores"]]
    agent.steps = int(info["steps"])
    agent.reinit_optimizers()
    opt_state = optimizer_from_safetensors(load_file(str(path / "optimizer.safetensors")),
                                           json.loads((path / "optimizer.json").read_text()))
    if _optimizer_shapes_match(agent.optimizer, opt_state):
        agent.optimizer.load_state_dict(opt_state)
    else:  # the adapter was resized while loading: moments no longer fit, start them afresh
        for group, saved in zip(agent.optimizer.param_groups, opt_state["param_groups"]):
            group["lr"] = saved["lr"]


def _optimizer_shapes_match(optimizer, state: dict) -> bool:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, entry in state["state"].items():
        if pid >= len(params):
            return False
        for key in ("exp_avg", "exp_avg_sq"):
            if key in entry and entry[key].shape != params[pid].shape:
                return False
    return True


def save_population(agents, population, path: str | Path) -> Path:
    """Every member (``member_<id>/``, as :func:`save_agent`) plus the population record
    (``population.json``: births, mutations, every measurement, member order)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for agent in agents:
        save_agent(agent, path / f"member_{agent.index}")
    state = population.state_dict()
    state["members"] = [a.index for a in agents]
    (path / "population.json").write_text(json.dumps(state, indent=1, default=_jsonable))
    return path


def load_population(path: str | Path, agent_cls, actor_network, **kwargs):
    """Rebuild a saved population on ``actor_network`` (the same base model it was trained on):
    each member keeps its id, LoRA rank, adapters, optimizer state and hyperparameters.
    Returns ``(agents, population)``."""
    from .population import Population

    path = Path(path)
    state = json.loads((path / "population.json").read_text())
    agents = []
    for index in state.pop("members"):
        member_dir = path / f"member_{index}"
        lora_config = LoraConfig.from_pretrained(str(member_dir / "adapter"))
        lora_config.inference_mode = False
        agent = agent_cls(actor_network, index=index, lora_config=lora_config, **kwargs)
        agent.load_checkpoint(member_dir)
        agents.append(agent)
    population = Population()
    population.load_state_dict(state)
    population.members = list(agents)
    return agents, population
