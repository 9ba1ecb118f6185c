"""ReasoningGym: single-turn question/answer episodes scored by a reward function.

``reset()`` gives a batch of tokenised prompts; ``step(completions)`` scores the
completions for that batch (``[batch, group]`` rewards) and moves to the next batch.
Evaluation always uses the same fixed test prompts, so two members are compared on
identical work.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Sequence

import numpy as np
import torch

from .reward_call import (RewardFunctionError, call_batched, call_per_sample, check_signature,
                          extra_columns_wanted, is_batched, with_timeout)

class DatasetColumnsError(ValueError, AssertionError):
    """A dataset row lacks the columns a prompt or a reward needs (an ``AssertionError`` too, as in AgileRL)."""


__all__ = ["ReasoningGym", "RewardFunctionError", "conversation_template", "prompt_messages", "render_prompt"]


class _Fields(dict):
    def __missing__(self, key):
        raise ValueError(f"the prompt template uses {{{key}}}, which is not a dataset column; "
                         f"columns: {sorted(self)} (write {{{{ and }}}} for literal braces)")


def fill_template(template: Sequence[dict], fields: dict) -> list[dict]:
    """The template's messages with every ``{column}`` filled from ``fields`` (``str.format`` rules)."""
    fields = _Fields(fields)
    return [{**m, "content": str(m["content"]).format_map(fields)} for m in template]


def _is_messages(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value)


def prompt_messages(row: dict, template: Sequence[dict] | None) -> tuple[list[dict] | str, dict]:
    """The prompt of one dataset row and the row as the reward sees it.

    Returns ``(messages or raw text, fields)``; ``fields`` holds ``question`` (and ``answer`` when the
    row has one), ``prompt`` (what a TRL-style reward receives as ``prompts``) and ``conversational``.
    A row may be

    * question/answer (``question`` column): the template's ``{question}``, ``{answer}``, ``{column}``
      placeholders are filled (default template: one user message ``{question}``);
    * TRL standard (``prompt`` column holding text): without a template the text is the prompt as it is
      (no chat template, as TRL); with one, ``{prompt}`` or ``{question}`` is that text;
    * conversational (``prompt`` holding a list of messages, or ``messages``, whose final assistant
      message, if any, is the reference answer): the messages as they are, after the template's system
      message (when the row has none) and before its prefill (a final assistant message).
    """
    row = dict(row)
    conv_key = next((k for k in ("prompt", "messages") if _is_messages(row.get(k))), None)
    if conv_key is not None:
        messages = [dict(m) for m in row[conv_key]]
        if conv_key == "messages" and messages[-1]["role"] == "assistant":
            row.setdefault("answer", messages.pop()["content"])
        users = [m["content"] for m in messages if m["role"] == "user"]
        row.setdefault("question", users[-1] if users else "")
        original = [dict(m) for m in messages]
        tpl = list(template or [])
        if tpl and tpl[0]["role"] == "system" and messages[0]["role"] != "system":
            messages = fill_template(tpl[:1], row) + messages
        if len(tpl) > 1 and tpl[-1]["role"] == "assistant":
            messages = messages + fill_template(tpl[-1:], row)
        row.update(prompt=original, conversational=True)
        return messages, row
    if "question" not in row and isinstance(row.get("prompt"), str):
        row["question"] = row["prompt"]
        if template is None:
            return row["prompt"], {**row, "conversational": False}
    if "question" not in row:
        raise ValueError(f"needs a 'question' column (or TRL's 'prompt', or conversational 'messages'); "
                         f"its columns: {sorted(row)}")
    messages = fill_template(template or [{"role": "user", "content": "{question}"}], row)  # the row's own columns
    row.setdefault("prompt", row["question"])
    row["conversational"] = False
    return messages, row


def render_prompt(tokenizer, template: Sequence[dict], fields: dict, chat_template_kwargs: dict | None = None) -> str:
    """The prompt text of one dataset row: every ``{column}`` in the template's message contents
    is filled from ``fields`` (``str.format`` rules), then the tokenizer's chat template is applied.
    A final ``assistant`` message is a prefill that the completion continues
    (``continue_final_message``); otherwise a generation prompt opens the assistant turn. Without a
    chat template the message contents are joined by newlines."""
    return render_messages(tokenizer, fill_template(template, fields), chat_template_kwargs)


