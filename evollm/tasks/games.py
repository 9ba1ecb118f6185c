"""Synthetic multi-turn text games small enough for the tiny offline model.

Both games are gym-style text environments (``reset(seed) -> (observation, info)``,
``step(action) -> (observation, reward, terminated, truncated, info)``) with short,
character-cheap observations, and each ships a scripted *teacher* policy used to
build the partial supervised warm start (:mod:`evollm.recipes.multiturn_warm_start`).

``GuessNumberEnv``
    The env picks a secret in ``1..high``; the model guesses, the env answers
    ``higher`` / ``lower`` (with the still-possible range when ``show_range``).
    Reward 1 when the secret is guessed (episode ends), 0 otherwise.  Binary search
    (guess the midpoint of the range) wins in at most ``ceil(log2(high + 1))`` turns.

``ChainCalcEnv``
    The env gives a start number and an operation (``"7+3"``), then one new
    operation per turn (``"+5"``, ``"-4"``); the model answers the running total
    each turn.  Reward ``1 / n_ops`` per correct answer, so a perfect episode
    returns 1; a wrong answer ends the episode.

Every episode's final ``info`` has ``success`` (secret found / every answer right).
"""

from __future__ import annotations

import copy
import random
import re
from typing import Any, Callable

_INT = re.compile(r"[+-]?\d+")


def parse_int(text: str) -> int | None:
    """The integer the whole (stripped) text is, else None."""
    text = text.strip()
    return int(text) if _INT.fullmatch(text) else None


class GuessNumberEnv:
    """Guess-the-number with higher/lower feedback.

    Args:
        high: the secret is drawn uniformly from ``1..high``.
        max_turns: guesses allowed; the episode is truncated after the last one.
        show_range: feedback includes the range still possible, e.g. ``"higher 9-16"``
            (without it the model has to track the range itself).
        seed: seed of the secret stream when ``reset`` gets no seed.
    """

    def __init__(self, high: int = 16, max_turns: int = 4, show_range: bool = True, seed: int | None = None):
        if high < 2 or max_turns < 1:
            raise ValueError(f"need high >= 2 and max_turns >= 1, got high={high}, max_turns={max_turns}")
        self.high, self.max_turns, self.show_range = int(high), int(max_turns), bool(show_range)
        self._rng = random.Random(seed)
        self.secret = self.lo = self.hi = self.turn = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        rng = random.Random(seed) if seed is not None else self._rng
        self.secret = rng.randint(1, self.high)
        self.lo, self.hi, self.turn = 1, self.high, 0
        return f"guess 1-{self.high}", {"secret": self.secret}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.turn += 1
        guess = parse_int(action)
        info = {"secret": self.secret, "guess": guess, "success": guess == self.secret}
        if guess == self.secret:
            return "correct", 1.0, True, False, info
        if guess is None or not 1 <= guess <= self.high:
            feedback = "invalid"
        elif guess < self.secret:
            self.lo = max(self.lo, guess + 1)
            feedback = "higher"
        else:
            self.hi = min(self.hi, guess - 1)
            feedback = "lower"
        if self.show_range and feedback != "invalid":
            feedback += f" {self.lo}-{self.hi}"
        return feedback, 0.0, False, self.turn >= self.max_turns, info

    # ------------------------------------------------------------------ teacher
    def teacher_action(self, rng: random.Random, optimal_prob: float = 0.3) -> str:
        """Scripted guess for the warm start: the midpoint of the possible range with probability
        ``optimal_prob``, else the lowest possible number (linear search: valid, but slow). Uses the
        env's own state, so call it between ``reset``/``step``."""
        lo, hi = self.lo, self.hi
        return str((lo + hi) // 2 if rng.random() < optimal_prob else lo)


class ChainCalcEnv:
    """Running-total arithmetic over several turns.

    Args:
        n_ops: operations per episode (turns).
        max_start: the start number is drawn from ``0..max_start``.
        max_operand: operands are drawn from ``1..max_operand``.
        ops: operators to draw from (``"+"``, ``"-"``); a subtraction that would go below 0
            is turned into an addition, so totals stay non-negative.
        seed: seed of the episode stream when ``reset`` gets no seed.
    """

    OPS: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}

    def __init__(self, n_ops: int = 3, max_start: int = 20, max_operand: int = 9, ops: str = "+-",
                 seed: int | None = None):
        if n_ops < 1 or not ops or set(ops) - set(self.OPS):
            raise ValueError(f"need n_ops >= 1 and ops from {sorted(self.OPS)}, got n_ops={n_ops}, ops={ops!r}")
        self.n_ops, self.max_start, self.max_operand, self.ops = int(n_ops), int(max_start), int(max_operand), ops
        self._rng = random.Random(seed)
        self.total = self.turn = 0
        self.steps: list[tuple[str, int]] = []

    @property
    def max_turns(self) -> int:
        return self.n_ops

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        rng = random.Random(seed) if seed is not None else self._rng
        start = rng.randint(0, self.max_start)
        self.steps, total = [], start
        for _ in range(self.n_ops):
            op, b = rng.choice(self.ops), rng.randint(1, self.max_operand)
            if op == "-" and total - b < 0:
                op = "+"
            total = self.OPS[op](total, b)
            self.steps.append((op, b))
        self.total, self.turn = start, 0
        op, b = self.steps[0]
        return f"{start}{op}{b}", {"start": start}

    def _target(self) -> int:
        op, b = self.steps[self.turn]
        return self.OPS[op](self.total, b)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        target = self._target()
        answer = parse_int(action)
        correct = answer == target
        self.turn += 1
        info = {"target": target, "answer": answer, "correct": correct}
        if not correct:
            info["success"] = False
            return "wrong", 0.0, True, False, info
        self.total = target
        reward = 1.0 / self.n_ops
        if self.turn == self.n_ops:
            info["success"] = True
            return "done", reward, True, False, info
        op, b = self.steps[self.turn]
        return f"{op}{b}", reward, False, False, info

    # ------------------------------------------------------------------ teacher
    def teacher_action(self, rng: random.Random, error_prob: float = 0.3) -> str:
        """Scripted answer for the warm start: the right total, except that with probability
        ``error_prob`` a subtraction is done as an addition (a systematic slip RL can fix)."""
        op, b = self.steps[self.turn]
        if op == "-" and rng.random() < error_prob:
            return str(self.total + b)
        return str(self._target())


