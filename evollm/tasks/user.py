"""A user's own task: a dataset from a file (or one saved with ``datasets``), its columns, and a
reward function by name or by dotted path.

``load_split("data/train.jsonl")`` reads JSONL, JSON, CSV, Parquet or a ``save_to_disk`` folder;
``split_dataset`` renames the question/answer columns and carves a held-out split;
``resolve_reward("mypkg.rewards:score")`` imports a reward function, ``resolve_reward("last_number")``
picks a built-in one.
"""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path
from typing import Callable

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from .rewards import (combine_rewards, exact_match_reward, format_reward, last_number_reward,
                      numeric_closeness_reward)

#: built-in reward functions by name (``task.reward`` in a config)
BUILTIN_REWARDS: dict[str, Callable] = {
    "exact_match": exact_match_reward,
    "exact_match+format": combine_rewards(exact_match_reward, format_reward),
    "last_number": last_number_reward,
    "numeric_closeness": numeric_closeness_reward,
}

_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def resolve_reward(spec: str | Callable) -> Callable:
    """A reward function from a callable, a built-in name (:data:`BUILTIN_REWARDS`) or a dotted
    path ``package.module:function`` (``package.module.function`` also works)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"task.reward must be a built-in name or 'module:function', got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec and "." not in spec:
        raise ValueError(f"task.reward={spec!r} is not valid; choose one of {sorted(BUILTIN_REWARDS)} "
                         "or give a dotted path like 'mypkg.rewards:score'")
    module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"task.reward={spec!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"task.reward={spec!r}: module {module_name!r} has no function {attr!r}")
    _check_reward_signature(fn, spec)
    return fn


def _check_reward_signature(fn: Callable, spec: str) -> None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ValueError(f"task.reward={spec!r} must take (completion, answer, question); it takes "
                         f"({', '.join(p.name for p in params)})")


def load_split(source: str | os.PathLike, split: str | None = None) -> Dataset:
    """One dataset from a JSONL/JSON/CSV/Parquet file or a ``save_to_disk`` folder (a
    ``DatasetDict`` folder needs ``split``, default ``train``)."""
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"task dataset {str(source)!r} does not exist")
    if path.is_dir():
        data = load_from_disk(str(path))
        if isinstance(data, DatasetDict):
            name = split or "train"
            if name not in data:
                raise ValueError(f"task dataset {str(source)!r} has splits {sorted(data)}, not {name!r}")
            data = data[name]
        return data
    fmt = _FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"task dataset {str(source)!r}: unknown file type {path.suffix!r}; "
                         f"use one of {sorted(_FILE_FORMATS)} or a folder written by save_to_disk")
    return load_dataset(fmt, data_files=str(path), split="train")


def rename_columns(data: Dataset, question: str = "question", answer: str = "answer") -> Dataset:
    """Rename the dataset's question/answer columns to ``question``/``answer`` (other columns are
    kept: templates and reward functions may use them)."""
    for role, column in (("question", question), ("answer", answer)):
        if column not in data.column_names:
            raise ValueError(f"task.columns.{role}={column!r} is not a column of the dataset; "
                             f"columns: {data.column_names}")
    mapping = {c: r for r, c in (("question", question), ("answer", answer)) if c != r}
    clash = [r for c, r in mapping.items() if r in data.column_names and r not in mapping]
    if clash:
        data = data.remove_columns(clash)
    return data.rename_columns(mapping) if mapping else data


def user_task(dataset: str | os.PathLike, test_dataset: str | os.PathLike | None = None,
              question_column: str = "question", answer_column: str = "answer", test_size: int | float = 0.1,
              n_train: int | None = None, n_test: int | None = None, seed: int = 0) -> tuple[Dataset, Dataset]:
    """``(train, test)`` of a user's dataset. Without ``test_dataset`` a seeded ``test_size``
    split (a fraction or a row count) of ``dataset`` is held out. ``n_train``/``n_test`` keep the
    first rows only (handy for quick runs)."""
    train = rename_columns(load_split(dataset, "train"), question_column, answer_column)
    if test_dataset is not None:
        test = rename_columns(load_split(test_dataset, "test"), question_column, answer_column)
    else:
        if len(train) < 2:
            raise ValueError(f"task dataset {str(dataset)!r} has {len(train)} rows; need 2+ to hold out a test split")
        parts = train.train_test_split(test_size=test_size, seed=seed)
        train, test = parts["train"], parts["test"]
    if n_train is not None:
        train = train.select(range(min(int(n_train), len(train))))
    if n_test is not None:
        test = test.select(range(min(int(n_test), len(test))))
    return train, test


# ---------------------------------------------------------------------- the config's task section
#: keys of the config's ``task:`` section
TASK_KEYS = ("name", "reward", "seed", "n_train", "n_test", "ops", "digits",  # built-in arithmetic
             "dataset", "test_dataset", "columns", "test_size",  # a user's dataset
             "system_prompt", "user_template", "prefill", "template",  # the prompt
             "chat_template_kwargs", "max_prompt_tokens", "long_prompts")


def task_from_config(cfg: dict, seed: int = 0):
    """``(train, test, reward_fn, template, env_kwargs)`` from a config's ``task:`` section.

    ``name: arithmetic`` (default) generates the built-in task; ``dataset:`` reads a file or a
    saved dataset instead. The prompt is ``template`` (a list of messages) or is built from
    ``system_prompt``, ``user_template`` (default ``"{question}"``) and ``prefill``.
    ``env_kwargs`` carries ``chat_template_kwargs``, ``max_prompt_tokens`` and ``long_prompts``
    to :class:`~evollm.envs.reasoning.ReasoningGym`.
    """
    from ..envs.reasoning import conversation_template

    cfg = dict(cfg)
    unknown = sorted(set(cfg) - set(TASK_KEYS))
    if unknown:
        raise ValueError(f"task: unknown key(s) {unknown}; valid keys: {list(TASK_KEYS)}")
    seed = cfg.get("seed", seed)
    name = cfg.get("name", "dataset" if "dataset" in cfg else "arithmetic")
    if name == "arithmetic":
        if "dataset" in cfg:
            raise ValueError("task: give either name: arithmetic or dataset:, not both")
        from .arithmetic import ARITHMETIC_TEMPLATE, arithmetic_dataset
        kw = {k: tuple(cfg[k]) if k in ("ops", "digits") else cfg[k]
              for k in ("n_train", "n_test", "ops", "digits") if k in cfg}
        train, test = arithmetic_dataset(seed=seed, **kw)
        default_template = ARITHMETIC_TEMPLATE
    elif name == "dataset":
        if "dataset" not in cfg:
            raise ValueError("task.name=dataset needs task.dataset (a .jsonl/.csv/.json/.parquet file or a "
                             "save_to_disk folder)")
        columns = dict(cfg.get("columns") or {})
        bad = sorted(set(columns) - {"question", "answer"})
        if bad:
            raise ValueError(f"task.columns: unknown key(s) {bad}; valid keys: ['question', 'answer']")
        train, test = user_task(cfg["dataset"], cfg.get("test_dataset"), columns.get("question", "question"),
                                columns.get("answer", "answer"), cfg.get("test_size", 0.1), cfg.get("n_train"),
                                cfg.get("n_test"), seed)
        default_template = [{"role": "user", "content": "{question}"}]
    else:
        raise ValueError(f"task.name={name!r} is not a single-turn task; valid: ['arithmetic', 'dataset']")
    if "template" in cfg:
        if any(k in cfg for k in ("system_prompt", "user_template", "prefill")):
            raise ValueError("task: give either template or system_prompt/user_template/prefill, not both")
        template = _check_template(cfg["template"])
    elif any(k in cfg for k in ("system_prompt", "user_template", "prefill")):
        template = conversation_template(cfg.get("user_template", "{question}"), cfg.get("system_prompt"),
                                         cfg.get("prefill"))
    else:
        template = default_template
    env_kwargs = {k: cfg[k] for k in ("chat_template_kwargs", "long_prompts") if k in cfg}
    if "max_prompt_tokens" in cfg:
        env_kwargs["max_context_length"] = cfg["max_prompt_tokens"]
    return train, test, resolve_reward(cfg.get("reward", "exact_match")), template, env_kwargs


def _check_template(template) -> list[dict]:
    roles = ("system", "user", "assistant")
    if not isinstance(template, list) or not template:
        raise ValueError("task.template must be a non-empty list of {role, content} messages")
    for i, m in enumerate(template):
        if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise ValueError(f"task.template[{i}] must be {{role: one of {list(roles)}, content: text}}, got {m!r}")
    return [dict(m) for m in template]