def render_messages(tokenizer, messages: Sequence[dict] | str, chat_template_kwargs: dict | None = None) -> str:
    """Prompt text of ``messages`` (see :func:`render_prompt`); a string is a raw prompt, used as it is."""
    if isinstance(messages, str):
        return messages
    messages = list(messages)
    if not getattr(tokenizer, "chat_template", None):
        return "\n".join(m["content"] for m in messages)
    prefill = bool(messages) and messages[-1]["role"] == "assistant"
    kwargs = dict(chat_template_kwargs or {})
    kwargs.setdefault("add_generation_prompt", not prefill)
    kwargs.setdefault("continue_final_message", prefill)
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def conversation_template(user: str = "{question}", system_prompt: str | None = None,
                          prefill: str | None = None) -> list[dict]:
    """A conversation template: an optional system message, the user message and an optional
    assistant prefill (text the model's answer continues, e.g. ``"The answer is "``)."""
    template = [{"role": "system", "content": system_prompt}] if system_prompt else []
    template.append({"role": "user", "content": user})
    if prefill:
        template.append({"role": "assistant", "content": prefill})
    return template


class ReasoningGym:
    """Dataset-backed single-turn environment.

    Args:
        train_dataset, test_dataset: datasets (or lists of dicts) in any of the forms of
            :func:`prompt_messages`: ``question``/``answer`` columns, TRL's ``prompt`` (text or a list
            of messages) or conversational ``messages``; every other column is kept for templates and
            rewards.
        tokenizer: any Hugging Face tokenizer.
        reward_fn: per sample, ``reward_fn(completion, answer, question) -> float`` (``answer`` and
            ``question`` are the dataset's own values; a function that takes other columns by name,
            or ``**kwargs``, receives them too); or TRL-style batched,
            ``reward_fn(completions, **kwargs) -> list[float]`` (see :mod:`evollm.envs.reward_call`).
        conversation_template: messages whose contents may contain ``{question}``, ``{answer}`` or
            any other column; a final ``assistant`` message is continued by the completion (see
            :func:`conversation_template`). ``None``: one user message ``{question}``, a TRL text
            prompt as it is, a conversational prompt's own messages.
        data_batch_size_per_gpu: prompts per training batch.
        max_context_length: prompts with more tokens are dropped with a warning (or rejected, see
            ``long_prompts``).
        long_prompts: ``"filter"`` (default: drop over-long prompts, warn once per split) or
            ``"raise"``.
        chat_template_kwargs: extra ``apply_chat_template`` options (e.g. ``{"enable_thinking": False}``).
        seed: shuffling seed of the training stream.
        reward_timeout: seconds one reward call may take (``None``: no limit); a call still running then
            fails like a reward that raised (:func:`evollm.envs.reward_call.with_timeout`).
        accelerator, return_raw_completions: AgileRL's keywords, accepted. Multi-process runs shard
            each batch themselves (``accelerator`` has no effect) and every prompt carries its text.

    AgileRL's attributes are kept: ``name``, ``num_epochs``, ``data_batch_size_per_gpu``,
    ``reset_called``, ``evaluation_mode`` and :meth:`eval_mode`, ``questions``/``answers``/
    ``last_tokenized_prompts`` of the current batch.
    """

    def __init__(self, train_dataset, test_dataset, tokenizer, reward_fn: Callable[..., float],
                 conversation_template: Sequence[dict] | None = None, data_batch_size_per_gpu: int = 8,
                 max_context_length: int | None = None, seed: int = 42, eval_batch_size: int = 64,
                 long_prompts: str = "filter", chat_template_kwargs: dict | None = None, accelerator=None,
                 return_raw_completions: bool = False, reward_timeout: float | None = None):
        if data_batch_size_per_gpu < 1:
            raise ValueError(f"data_batch_size_per_gpu must be >= 1, got {data_batch_size_per_gpu}")
        if long_prompts not in ("filter", "raise"):
            raise ValueError(f"long_prompts={long_prompts!r} is not valid; choose 'filter' or 'raise'")
        self.tokenizer = tokenizer
        self.name = getattr(getattr(train_dataset, "info", None), "dataset_name", None) or type(self).__name__
        self.accelerator = accelerator
        self.return_raw_completions = bool(return_raw_completions)
        self.data_batch_size_per_gpu = int(data_batch_size_per_gpu)
        self.reset_called = False
        self.evaluation_mode = False
        self._eval_cursor = 0
        self._eval_current: list[dict] | None = None
        if not callable(reward_fn):
            raise ValueError(f"reward_fn must be a function, got {type(reward_fn).__name__}")
        check_signature(reward_fn)
        self.reward_fn = with_timeout(reward_fn, reward_timeout)
        self.batched_reward = is_batched(reward_fn)
        self._reward_extra = extra_columns_wanted(reward_fn)
        self.template = None if conversation_template is None else list(conversation_template)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.batch_size = int(data_batch_size_per_gpu)
        self.max_context_length = max_context_length
        self.long_prompts = long_prompts
        self.eval_batch_size = int(eval_batch_size)
        self.seed = seed
        self.train = self._encode(train_dataset, "train")
        self.test_set = self._encode(test_dataset, "test")
        if len(self.train) < self.batch_size:
            warnings.warn(f"train_dataset has {len(self.train)} usable rows, fewer than data_batch_size_per_gpu="
                          f"{self.batch_size}: every batch is the whole dataset", stacklevel=2)
            self.batch_size = len(self.train)
        self._rng = np.random.default_rng(seed)
        self._order = self._rng.permutation(len(self.train))
        self._cursor = 0
        self.epoch = 0
        self._current: list[dict] | None = None

    # ------------------------------------------------------------------ data
    def _encode(self, dataset, split: str) -> list[dict]:
        rows, too_long = [], []
        for i, row in enumerate(dataset):
            try:
                messages, fields = prompt_messages(row, self.template)
            except ValueError as e:
                raise DatasetColumnsError(f"{split} row {i}: {e} (AgileRL-style datasets have 'question' and "
                                          "'answer' features)") from None
            if "answer" not in fields and not self.batched_reward:
                raise DatasetColumnsError(f"{split} row {i} has no 'answer' column (columns: {sorted(dict(row))}); a reward "
                                 "(completion, answer, question) needs one (task.columns.answer names it), a "
                                 "TRL-style reward (completions, **kwargs) does not")
            text = render_messages(self.tokenizer, messages, self.chat_template_kwargs)
            ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            if self.max_context_length is not None and ids.shape[1] > self.max_context_length:
                if self.long_prompts == "raise":
                    raise ValueError(f"{split} row {i}: prompt has {ids.shape[1]} tokens, more than "
                                     f"max_context_length={self.max_context_length}")
                too_long.append(ids.shape[1])
                continue
            columns = {k: v for k, v in dict(row).items()}
            columns.setdefault("question", fields["question"])
            if "answer" in fields:
                columns.setdefault("answer", fields["answer"])
            rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "question": fields["question"],
                         "answer": fields.get("answer"), "text": text, "prompt": fields["prompt"],
                         "conversational": fields["conversational"],
                         "extra": _extra_fields(fields, self._reward_extra),
                         "columns": columns if self.batched_reward else {}})
        if too_long:
            warnings.warn(f"{split}: dropped {len(too_long)} of {len(too_long) + len(rows)} prompts longer than "
                          f"env.max_context_length={self.max_context_length} tokens (longest {max(too_long)}): "
                          f"{len(too_long)} samples were filtered out of the {split} dataset due to the max "
                          "context length constraint.", stacklevel=3)
        if not rows:
            if too_long:
                raise ValueError(f"{split} dataset is empty after dropping over-long prompts: all {len(too_long)} "
                                 f"are longer than env.max_context_length={self.max_context_length} tokens "
                                 f"(shortest {min(too_long)}, longest {max(too_long)}); raise "
                                 "env.max_context_length")
            raise ValueError(f"{split} dataset is empty")
        return rows

    def longest_prompt(self) -> int:
        """Tokens in the longest prompt (train or test): with ``max_output_tokens`` it must fit an
        agent's ``max_model_len``."""
        return max(r["input_ids"].shape[1] for r in self.train + self.test_set)

    def _next_batch(self) -> list[dict]:
        if self._cursor + self.batch_size > len(self._order):
            self._order = self._rng.permutation(len(self.train))
            self._cursor = 0
            self.epoch += 1
        idx = self._order[self._cursor:self._cursor + self.batch_size]
        self._cursor += self.batch_size
        return [self.train[int(i)] for i in idx]

    def _next_test_batch(self) -> list[dict]:
        if self._eval_cursor >= len(self.test_set):
            self._eval_cursor = 0
        batch = self.test_set[self._eval_cursor:self._eval_cursor + self.data_batch_size_per_gpu]
        self._eval_cursor += len(batch)
        return batch

    # ------------------------------------------------------------------ gym-style API
    def reset(self, reset_dataloaders: bool = False) -> list[dict]:
        """The current batch of prompts (a new one on the first call; a test batch in :meth:`eval_mode`).
        Calling it twice without a ``step`` in between warns, as AgileRL's does."""
        if reset_dataloaders:
            self._rng = np.random.default_rng(self.seed)
            self._order = self._rng.permutation(len(self.train))
            self._cursor, self.epoch = 0, 0
            self._current, self._eval_current, self._eval_cursor = None, None, 0
        if self.reset_called:
            warnings.warn("env.reset() called more than once sequentially, it should typically follow with "
                          "env.step() (evollm returns the same batch again)", stacklevel=2)
        self.reset_called = True
        return self._batch()

    def _batch(self) -> list[dict]:
        if self.evaluation_mode:
            if self._eval_current is None:
                self._eval_current = self._next_test_batch()
            return self._eval_current
        if self._current is None:
            self._current = self._next_batch()
        return self._current

    def score(self, completions, prompts: Sequence[dict] | None = None) -> torch.Tensor:
        """Rewards ``[batch, group]`` for completions of ``prompts`` (default: the current batch),
        without advancing. ``completions``: per prompt, a ``[G, L]`` id tensor as returned by an
        agent's ``get_action`` (left-padded prompt + completion) or a list of strings."""
        prompts = self._batch() if prompts is None else prompts
        texts = self.decode(completions, prompts)
        return torch.tensor(self.rewards(texts, prompts), dtype=torch.float32)

    def rewards(self, texts: Sequence[Sequence[str]], prompts: Sequence[dict]) -> list[list[float]]:
        """Rewards of decoded completions, ``texts[i]`` answering ``prompts[i]`` (one batched call of a
        TRL-style reward, or one call per sample)."""
        if not self.batched_reward:
            return [[call_per_sample(self.reward_fn, t, p, i) for t in group]
                    for i, (group, p) in enumerate(zip(texts, prompts))]
        flat = [t for group in texts for t in group]
        rows = [p for group, p in zip(texts, prompts) for _ in group]
        values = call_batched(self.reward_fn, flat, rows) if flat else []
        out, k = [], 0
        for group in texts:
            out.append(values[k:k + len(group)])
            k += len(group)
        return out

    def step(self, completions) -> tuple[list[dict], torch.Tensor]:
        """Score the current batch, then move on. Returns ``(next_prompts, rewards [batch, group])``."""
        rewards = self.score(completions)
        if self.evaluation_mode:
            self.reset_called = False
            self._eval_current = self._next_test_batch()
            return self._eval_current, rewards
        return self.step_to_next_batch(), rewards

    def step_to_next_batch(self) -> list[dict]:
        """Move to the next training batch (used when several members answered the current one)."""
        self.reset_called = False
        self._current = self._next_batch()
        return self._current

    # ------------------------------------------------------------------ AgileRL's names
    @contextlib.contextmanager
    def eval_mode(self):
        """Within the block, ``reset``/``step`` walk the test set in batches of
        ``data_batch_size_per_gpu`` (from its start; epochs are not counted) and ``len()`` is the test
        set's; the training batch and its position are restored afterwards."""
        saved = (self.evaluation_mode, self.reset_called, self._eval_current, self._eval_cursor)
        self.evaluation_mode, self.reset_called, self._eval_current, self._eval_cursor = True, False, None, 0
        try:
            yield self
        finally:
            self.evaluation_mode, self.reset_called, self._eval_current, self._eval_cursor = saved

    @property
    def num_epochs(self) -> int:
        """Completed passes over the training set (AgileRL's name of ``epoch``)."""
        return self.epoch

    @property
    def last_tokenized_prompts(self) -> list[dict] | None:
        return self._eval_current if self.evaluation_mode else self._current

    @property
    def questions(self) -> list:
        return [p["question"] for p in self.last_tokenized_prompts or []]

    @property
    def answers(self) -> list:
        return [p["answer"] for p in self.last_tokenized_prompts or []]

    def test_prompts(self) -> list[dict]:
        """The fixed evaluation prompts (identical on every call)."""
        return self.test_set

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Where the training stream is (JSON): shuffling generator, order, position, epoch, current batch.
        The evaluation prompts are fixed, so they have no state."""
        current = None
        if self._current is not None:
            current = [int(i) for i in self._order[self._cursor - self.batch_size:self._cursor]]
        return {"rng": self._rng.bit_generator.state, "order": [int(i) for i in self._order],
                "cursor": self._cursor, "epoch": self.epoch, "current": current, "train_rows": len(self.train)}

    def load_state_dict(self, state: dict) -> None:
        """Continue the training stream exactly where :meth:`state_dict` left it."""
        if state["train_rows"] != len(self.train):
            raise ValueError(f"env state is for {state['train_rows']} training rows, this env has {len(self.train)}")
        self._rng.bit_generator.state = state["rng"]
        self._order = np.asarray(state["order"], dtype=np.int64)
        self._cursor, self.epoch = int(state["cursor"]), int(state["epoch"])
        self._current = None if state["current"] is None else [self.train[int(i)] for i in state["current"]]

    # ------------------------------------------------------------------ helpers
    def decode(self, completions, prompts: Sequence[dict]) -> list[list[str]]:
        if len(completions) != len(prompts):
            raise ValueError(f"got completions for {len(completions)} prompts, expected {len(prompts)}")
        width = max(p["input_ids"].shape[1] for p in prompts)
        out = []
        for group, p in zip(completions, prompts):
            if isinstance(group, (list, tuple)) and group and isinstance(group[0], str):
                out.append(list(group))
                continue
            group = torch.as_tensor(group)
            if group.dim() == 1:
                group = group.unsqueeze(0)
            n = p["input_ids"].shape[1]
            if group.shape[1] >= width and torch.equal(group[0, width - n:width].cpu(), p["input_ids"][0]):
                start = width  # left-padded to the batch's longest prompt (get_action)
            elif group.shape[1] >= n and torch.equal(group[0, :n].cpu(), p["input_ids"][0]):
                start = n  # this prompt alone, then the completion (AgileRL's layout)
            else:  # AgileRL's contract: the first (prompt length) ids are the prompt's, whatever they hold
                start = n
            out.append([self._decode_completion(row[start:]) for row in group])
        return out

    def _decode_completion(self, ids: torch.Tensor) -> str:
        eos = self.tokenizer.eos_token_id
        ids = ids.tolist()
        if eos is not None and eos in ids:
            ids = ids[:ids.index(eos)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __len__(self) -> int:
        return len(self.test_set if self.evaluation_mode else self.train)


def _extra_fields(row, wanted: tuple[str, ...] | None) -> dict:
    if wanted is None:
        return {k: v for k, v in dict(row).items() if k not in ("question", "answer", "prompt", "conversational")}
    return {k: row[k] for k in wanted if k in row}
