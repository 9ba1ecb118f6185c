"""Cooperative tasks for teams of agents, as conversations in token space.

A :class:`TeamTask` holds what CoMLRL's ``IPPOTrainer`` takes besides the model: the datasets,
one formatter per agent, the joint ``reward_func`` and an optional ``reward_processor``.

An episode is one dataset row played by one team for ``num_turns`` rounds. Agent ``j``'s side of it
is a conversation in token space (a :class:`~evollm.envs.multiturn.TokenObservationWrapper` around
a *seat*): round 1's user message is ``formatter_j(row)``; after each round, every agent's reply is
recorded and scored first, and only then does each seat build its next user message
``formatter_j(row, history)`` -- so all agents act simultaneously in a round and see each other's
replies from the next round on (:func:`play_rounds`).

``reward_func(*agent_completions, **columns) -> list[float]`` is called once per batch of episodes
with ``agent_completions[j][b]`` = agent ``j``'s reply in episode ``b`` of the scored round and every
dataset column as a list (as TRL passes them). By default only the last round is scored
(``reward_turns="last"``, earlier rounds get 0); with ``"all"`` every round is, and ``turn`` is passed
too. The joint reward is given to every agent of the team.
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .multiturn import TokenObservationWrapper

REWARD_TURNS = ("last", "all")


def _takes_history(formatter: Callable) -> bool:
    try:
        params = [p for p in inspect.signature(formatter).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return True
    return len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


@dataclass
class TeamEpisode:
    """One row played by one team: each round's replies (``history[t][j]``) and joint rewards."""

    row: dict
    team: int
    num_agents: int
    history: list[list[str]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    @property
    def episode_return(self) -> float:
        return float(sum(self.rewards))


class _Seat:
    """Agent ``agent``'s side of a team episode, as a text environment for the token wrapper."""

    def __init__(self, task: "TeamTask", episode: TeamEpisode, agent: int):
        self.task, self.episode, self.agent, self.turn = task, episode, agent, 0

    def reset(self, seed=None) -> tuple[str, dict]:
        self.turn = 0
        return self.task.message(self.agent, self.episode.row, []), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        ep, t = self.episode, self.turn  # this round's replies and reward were recorded before the step
        self.turn += 1
        done = self.turn >= self.task.num_turns
        obs = "" if done else self.task.message(self.agent, ep.row, ep.history[:self.turn])
        return obs, ep.rewards[t], done, False, {"success": ep.episode_return >= self.task.success_threshold}


class TeamTask:
    """Datasets + per-agent formatters + joint reward of a cooperative task.

    Args:
        train_dataset, eval_dataset: rows (dicts, e.g. a :class:`datasets.Dataset`); the evaluation set is
            fixed and played greedily by every team.
        tokenizer: the base model's tokenizer (chat template used for the conversations).
        reward_func: ``reward_func(*agent_completions, **columns) -> list[float]`` (see the module docstring).
        formatters: one callable per agent (or one for all): ``formatter(row)`` or ``formatter(row, history)``
            returning that agent's user message; a one-argument formatter gets, from round 2 on, the others'
            replies as ``"agent <j>: <reply>"`` lines.
        num_turns: rounds per episode.
        reward_processor: optional ``float -> float`` applied to every reward (e.g. scaling).
        reward_turns: ``"last"`` (only the last round is scored) or ``"all"``.
        max_new_tokens, max_model_len: longest reply per round / conversation per agent.
        success_threshold: an episode whose return reaches it counts as a joint success.
        system_prompt: optional system message of every conversation.
        eval_batch_size: evaluation rows per batched rollout.
        seed: seed of the training-row order.
    """

    def __init__(self, train_dataset, eval_dataset, tokenizer, reward_func: Callable, formatters, num_turns: int = 1,
                 reward_processor: Callable[[float], float] | None = None, reward_turns: str = "last",
                 max_new_tokens: int = 32, max_model_len: int | None = 256, success_threshold: float = 1.0,
                 system_prompt: str | None = None, eval_batch_size: int = 64, seed: int = 0):
        self.train_rows = [dict(r) for r in train_dataset]
        self.eval_rows = [dict(r) for r in (eval_dataset if eval_dataset is not None else [])]
        if not self.train_rows:
            raise ValueError("train_dataset is empty")
        if reward_turns not in REWARD_TURNS:
            raise ValueError(f"reward_turns={reward_turns!r}; choose one of {list(REWARD_TURNS)}")
        if not callable(reward_func):
            raise ValueError("reward_func must be callable: reward_func(*agent_completions, **columns) -> list[float]")
        self.formatters = list(formatters) if isinstance(formatters, (list, tuple)) else [formatters]
        self.tokenizer, self.reward_func, self.reward_processor = tokenizer, reward_func, reward_processor
        self.num_turns, self.reward_turns = int(num_turns), reward_turns
        self.max_new_tokens, self.max_model_len = int(max_new_tokens), max_model_len
        self.success_threshold, self.system_prompt = float(success_threshold), system_prompt
        self.eval_batch_size = int(eval_batch_size)
        self._rng = random.Random(seed)
        self._order: list[int] = []

    # ------------------------------------------------------------------ rows and prompts
    def state_dict(self) -> dict:
        """Where the training rows are (JSON): the shuffling generator and the rows left in this pass."""
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss], "order": list(self._order), "train_rows": len(self.train_rows)}

    def load_state_dict(self, state: dict) -> None:
        """Continue the training rows exactly where :meth:`state_dict` left them."""
        if state["train_rows"] != len(self.train_rows):
            raise ValueError(f"task state is for {state['train_rows']} training rows, this task has "
                             f"{len(self.train_rows)}")
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._order = [int(i) for i in state["order"]]

    def next_rows(self, n: int) -> list[dict]:
        """The next ``n`` training rows (reshuffled after each pass)."""
        out = []
        while len(out) < n:
            if not self._order:
                self._order = list(range(len(self.train_rows)))
                self._rng.shuffle(self._order)
            out.append(self.train_rows[self._order.pop()])
        return out

    def formatter(self, agent: int) -> Callable:
        if len(self.formatters) == 1:
            return self.formatters[0]
        if agent >= len(self.formatters):
            raise ValueError(f"{len(self.formatters)} formatters for agent {agent}: give one per agent (or one for all)")
        return self.formatters[agent]

    def message(self, agent: int, row: dict, history: Sequence[Sequence[str]]) -> str:
        fmt = self.formatter(agent)
        if _takes_history(fmt):
            return str(fmt(row, [list(h) for h in history]))
        if not history:
            return str(fmt(row))
        return "\n".join(f"agent {j}: {reply}" for j, reply in enumerate(history[-1]) if j != agent)

    def seat(self, episode: TeamEpisode, agent: int) -> TokenObservationWrapper:
        tok = self.tokenizer
        return TokenObservationWrapper(_Seat(self, episode, agent), tok, max_turns=self.num_turns,
                                       pad_id=tok.pad_token_id, max_model_len=self.max_model_len,
                                       max_output_tokens=self.max_new_tokens, system_prompt=self.system_prompt)

    # ------------------------------------------------------------------ rewards
    def joint_rewards(self, episodes: Sequence[TeamEpisode], turn: int) -> list[float]:
        """The joint reward of round ``turn`` of each episode (0 for unscored rounds)."""
        if self.reward_turns == "last" and turn != self.num_turns - 1:
            return [0.0] * len(episodes)
        num_agents = len(episodes[0].history[turn])
        completions = [[e.history[turn][j] for e in episodes] for j in range(num_agents)]
        columns = {k: [e.row.get(k) for e in episodes] for k in episodes[0].row}
        if self.reward_turns == "all":
            columns["turn"] = [turn] * len(episodes)
        name = getattr(self.reward_func, "__name__", "reward_func")
        rewards = list(self.reward_func(*completions, **columns))
        if len(rewards) != len(episodes):
            raise ValueError(f"{name} returned {len(rewards)} rewards for {len(episodes)} episodes")
        out = []
        for r in rewards:
            r = float(self.reward_processor(float(r)) if self.reward_processor is not None else r)
            if not math.isfinite(r):
                raise ValueError(f"{name} (after reward_processor) returned a non-finite reward {r}")
            out.append(r)
        return out


