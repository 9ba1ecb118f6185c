"""Run configuration: a YAML file read into dataclasses, then small builders that
turn each section into objects (model, task, env, population, HPO).

Sections (all optional except ``algorithm``)::

    seed: 0
    output_dir: runs/demo
    model:     {source: tiny, warm_start: true, cache_dir: null}    # or {name_or_path: ..., dtype: bfloat16}
    task:      {name: arithmetic, n_train: 2000, n_test: 200, ops: ["+"], digits: [1, 2],
                reward: exact_match}                                   # or exact_match+format
    env:       {type: reasoning, data_batch_size_per_gpu: 8, max_context_length: null}
    algorithm: {name: GRPO, population_size: 4, lora: {r: 8, lora_alpha: 16},
                hyperparameters: {lr: 1.0e-4, group_size: 8, ...}, init_sampler: null}
    hpo:       {hp_config: {lr: {min: 1.0e-5, max: 1.0e-3, log: true}},
                mutation: {no_mutation: 0.4, rl_hp: 0.6}, selection: {type: tournament, tournament_size: 2}}
    train:     {max_steps: 60, evaluation_interval: 10, evo_steps: 20}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SECTIONS = ("seed", "output_dir", "threads", "model", "task", "env", "algorithm", "hpo", "train")


@dataclass
class RunConfig:
    algorithm: dict
    seed: int = 0
    output_dir: str = "runs/evollm"
    threads: int | None = None  # torch CPU threads; None keeps torch's default
    model: dict = field(default_factory=lambda: {"source": "tiny", "warm_start": True})
    task: dict = field(default_factory=lambda: {"name": "arithmetic"})
    env: dict = field(default_factory=lambda: {"type": "reasoning"})
    hpo: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> "RunConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        for item in overrides or []:
            _apply_override(data, item)
        unknown = sorted(set(data) - set(SECTIONS))
        if unknown:
            raise ValueError(f"{path}: unknown top-level key(s) {unknown}; valid keys: {list(SECTIONS)}")
        if "algorithm" not in data:
            raise ValueError(f"{path}: the 'algorithm' section is required (e.g. algorithm: {{name: GRPO}})")
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _apply_override(data: dict, item: str) -> None:
    """``train.max_steps=10`` style override; the value is parsed as YAML."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like section.key=value")
    key, value = item.split("=", 1)
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = yaml.safe_load(value)


def build_model(cfg: dict, seed: int, task_name: str | None = None):
    """``(model, tokenizer)`` from the model section."""
    cfg = dict(cfg)
    source = cfg.get("source", "tiny" if "name_or_path" not in cfg else "hub")
    if source == "tiny":
        from .models.warm_start import load_tiny_model
        return load_tiny_model(warm_start=cfg.get("warm_start", True), cache_dir=cfg.get("cache_dir"), seed=seed)
    if source == "tiny_multiturn":
        from .models.multiturn_warm_start import load_tiny_multiturn_model
        if not task_name:
            raise ValueError("model.source=tiny_multiturn needs task.name (e.g. guess_number or chain_calc)")
        return load_tiny_multiturn_model(task_name, warm_start=cfg.get("warm_start", True),
                                         cache_dir=cfg.get("cache_dir"), seed=seed)
    if source == "tiny_coop":
        from .models.coop_warm_start import load_tiny_coop_model
        return load_tiny_coop_model(warm_start=cfg.get("warm_start", True), cache_dir=cfg.get("cache_dir"), seed=seed)
    if "name_or_path" not in cfg:
        raise ValueError(f"model.source={source!r} is not valid; choose one of ['tiny', 'tiny_multiturn', 'tiny_coop'] "
                         "or give model.name_or_path")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = cfg["name_or_path"]
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    tokenizer = AutoTokenizer.from_pretrained(name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    return model, tokenizer


def build_task(cfg: dict, seed: int):
    """``(train, test, reward_fn, template)`` from the task section."""
    from . import tasks

    cfg = dict(cfg)
    name = cfg.pop("name", "arithmetic")
    reward = cfg.pop("reward", "exact_match")
    if name != "arithmetic":
        raise ValueError(f"task.name={name!r} is not a single-turn task; valid: ['arithmetic']")
    if "ops" in cfg:
        cfg["ops"] = tuple(cfg["ops"])
    if "digits" in cfg:
        cfg["digits"] = tuple(cfg["digits"])
    train, test = tasks.arithmetic_dataset(seed=cfg.pop("seed", seed), **cfg)
    rewards = {"exact_match": tasks.exact_match_reward,
               "exact_match+format": tasks.combine_rewards(tasks.exact_match_reward, tasks.format_reward)}
    if reward not in rewards:
        raise ValueError(f"task.reward={reward!r} is not valid; choose one of {sorted(rewards)}")
    return train, test, rewards[reward], tasks.ARITHMETIC_TEMPLATE


def build_hpo(cfg: dict, population_size: int, seed: int) -> tuple[Any, Any, Any]:
    """``(hp_config, mutation, selection)`` from the hpo section (``None``s when absent)."""
    from .hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection, TruncationSelection

    if not cfg:
        return None, None, None
    params = {}
    for name, spec in (cfg.get("hp_config") or {}).items():
        spec = dict(spec)
        if isinstance(spec.get("dtype"), str) and spec["dtype"] in ("int", "float"):
            spec["dtype"] = {"int": int, "float": float}[spec["dtype"]]
        params[name] = RLParameter(**spec)
    hp_config = HyperparameterConfig(**params) if params else None
    mutation = Mutations(**{"rand_seed": seed, **(cfg.get("mutation") or {})})
    sel = dict(cfg.get("selection") or {"type": "tournament", "tournament_size": 2})
    kind = sel.pop("type", "tournament")
    sel.setdefault("rand_seed", seed)
    if kind == "tournament":
        sel.setdefault("tournament_size", 2)
        selection = TournamentSelection(population_size=population_size, **sel)
    elif kind == "truncation":
        selection = TruncationSelection(population_size=population_size, **sel)
    else:
        raise ValueError(f"hpo.selection.type={kind!r} is not valid; choose one of ['tournament', 'truncation']")
    return hp_config, mutation, selection
