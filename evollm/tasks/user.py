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
def check_reward_name(spec: str) -> None:
    """Fail early (before any model is loaded) on a reward that is neither built in nor a dotted path."""
    if spec not in BUILTIN_REWARDS and (not isinstance(spec, str) or (":" not in spec and "." not in spec)):
        raise ValueError(f"task.reward={spec!r} is not valid; choose one of {sorted(BUILTIN_REWARDS)} "
                         "or give a dotted path like 'mypkg.rewards:score'")


def task_parts(name: str = "arithmetic", *, seed: int = 0, reward: str | Callable = "exact_match",
               n_train: int | None = None, n_test: int | None = None, ops=("+",), digits=(1, 2),
               dataset=None, test_dataset=None, test_size: float = 0.1, columns: dict | None = None,
               system_prompt: str | None = None, user_template: str | None = None, prefill: str | None = None,
               template: list[dict] | None = None):
    """``(train, test, reward_fn, template)`` of a single-turn task.

    ``name="arithmetic"`` generates the built-in task; ``name="dataset"`` reads ``dataset`` (see
    :func:`user_task`; ``columns`` maps ``question``/``answer`` to the dataset's column names). The
    prompt is ``template`` (a list of messages) or is built from ``system_prompt``,
    ``user_template`` (default ``"{question}"``) and ``prefill``.
    """
    from ..envs.reasoning import conversation_template

    if name == "arithmetic":
        from .arithmetic import ARITHMETIC_TEMPLATE, arithmetic_dataset
        train, test = arithmetic_dataset(n_train=2000 if n_train is None else n_train,
                                         n_test=200 if n_test is None else n_test, ops=tuple(ops),
                                         digits=tuple(digits), seed=seed)
        default_template = ARITHMETIC_TEMPLATE
    elif name == "dataset":
        columns = dict(columns or {})
        bad = sorted(set(columns) - {"question", "answer"})
        if bad:
            raise ValueError(f"task.columns: unknown key(s) {bad}; valid keys: ['question', 'answer']")
        size = int(test_size) if test_size >= 1 else float(test_size)
        train, test = user_task(dataset, test_dataset, columns.get("question", "question"),
                                columns.get("answer", "answer"), size, n_train, n_test, seed)
        default_template = [{"role": "user", "content": "{question}"}]
    else:
        raise ValueError(f"task.name={name!r} is not a single-turn task; valid: ['arithmetic', 'dataset']")
    pieces = system_prompt is not None or user_template is not None or prefill is not None
    if template is not None:
        if pieces:
            raise ValueError("task: give either template or system_prompt/user_template/prefill, not both")
        template = _check_template(template)
    elif pieces:
        template = conversation_template(user_template or "{question}", system_prompt, prefill)
    else:
        template = default_template
    return train, test, resolve_reward(reward), template


def _check_template(template) -> list[dict]:
    roles = ("system", "user", "assistant")
    if not isinstance(template, list) or not template:
        raise ValueError("task.template must be a non-empty list of {role, content} messages")
    for i, m in enumerate(template):
        if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise ValueError(f"task.template[{i}] must be {{role: one of {list(roles)}, content: text}}, got {m!r}")
    return [dict(m) for m in template]