def team_seats(task: TeamTask, rows: Sequence[dict], team_index: int, num_agents: int):
    """``(episodes, seats)`` of one team on ``rows``; a seat is ``(episode, agent, wrapper)``."""
    episodes, seats = [], []
    for row in rows:
        ep = TeamEpisode(dict(row), team_index, num_agents)
        episodes.append(ep)
        seats += [(ep, j, task.seat(ep, j)) for j in range(num_agents)]
    return episodes, seats


def play_rounds(task: TeamTask, episodes: Sequence[TeamEpisode], seats: Sequence, generate_fn) -> None:
    """Play every round of ``episodes``: ``generate_fn(active, prompts)`` answers the running seats
    (see :func:`~evollm.algorithms.multiturn_rollout.play_episodes`); all replies of a round are
    recorded and scored before any seat moves on."""
    prompts = {i: s[2].reset()[0] for i, s in enumerate(seats)}
    tok = task.tokenizer
    for turn in range(task.num_turns):
        active = [i for i, s in enumerate(seats) if not s[2].done]
        if not active:
            break
        for ep in episodes:
            ep.history.append([""] * ep.num_agents)  # a seat that has ended replies nothing
        completions = dict(zip(active, generate_fn(active, [prompts[i] for i in active])))
        for i, comp in completions.items():
            ep, j, wrapper = seats[i]
            new = wrapper.new_turn_tokens(comp)
            if new and new[-1] == wrapper.eos_id:
                new = new[:-1]
            ep.history[turn][j] = tok.decode(new, skip_special_tokens=True)
        for ep, r in zip(episodes, task.joint_rewards(episodes, turn)):
            ep.rewards.append(r)
        for i, comp in completions.items():
            prompts[i] = seats[i][2].step(comp)[0]
