"""ReasoningGym: single-turn question/answer episodes scored by a reward function.

``reset()`` gives a batch of tokenised prompts; ``step(completions)`` scores the
completions for that batch (``[batch, group]`` rewards) and moves to the next batch.
Evaluation always uses the same fixed test prompts, so two members are compared on
identical work.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not a finite number."""


def _render(tokenizer, template: Sequence[dict], question: str) -> str:
    messages = [{"role": m["role"], "content": m["content"].format(question=question)} for m in template]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages)


class ReasoningGym:
    """Dataset-backed single-turn environment.

    Args:
        train_dataset, test_dataset: datasets (or lists of dicts) with ``question`` and ``answer``.
        tokenizer: any Hugging Face tokenizer.
        reward_fn: ``reward_fn(completion, answer, question) -> float``.
        conversation_template: messages whose contents may contain ``{question}``.
        data_batch_size_per_gpu: prompts per training batch.
        max_context_length: prompts with more tokens are rejected at construction.
        seed: shuffling seed of the training stream.
    """

    def __init__(self, train_dataset, test_dataset, tokenizer, reward_fn: Callable[[str, str, str], float],
                 conversation_template: Sequence[dict], data_batch_size_per_gpu: int = 8,
                 max_context_length: int | None = None, seed: int = 42, eval_batch_size: int = 64):
        if data_batch_size_per_gpu < 1:
            raise ValueError(f"data_batch_size_per_gpu must be >= 1, got {data_batch_size_per_gpu}")
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.template = list(conversation_template)
        self.batch_size = int(data_batch_size_per_gpu)
        self.max_context_length = max_context_length
        self.eval_batch_size = int(eval_batch_size)
        self.seed = seed
        self.train = self._encode(train_dataset, "train")
        self.test_set = self._encode(test_dataset, "test")
        if len(self.train) < self.batch_size:
            raise ValueError(f"train_dataset has {len(self.train)} rows, fewer than "
                             f"data_batch_size_per_gpu={self.batch_size}")
        self._rng = np.random.default_rng(seed)
        self._order = self._rng.permutation(len(self.train))
        self._cursor = 0
        self.epoch = 0
        self._current: list[dict] | None = None

    # ------------------------------------------------------------------ data
    def _encode(self, dataset, split: str) -> list[dict]:
        rows = []
        for i, row in enumerate(dataset):
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{split} row {i} needs 'question' and 'answer' columns, got {sorted(row)}")
            text = _render(self.tokenizer, self.template, str(row["question"]))
            ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            if self.max_context_length is not None and ids.shape[1] > self.max_context_length:
                raise ValueError(f"{split} row {i}: prompt has {ids.shape[1]} tokens, more than "
                                 f"max_context_length={self.max_context_length}")
            rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "question": str(row["question"]),
                         "answer": str(row["answer"]), "text": text})
        if not rows:
            raise ValueError(f"{split} dataset is empty")
        return rows

    def _next_batch(self) -> list[dict]:
        if self._cursor + self.batch_size > len(self._order):
            self._order = self._rng.permutation(len(self.train))
            self._cursor = 0
            self.epoch += 1
        idx = self._order[self._cursor:self._cursor + self.batch_size]
        self._cursor += self.batch_size
        return [self.train[int(i)] for i in idx]

    # ------------------------------------------------------------------ gym-style API
    def reset(self, reset_dataloaders: bool = False) -> list[dict]:
        """The current batch of prompts (a new one on the first call)."""
        if reset_dataloaders:
            self._rng = np.random.default_rng(self.seed)
            self._order = self._rng.permutation(len(self.train))
            self._cursor, self.epoch = 0, 0
            self._current = None
        if self._current is None:
            self._current = self._next_batch()
        return self._current

    def score(self, completions, prompts: Sequence[dict] | None = None) -> torch.Tensor:
        """Rewards ``[batch, group]`` for completions of ``prompts`` (default: the current batch),
        without advancing. ``completions``: per prompt, a ``[G, L]`` id tensor as returned by an
        agent's ``get_action`` (left-padded prompt + completion) or a list of strings."""
        prompts = self.reset() if prompts is None else prompts
        texts = self.decode(completions, prompts)
        rewards = [[self._reward(t, p, i) for t in group] for i, (group, p) in enumerate(zip(texts, prompts))]
        return torch.tensor(rewards, dtype=torch.float32)

    def step(self, completions) -> tuple[list[dict], torch.Tensor]:
        """Score the current batch, then move on. Returns ``(next_prompts, rewards [batch, group])``."""
        rewards = self.score(completions)
        return self.step_to_next_batch(), rewards

    def step_to_next_batch(self) -> list[dict]:
        """Move to the next training batch (used when several members answered the current one)."""
        self._current = self._next_batch()
        return self._current

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
            if not torch.equal(group[0, width - n:width].cpu(), p["input_ids"][0]):
                raise ValueError("completion ids do not start with their prompt (left-padded to the batch's "
                                 "longest prompt); pass the ids returned by get_action for this batch")
            out.append([self._decode_completion(row[width:]) for row in group])
        return out

    def _decode_completion(self, ids: torch.Tensor) -> str:
        eos = self.tokenizer.eos_token_id
        ids = ids.tolist()
        if eos is not None and eos in ids:
            ids = ids[:ids.index(eos)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _reward(self, completion: str, prompt: dict, i: int) -> float:
        try:
            r = self.reward_fn(completion, prompt["answer"], prompt["question"])
        except Exception as e:  # noqa: BLE001 - re-raised with the sample named
            raise RewardFunctionError(f"reward_fn raised {type(e).__name__}: {e} on sample {i} "
                                      f"(question={prompt['question']!r}, completion={completion!r})") from e
        try:
            value = float(r)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            raise RewardFunctionError(f"reward_fn returned {r!r} (not a finite number) on sample {i} "
                                      f"(question={prompt['question']!r}, completion={completion!r})")
        return value

    def __len__(self) -> int:
        return len(self.train)
