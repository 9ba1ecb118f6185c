"""The population checkpoint: every member in the member file format of
:mod:`evollm.algorithms.checkpoint` (``member_<id>/``) plus the population record
(``population.json``), written atomically; and the load that rebuilds them on a base model."""

from __future__ import annotations

import json
from pathlib import Path

from peft import LoraConfig

from ..adapters.shared import SharedBase
from ..algorithms.checkpoint import ADAPTER_WEIGHTS, check_fingerprint, shared_fingerprint, member_ids, safetensors_shapes, \
    write_agent
from ..utils.atomic import CheckpointError, atomic_folder, jsonable, verify
from .population import Population


def save_population(agents, population, path: str | Path, extra_files=None) -> Path:
    """Every member (``member_<id>/``, as :func:`save_agent`) plus the population record
    (``population.json``: births, mutations, every measurement, member order, the ids used on the base
    and its fingerprint) the run's kept best state (``kept_best/``, when kept) and its reserve (``reserve/``), atomically.
    ``extra_files(tmp_folder)`` may add files before the manifest."""
    path = Path(path)
    with atomic_folder(path, "population") as tmp:
        for agent in agents:
            write_agent(agent, tmp / f"member_{int(agent.index)}")
        state = population.state_dict()
        state["members"] = [int(a.index) for a in agents]
        if agents:
            state["used_ids"] = agents[0].shared.used_indices()
            state["base_fingerprint"] = shared_fingerprint(agents[0].shared)
        (tmp / "population.json").write_text(json.dumps(state, indent=1, default=jsonable))
        if getattr(population, "kept", None) is not None:  # the run's best evaluated state (keep_best)
            population.kept.save(tmp)
        if getattr(population, "reserve", None) is not None:  # the runner-up parked for a stall (revive)
            population.reserve.save(tmp)
        if extra_files is not None:
            extra_files(tmp)
    return path


def read_population_state(path: Path) -> dict:
    verify(path, "population")
    return json.loads((path / "population.json").read_text())


def load_population(path: str | Path, agent_cls, actor_network, **kwargs):
    """Rebuild a saved population on ``actor_network`` (the same base model it was trained on):
    each member keeps its id, LoRA rank, adapters, optimizer state and hyperparameters.
    Returns ``(agents, population)``.

    Loading onto the very model object that trained the population works once the trained members are
    released (``for a in agents: a.release()``); while they hold their adapters it is a one-line error.
    """
    path = Path(path)
    state = read_population_state(path)
    check_fingerprint(state.get("base_fingerprint"), actor_network, path)
    ids = member_ids(state.pop("members"), path)
    shared = SharedBase.find(actor_network)
    agents = []
    for index in ids:
        member_dir = path / f"member_{index}"
        name = SharedBase.member_adapter(index)
        if shared is not None and shared.is_live(name):
            raise CheckpointError(f"member {index} of {path} is still alive on this model (adapter "
                                  f"m{index}); release the trained members first (agent.release()) or load "
                                  "onto a fresh model")
        if shared is not None:
            shared.return_index(index)  # the same member comes back; its id is not reused by another
        lora_config = LoraConfig.from_pretrained(str(member_dir / "adapter"))
        lora_config.inference_mode = False
        shapes = safetensors_shapes(member_dir / "adapter" / ADAPTER_WEIGHTS)  # before a member of rank r exists
        if not lora_config.rank_pattern and {v.shape[0] for k, v in shapes.items() if "lora_A" in k} != {lora_config.r}:
            raise CheckpointError(f"checkpoint {member_dir}: adapter_config.json says r={lora_config.r}, its tensors "
                                  "have another rank")
        agent = agent_cls(actor_network, index=index, lora_config=lora_config, **kwargs)
        agent.load_checkpoint(member_dir, verify_manifest=False)
        agents.append(agent)
    if agents:
        agents[0].shared.mark_used(state.pop("used_ids", []))
    population = Population()
    population.load_state_dict({k: v for k, v in state.items() if k not in ("used_ids", "base_fingerprint")})
    population.members = list(agents)
    return agents, population
