"""Everything besides the members that a run needs to continue exactly: RNG states (torch, numpy,
python), the mutation and selection generators, the env's data position, the loop's step and the
train rewards since the last evaluation. JSON + safetensors only."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from evollm.utils.atomic import CheckpointError, save_tensors

RUN_STATE = "run_state.json"
TORCH_RNG = "rng_torch.safetensors"


def capture_rng() -> tuple[dict, dict[str, torch.Tensor]]:
    """``(json_part, tensors)`` of the python, numpy and torch (CPU + every CUDA device) generators."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    return ({"python": [version, list(internal), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}, tensors)


def restore_rng(state: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])


def _state_of(obj) -> Any:
    return obj.state_dict() if obj is not None and hasattr(obj, "state_dict") else None


def write_run_state(folder: Path, *, step: int, max_steps: int, seed: int, since_eval: dict, env=None,
                    mutation=None, selection=None, config: dict | None = None,
                    healthy_members: int | None = None, narrowing=None) -> None:
    """The loop/run part of a checkpoint, into ``folder`` (called before the manifest is written).
    ``healthy_members``: how many members were not quarantined (rotation keeps a healthy checkpoint)."""
    rng, tensors = capture_rng()
    state = {"step": int(step), "max_steps": int(max_steps), "seed": int(seed), "healthy_members": healthy_members,
             "since_eval": {str(k): list(v) for k, v in since_eval.items()}, "rng": rng,
             "env": _state_of(env), "mutation": _state_of(mutation), "selection": _state_of(selection),
             "narrowing": _state_of(narrowing), "config": config}
    (folder / RUN_STATE).write_text(json.dumps(state, indent=1))
    save_tensors({k: v.contiguous() for k, v in tensors.items()}, str(folder / TORCH_RNG))


def read_run_state(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    path = folder / RUN_STATE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {RUN_STATE}: it is a population checkpoint, not a run "
                              "checkpoint (load it with evollm.run.population_checkpoint.load_population)")
    state = json.loads(path.read_text())
    if not isinstance(state.get("step"), int) or state["step"] < 0:
        raise CheckpointError(f"checkpoint {folder}: {RUN_STATE} has step {state.get('step')!r}, not an integer >= 0")
    return state, load_file(str(folder / TORCH_RNG))


def restore_components(state: dict, env=None, mutation=None, selection=None, where: Path | None = None,
                       narrowing=None) -> None:
    """Put the env, mutation and selection generators back where the checkpoint left them."""
    for name, obj in (("env", env), ("mutation", mutation), ("selection", selection), ("narrowing", narrowing)):
        saved = state.get(name)
        if obj is None:
            continue
        if saved is None:
            if hasattr(obj, "load_state_dict"):
                raise CheckpointError(f"checkpoint {where}: no {name} state saved, but this run has a {name}; "
                                      "resume with the settings the run was started with")
            continue
        if not hasattr(obj, "load_state_dict"):
            raise CheckpointError(f"checkpoint {where}: the {name} ({type(obj).__name__}) cannot restore its state "
                                  "(no load_state_dict)")
        try:
            obj.load_state_dict(saved)
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint {where}: cannot restore the {name}: {e}") from e


def since_eval_from(state: dict) -> dict[int, list[float]]:
    return {int(k): [float(x) if x is not None else float("nan") for x in v]
            for k, v in state.get("since_eval", {}).items()}
