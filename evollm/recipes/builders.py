"""Builders: the objects a run config's sections describe (model + tokenizer, task, HPO engine)."""

from __future__ import annotations

from typing import Any

from ..config import SINGLE_TURN_TASKS, ConfigError, ModelSection, RunConfig, TaskSection
from ..models.loading import enable_gradient_checkpointing, load_model, load_smollm2
from ..tasks.user import task_parts
from .coop_warm_start import load_tiny_coop_model
from .multiturn_warm_start import load_tiny_multiturn_model
from .warm_start import load_tiny_model


def build_model(cfg: ModelSection, seed: int, task_name: str | None = None):
    """``(model, tokenizer)`` from the model section (:func:`load_from_config`)."""
    if cfg.source == "tiny_coop":
        return load_tiny_coop_model(warm_start=cfg.warm_start, cache_dir=cfg.cache_dir, seed=seed)
    return load_from_config(cfg.load_kwargs(), seed, task_name)


def build_task(cfg: TaskSection, seed: int):
    """``(train, test, reward_fn, template)`` from the task section (:func:`evollm.tasks.user.task_parts`)."""
    if cfg.name not in SINGLE_TURN_TASKS:
        raise ConfigError(f"task.name={cfg.name!r} is not a single-turn task; valid: {list(SINGLE_TURN_TASKS)}")
    return task_parts(cfg.name, seed=seed if cfg.seed is None else cfg.seed, reward=cfg.reward, n_train=cfg.n_train,
                      n_test=cfg.n_test, ops=cfg.ops, digits=cfg.digits, dataset=cfg.dataset,
                      test_dataset=cfg.test_dataset, test_size=cfg.test_size, columns=cfg.columns,
                      system_prompt=cfg.system_prompt, user_template=cfg.user_template, prefill=cfg.prefill,
                      template=cfg.template)


def build_hpo(cfg: RunConfig) -> tuple[Any, Any, Any]:
    """``(hp_config, mutation, selection)``; mutation and selection are ``None`` without train.evo_steps.
    ``hp_config`` is :meth:`RunConfig.hp_config` (the default search space when none is given)."""
    hp_config = cfg.hp_config()
    if cfg.train.evo_steps is None:
        return hp_config, None, None
    return (hp_config, cfg.hpo.mutation.build(cfg.seed),
            cfg.hpo.selection.build(cfg.algorithm.population_size, cfg.seed))


def build_narrowing(cfg: RunConfig):
    """The :class:`~evollm.hpo.narrowing.Narrowing` of hpo.narrowing, or ``None``: off (``at: []``), a
    population already at its minimum size, or the default schedule on a population that does not evolve
    (train.evo_steps null: its members train to the end unless hpo.narrowing is given). The minimum size
    is at least what the selection needs (a tournament's size)."""
    narrowing = cfg.hpo.narrowing.build()
    if narrowing is None or (cfg.train.evo_steps is None and not cfg.hpo.given("narrowing")):
        return None
    return narrowing if cfg.algorithm.population_size > narrowing.min_size else None


# ---------------------------------------------------------------------- the config's model section
#: keys of the config's ``model:`` section (see README "Your own model")
MODEL_KEYS = ("source", "name_or_path", "gguf_file", "dtype", "attn_implementation", "gradient_checkpointing",
              "trust_remote_code", "revision", "tokenizer", "warm_start", "cache_dir", "lora")
SOURCES = ("tiny", "tiny_multiturn", "smollm2", "hub")


def load_from_config(cfg: dict, seed: int = 0, task_name: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a config's ``model:`` section (``lora`` is read elsewhere)."""
    cfg = dict(cfg)
    unknown = sorted(set(cfg) - set(MODEL_KEYS))
    if unknown:
        raise ValueError(f"model: unknown key(s) {unknown}; valid keys: {list(MODEL_KEYS)}")
    source = cfg.get("source") or ("hub" if cfg.get("name_or_path") else "tiny")
    if source not in SOURCES:
        raise ValueError(f"model.source={source!r} is not valid; choose one of {list(SOURCES)}")
    hf = dict(dtype=cfg.get("dtype", "float32"), attn_implementation=cfg.get("attn_implementation"),
              gradient_checkpointing=bool(cfg.get("gradient_checkpointing", False)),
              trust_remote_code=bool(cfg.get("trust_remote_code", False)))
    if source in ("tiny", "tiny_multiturn"):
        if source == "tiny":
            model, tok = load_tiny_model(warm_start=cfg.get("warm_start", True), cache_dir=cfg.get("cache_dir"),
                                         seed=seed)
        else:
            if not task_name:
                raise ValueError("model.source=tiny_multiturn needs task.name (e.g. guess_number or chain_calc)")
            model, tok = load_tiny_multiturn_model(task_name, warm_start=cfg.get("warm_start", True),
                                                   cache_dir=cfg.get("cache_dir"), seed=seed)
        if hf["gradient_checkpointing"]:
            enable_gradient_checkpointing(model)
        return model, tok
    if source == "smollm2":
        return load_smollm2(cache_dir=cfg.get("cache_dir"), **hf)
    if not cfg.get("name_or_path"):
        raise ValueError("model.source=hub needs model.name_or_path (a hub id, a local folder or a .gguf file)")
    return load_model(cfg["name_or_path"], gguf_file=cfg.get("gguf_file"), revision=cfg.get("revision"),
                      tokenizer_name_or_path=cfg.get("tokenizer"), **hf)