#: Games by name, for configs: ``make_game("guess_number", high=16)``.
GAMES = {"guess_number": GuessNumberEnv, "chain_calc": ChainCalcEnv}


def make_game(name: str, **kwargs):
    """A game by name (``"guess_number"`` or ``"chain_calc"``) with keyword settings."""
    if name not in GAMES:
        raise ValueError(f"unknown game {name!r}; choose one of {sorted(GAMES)}")
    return GAMES[name](**kwargs)


def game_env_factory(name: str, tokenizer, game: dict | None = None, max_turns: int | None = None,
                     max_model_len: int | None = None, max_output_tokens: int = 4):
    """A zero-argument factory of token-space episodes of a game (for ``finetune_llm_multiturn``):
    each call returns a fresh :class:`~evollm.envs.multiturn.TokenObservationWrapper` around
    ``make_game(name, **game)``; ``max_turns`` (of the wrapper) defaults to the game's own."""
    from evollm.envs.multiturn import TokenObservationWrapper

    game = dict(game or {})
    make_game(name, **game)  # fail now on bad settings, not inside the training loop

    def factory() -> TokenObservationWrapper:
        env = make_game(name, **game)
        return TokenObservationWrapper(env, tokenizer, max_turns=max_turns or env.max_turns,
                                       pad_id=tokenizer.pad_token_id, max_model_len=max_model_len,
                                       max_output_tokens=max_output_tokens)
    return factory


#: Per task: game settings, teacher settings, the longest model turn in tokens, and SFT overrides.
MULTITURN_TASKS: dict[str, dict[str, Any]] = {
    "guess_number": dict(game=dict(high=16, max_turns=4, show_range=True), teacher=dict(optimal_prob=0.3),
                         max_output_tokens=4, sft=dict(steps=250)),
    "chain_calc": dict(game=dict(n_ops=3, max_start=10, max_operand=5, ops="+-"), teacher=dict(error_prob=0.6),
                       max_output_tokens=4, sft=dict(steps=900, episodes=4000)),
}


def task_settings(task: str) -> dict[str, Any]:
    if task not in MULTITURN_TASKS:
        raise ValueError(f"unknown multi-turn task {task!r}; choose one of {sorted(MULTITURN_TASKS)}")
    return copy.deepcopy(MULTITURN_TASKS[task])


def task_env_factory(task: str, tokenizer, max_model_len: int | None = 256, **game_overrides) -> Callable:
    """The env factory of a task with its default game settings (overridable)."""
    spec = task_settings(task)
    return game_env_factory(task, tokenizer, game={**spec["game"], **game_overrides}, max_model_len=max_model_len,
                            max_output_tokens=spec["max_output_tokens"])
