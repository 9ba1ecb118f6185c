"""Builders: the objects a run config's sections describe (model + tokenizer, task, HPO engine)."""

from __future__ import annotations

from typing import Any

from .config import SINGLE_TURN_TASKS, ModelSection, RunConfig, TaskSection
from .schema import ConfigError


def build_model(cfg: ModelSection, seed: int, task_name: str | None = None):
    """``(model, tokenizer)`` from the model section (:func:`evollm.models.loading.load_from_config`)."""
    if cfg.source == "tiny_coop":
        from .models.coop_warm_start import load_tiny_coop_model
        return load_tiny_coop_model(warm_start=cfg.warm_start, cache_dir=cfg.cache_dir, seed=seed)
    from .models.loading import load_from_config

    return load_from_config(cfg.load_kwargs(), seed, task_name)


def build_task(cfg: TaskSection, seed: int):
    """``(train, test, reward_fn, template)`` from the task section (:func:`evollm.tasks.user.task_parts`)."""
    from .tasks.user import task_parts

    if cfg.name not in SINGLE_TURN_TASKS:
        raise ConfigError(f"task.name={cfg.name!r} is not a single-turn task; valid: {list(SINGLE_TURN_TASKS)}")
    return task_parts(cfg.name, seed=seed if cfg.seed is None else cfg.seed, reward=cfg.reward, n_train=cfg.n_train,
                      n_test=cfg.n_test, ops=cfg.ops, digits=cfg.digits, dataset=cfg.dataset,
                      test_dataset=cfg.test_dataset, test_size=cfg.test_size, columns=cfg.columns,
                      system_prompt=cfg.system_prompt, user_template=cfg.user_template, prefill=cfg.prefill,
                      template=cfg.template)


def build_hpo(cfg: RunConfig) -> tuple[Any, Any, Any]:
    """``(hp_config, mutation, selection)``; mutation and selection are ``None`` without train.evo_steps."""
    from .hpo import HyperparameterConfig

    params = {name: spec.parameter() for name, spec in cfg.hpo.hp_config.items()}
    hp_config = HyperparameterConfig(**params) if params else None
    if cfg.train.evo_steps is None:
        return hp_config, None, None
    return (hp_config, cfg.hpo.mutation.build(cfg.seed),
            cfg.hpo.selection.build(cfg.algorithm.population_size, cfg.seed))
