"""A synthetic cooperative task for teams of two agents: *relay sum*.

Each agent holds one number of a pair (agent 0 holds ``x``, agent 1 holds ``y``); neither sees the
other's number.  The episode has two rounds:

* round 1: each agent is shown its own number (``"n=12"``) and should pass it on (reply ``"12"``);
* round 2: each agent sees its own number plus what the other agent said in round 1
  (``"12+34="``) and should reply with the sum.

The joint reward (given after round 2, shared by both agents) is the fraction of agents whose
sum equals ``x + y``: 1.0 only when *both* relayed correctly *and* both added correctly, so no
agent can succeed alone.

The scripted teacher used for the warm start (:mod:`evollm.recipes.coop_warm_start`) adds
correctly whatever it is shown, but relays its number with the digits *swapped* most of the time
(``12`` -> ``"21"``), so the imitating model's most likely relay is the wrong one; RL has to learn,
from the joint reward alone, that passing the number on unchanged is what lets the partner succeed.
"""

from __future__ import annotations

import random
import re
from typing import Sequence

from datasets import Dataset

from .rewards import clean_completion

_INT = re.compile(r"[+-]?\d+")

#: Defaults of the relay-sum task (operands two-digit, so a digit swap changes them).
RELAY_DEFAULTS = dict(low=10, high=49)


def relay_sum_dataset(n_train: int = 1000, n_test: int = 100, low: int = 10, high: int = 49,
                      seed: int = 0) -> tuple[Dataset, Dataset]:
    """Disjoint train/test splits of ``(x, y)`` pairs with columns ``x``, ``y`` (ints) and ``answer``
    (``str(x + y)``); ``x`` and ``y`` are drawn from ``low..high``."""
    if not 0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
    pairs = [(x, y) for x in range(low, high + 1) for y in range(low, high + 1)]
    if n_train + n_test > len(pairs):
        raise ValueError(f"only {len(pairs)} distinct pairs in {low}..{high}, asked for {n_train} + {n_test}")
    chosen = random.Random(seed).sample(pairs, n_train + n_test)

    def to_dataset(rows):
        return Dataset.from_dict({"x": [x for x, _ in rows], "y": [y for _, y in rows],
                                  "answer": [str(x + y) for x, y in rows]})
    return to_dataset(chosen[:n_train]), to_dataset(chosen[n_train:])


def _own(row: dict, agent: int) -> int:
    return int(row["x"] if agent == 0 else row["y"])


def relay_formatter(agent: int):
    """The formatter of agent ``agent`` (0 holds ``x``, 1 holds ``y``): ``formatter(row, history)``
    returns the user message of the next round; ``history[t][j]`` is agent ``j``'s reply in round ``t``."""
    if agent not in (0, 1):
        raise ValueError(f"relay sum has agents 0 and 1, got {agent}")

    def formatter(row: dict, history: Sequence[Sequence[str]] = ()) -> str:
        own = _own(row, agent)
        if not history:
            return f"n={own}"
        said = clean_completion(history[-1][1 - agent])
        return f"{own}+{said}="
    formatter.__name__ = f"relay_formatter_{agent}"
    return formatter


def relay_formatters() -> list:
    return [relay_formatter(0), relay_formatter(1)]


def _as_int(text: str) -> int | None:
    text = clean_completion(text)
    return int(text) if _INT.fullmatch(text) else None


def relay_sum_reward(*agent_completions: Sequence[str], x: Sequence, y: Sequence, **_) -> list[float]:
    """Joint reward of the last round: per episode, the fraction of agents whose reply equals
    ``x + y``. ``agent_completions[j][b]`` is agent ``j``'s reply in episode ``b``."""
    out = []
    for b, (xb, yb) in enumerate(zip(x, y)):
        target = int(xb) + int(yb)
        out.append(sum(_as_int(c[b]) == target for c in agent_completions) / len(agent_completions))
    return out


def swap_digits(n: int) -> str:
    """``12`` -> ``"21"`` (the teacher's relay slip)."""
    return str(n)[::-1]


def relay_teacher(row: dict, agent: int, history: Sequence[Sequence[str]], rng: random.Random,
                  relay_prob: float = 0.35) -> str:
    """Scripted reply of the warm-start teacher: in round 1 the number itself with probability
    ``relay_prob``, else its digits swapped; in round 2 the correct sum of what it is shown."""
    own = _own(row, agent)
    if not history:
        return str(own) if rng.random() < relay_prob else swap_digits(own)
    said = _as_int(history[-1][1 - agent])
    return str(own + (said if said is not None else 0))


#: The relay-sum task's default splits and reply length (the tiny model's warm start uses them too).
RELAY_TASK: dict = dict(RELAY_DEFAULTS, n_train=1200, n_test=200)
RELAY_MAX_NEW_TOKENS = 4


def relay_task(tokenizer, seed: int = 0, **overrides):
    """The relay-sum :class:`~evollm.envs.team.TeamTask` (2 agents, 2 rounds) with the
    default dataset splits (those the tiny model's warm start uses)."""
    from evollm.envs.team import TeamTask

    task = {**RELAY_TASK, **overrides.pop("task", {})}
    train, test = relay_sum_dataset(seed=seed, **task)
    overrides.setdefault("max_new_tokens", RELAY_MAX_NEW_TOKENS)
    return TeamTask(train, test, tokenizer, relay_sum_reward, relay_formatters(), num_turns=2, seed=seed, **overrides)
