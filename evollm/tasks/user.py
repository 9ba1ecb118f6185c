"""A user's own task: a dataset from a file (or one saved with ``datasets``), its columns, and a
reward function by name, module path or file path.

``load_split("data/train.jsonl")`` reads JSONL, JSON, CSV, Parquet or a ``save_to_disk`` folder;
``rename_columns`` renames the question/answer columns; ``user_task`` does both and carves a held-out
split; ``resolve_reward("rewards.py:score")`` (or ``"mypkg.rewards:score"``) imports a reward function,
``resolve_reward("last_number")`` picks a built-in one. A dataset in TRL's forms (a ``prompt``
column, text or messages, or conversational ``messages``) is used as it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from ..envs.reward_call import check_signature
from .reward_spec import import_reward
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


def resolve_reward(spec: str | Callable, search_dirs=()) -> Callable:
    """A reward function from a callable, a built-in name (:data:`BUILTIN_REWARDS`), a module path
    ``package.module:function`` (``package.module.function`` also works) or a file path
    ``path/to/rewards.py:function``, looked up in ``search_dirs`` (default: the working directory) and
    on ``sys.path`` (see :mod:`evollm.tasks.reward_spec`). Per-sample ``(completion, answer, question)``
    and TRL-style batched ``(completions, **kwargs)`` functions are both accepted."""
    if callable(spec):
        check_signature(spec, "reward")
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"task.reward must be a built-in name, 'module:function' or 'file.py:function', got {spec!r}")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    check_reward_name(spec)
    return import_reward(spec, search_dirs)


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
    kept: templates and reward functions may use them). A dataset in TRL's forms (a ``prompt`` or
    ``messages`` column) needs no ``question`` column, and a TRL-style reward no ``answer``."""
    names = data.column_names
    trl_form = "prompt" in names or "messages" in names
    for role, column in (("question", question), ("answer", answer)):
        if column not in names and not (column == role and (trl_form or role == "answer")):
            raise ValueError(f"task.columns.{role}={column!r} is not a column of the dataset; "
                             f"columns: {names}")
    mapping = {c: r for r, c in (("question", question), ("answer", answer)) if c != r}
    clash = [r for c, r in mapping.items() if r in names and r not in mapping]
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
    """Fail early (before any model is loaded) on a reward that is neither built in nor a module or file path."""
    if spec not in BUILTIN_REWARDS and (not isinstance(spec, str) or (":" not in spec and "." not in spec)
                                        or spec.endswith(".py")):
        raise ValueError(f"task.reward={spec!r} is not valid; choose one of {sorted(BUILTIN_REWARDS)} "
                         "or give 'mypkg.rewards:score' or 'path/to/rewards.py:score'")


def task_parts(name: str = "arithmetic", *, seed: int = 0, reward: str | Callable = "exact_match",
               n_train: int | None = None, n_test: int | None = None, ops=("+",), digits=(1, 2),
               dataset=None, test_dataset=None, test_size: float = 0.1, columns: dict | None = None,
               system_prompt: str | None = None, user_template: str | None = None, prefill: str | None = None,
               template: list[dict] | None = None, search_dirs=()):
    """``(train, test, reward_fn, template)`` of a single-turn task.

    ``name="arithmetic"`` generates the built-in task; ``name="dataset"`` reads ``dataset`` (see
    :func:`user_task`; ``columns`` maps ``question``/``answer`` to the dataset's column names). The
    prompt is ``template`` (a list of messages) or is built from ``system_prompt``,
    ``user_template`` (default ``"{question}"``) and ``prefill``; without any of them a dataset's rows
    are prompted as :func:`evollm.envs.reasoning.prompt_messages` says (``template`` is ``None``).
    ``search_dirs``: where a reward module or file is looked for (:func:`resolve_reward`).
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
        default_template = None  # question -> one user message; TRL prompt / messages as they are
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
    return train, test, resolve_reward(reward, search_dirs), template


def check_task(train, test, reward_fn: Callable, template: list[dict] | None, rows: int = 4) -> None:
    """Check a task on its first ``rows`` rows of each split before any model is loaded: the prompt
    template's placeholders, the answer column a per-sample reward needs, and one reward call per row
    (the reference answer as the completion) that must give a finite number. Raises a one-line
    :class:`ValueError` naming the split and row."""
    from ..envs.reasoning import prompt_messages
    from ..envs.reward_call import RewardFunctionError, call_batched, call_per_sample, is_batched

    batched = is_batched(reward_fn)
    for split, data in (("train", train), ("test", test)):
        picked = []
        for i in range(min(rows, len(data))):
            row = dict(data[i])
            try:
                _, fields = prompt_messages(row, template)
            except ValueError as e:
                raise ValueError(f"task: {split} row {i}: {e}") from None
            if "answer" not in fields and not batched:
                raise ValueError(f"task: {split} row {i} has no 'answer' column (columns: {sorted(row)}); the reward "
                                 "(completion, answer, question) needs one: name it with task.columns.answer, or "
                                 "use a TRL-style reward (completions, **kwargs)")
            fields["extra"] = {k: v for k, v in fields.items() if k not in ("question", "answer", "prompt",
                                                                             "conversational")}
            fields["columns"] = row
            picked.append(fields)
        completions = ["" if f.get("answer") is None else str(f["answer"]) for f in picked]
        try:
            if batched and picked:
                call_batched(reward_fn, completions, picked)
            else:
                for i, (c, f) in enumerate(zip(completions, picked)):
                    call_per_sample(reward_fn, c, _wanted(reward_fn, f), i)
        except RewardFunctionError as e:
            raise ValueError(f"task: checking the reward on the {split} set's first rows (the reference answer as "
                             f"the completion): {e}") from None


def _wanted(fn, fields: dict) -> dict:
    from ..envs.reward_call import extra_columns_wanted

    wanted = extra_columns_wanted(fn)
    if wanted is not None:
        fields = {**fields, "extra": {k: v for k, v in fields["extra"].items() if k in wanted}}
    return fields


def _check_template(template) -> list[dict]:
    roles = ("system", "user", "assistant")
    if not isinstance(template, list) or not template:
        raise ValueError("task.template must be a non-empty list of {role, content} messages")
    for i, m in enumerate(template):
        if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise ValueError(f"task.template[{i}] must be {{role: one of {list(roles)}, content: text}}, got {m!r}")
    return [dict(m) for m in template]
