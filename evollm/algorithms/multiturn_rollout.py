"""The episode tensors multi-turn learners consume, and the base class of the agents that learn
from whole episodes. Episodes are played by :mod:`evollm.rollout.episodes`; the stacked,
right-padded tensors (:func:`evollm.rollout.stack_episodes`) are::

    input_ids   [B, L]      the whole conversation of each episode
    action_mask [B, L-1]    1 on model tokens (refers to input_ids[:, 1:])
    turn_ids    [B, L-1]    turn index of each model token, -1 elsewhere
    rewards     [B, K]      per-turn rewards (0 on turns that were not played)
    truncated   [B]         the episode was cut short (turn limit, context length): not terminal
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..rollout import (action_start, attention_from_sequences, collect_episodes, evaluate_population, policy_forward,
                       stack_rows)
from .acting import Acting
from .base import LLMAgent


@dataclass
class EpisodeBatch:
    """Stacked episodes (see the module docstring for shapes)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    turn_ids: torch.Tensor
    rewards: torch.Tensor
    truncated: torch.Tensor | None = None  # [B] bool; None: every episode ended (terminal)

    def __post_init__(self):
        if self.truncated is None:
            self.truncated = torch.zeros(self.input_ids.shape[0], dtype=torch.bool, device=self.input_ids.device)

    def rows(self, idx: torch.Tensor) -> "EpisodeBatch":
        """The episodes ``idx``."""
        return EpisodeBatch(self.input_ids[idx], self.attention_mask[idx], self.action_mask[idx], self.turn_ids[idx],
                            self.rewards[idx], self.truncated[idx])

    def to(self, device) -> "EpisodeBatch":
        return EpisodeBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.action_mask,
                                                     self.turn_ids, self.rewards, self.truncated)))

    @property
    def num_turns(self) -> int:
        return self.rewards.shape[1]

    def turn_mask(self) -> torch.Tensor:
        """``[B, K]`` bool: turn ``k`` of row ``b`` was played (it has at least one model token)."""
        turns = torch.arange(self.num_turns, device=self.turn_ids.device)
        return (self.turn_ids.unsqueeze(-1) == turns).any(1)

    def episode_returns(self) -> torch.Tensor:
        return (self.rewards * self.turn_mask()).sum(1)


# --------------------------------------------------------------------------- #
# Stacking and unpacking experiences
# --------------------------------------------------------------------------- #
def episode_batch(experiences, pad_token_id: int) -> EpisodeBatch:
    """Normalise what ``learn`` accepts into an :class:`EpisodeBatch`.

    * ``(input_ids, action_masks, turn_ids, rewards[B, K])``: multi-turn episodes, optionally with a 5th
      element ``truncated[B]`` (episodes cut short by a turn limit or the context length, not terminal:
      LLMPPO bootstraps them from its critic);
    * ``(completion_ids, action_masks, rewards)``: single-turn samples as returned by ``get_action``
      (per-prompt lists or stacked tensors), rewards ``[P, G]`` or ``[B]``; every action token is
      turn 0, so the reward counts once per sample.
    """
    truncated = None
    if len(experiences) in (4, 5):
        ids, masks, turn_ids, rewards = experiences[:4]
        if len(experiences) == 5:
            truncated = torch.as_tensor(experiences[4], dtype=torch.bool).reshape(-1)
        ids, masks = stack_rows(ids, pad_token_id), stack_rows(masks, 0)
        turn_ids = stack_rows(turn_ids, -1).long()
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
        if rewards.dim() == 1:
            rewards = rewards.unsqueeze(1)
    elif len(experiences) == 3:
        ids, masks, rewards = experiences
        ids, masks = stack_rows(ids, pad_token_id), stack_rows(masks, 0)
        rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1, 1)
        turn_ids = torch.where(masks.bool(), 0, -1).long()
    else:
        raise ValueError("experiences must be (ids, action_masks, rewards) or (ids, action_masks, turn_ids, rewards"
                         "[, truncated])")
    if not (ids.shape[0] == masks.shape[0] == turn_ids.shape[0] == rewards.shape[0]):
        raise ValueError(f"batch sizes differ: ids {tuple(ids.shape)}, masks {tuple(masks.shape)}, "
                         f"turn_ids {tuple(turn_ids.shape)}, rewards {tuple(rewards.shape)}")
    if masks.shape != (ids.shape[0], ids.shape[1] - 1) or turn_ids.shape != masks.shape:
        raise ValueError(f"action_masks/turn_ids must be [B, L-1] for ids {tuple(ids.shape)}, got "
                         f"{tuple(masks.shape)} / {tuple(turn_ids.shape)}")
    if turn_ids.numel() and int(turn_ids.max()) >= rewards.shape[1]:
        raise ValueError(f"turn id {int(turn_ids.max())} has no reward column (rewards {tuple(rewards.shape)})")
    if truncated is not None and truncated.shape[0] != ids.shape[0]:
        raise ValueError(f"got {truncated.shape[0]} truncated flags for {ids.shape[0]} episodes")
    turn_ids = torch.where(masks.bool(), turn_ids, torch.full_like(turn_ids, -1))
    return EpisodeBatch(ids, attention_from_sequences(ids, pad_token_id), masks.long(), turn_ids, rewards, truncated)


# --------------------------------------------------------------------------- #
# Token-level helpers: action tokens packed to the left, so per-token recursions
# (GAE, discounted returns) run over consecutive actions only.
# --------------------------------------------------------------------------- #
def pack_actions(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x[b]`` at the action positions of row ``b``, moved to the front: returns
    ``(packed [B, N], packed_mask [B, N], index [B, N])`` with ``N`` the most actions in a row."""
    valid = mask.bool()
    n = max(int(valid.sum(1).max()), 1) if valid.numel() else 1
    # stable sort puts the action positions first, in order
    index = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :n]
    packed_mask = torch.gather(valid, 1, index)
    return torch.gather(x, 1, index), packed_mask, index


def unpack_actions(packed: torch.Tensor, packed_mask: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_actions`: ``[B, width]`` with the packed values back in place, 0 elsewhere."""
    out = torch.zeros(packed.shape[0], width, dtype=packed.dtype, device=packed.device)
    return out.scatter(1, index, torch.where(packed_mask, packed, torch.zeros_like(packed)))


def last_token_of_turn(turn_ids: torch.Tensor, num_turns: int) -> torch.Tensor:
    """``[B, T]`` bool: the last token of each turn (where a token-level turn reward is placed)."""
    positions = torch.arange(turn_ids.shape[1], device=turn_ids.device).expand_as(turn_ids)
    out = torch.zeros_like(turn_ids, dtype=torch.bool)
    for k in range(num_turns):
        is_k = turn_ids == k
        last = torch.where(is_k, positions, torch.full_like(positions, -1)).amax(1)
        out |= is_k & (positions == last.unsqueeze(1))
    return out


# --------------------------------------------------------------------------- #
# What LLMPPO and LLMREINFORCE share
# --------------------------------------------------------------------------- #
class EpisodeAgent(Acting, LLMAgent):
    """Base of the agents that learn from whole episodes (LLMPPO, LLMREINFORCE): sampling is every acting
    member's (:class:`~evollm.algorithms.acting.Acting`: ``group_size`` samples per prompt, 1 by default),
    founders are every member's (:meth:`~evollm.algorithms.member.Member.population`), and :meth:`test` works
    on a :class:`~evollm.envs.reasoning.ReasoningGym` or a multi-turn wrapper."""

    def test(self, env, loop: int = 1) -> float:
        """Fitness, appended to ``self.fitness``: on a ReasoningGym the mean reward on its fixed test set;
        on a :class:`~evollm.envs.multiturn.TokenObservationWrapper` the mean greedy return over ``loop``
        episodes seeded ``0..loop-1``."""
        from .compat import agilerl_style_test, is_evollm_env
        if not is_evollm_env(env):
            return agilerl_style_test(self, env, loop)
        if hasattr(env, "test_prompts"):
            return np.float64(evaluate_population([self], env)[0])  # a float with AgileRL's .shape == ()
        returns = []
        for seed in range(loop):
            returns += [e.episode_return for e in collect_episodes([self], [env], [seed], training=False)[self.index]]
        fitness = sum(returns) / len(returns)
        self.record_fitness(fitness)
        return np.float64(fitness)

    def _policy_forward(self, model, ids: torch.Tensor, attn: torch.Tensor, action_mask: torch.Tensor,
                        entropy_grad: bool = False, info: dict | None = None):
        """``(logp, entropy)`` ``[B, L-1]`` at the sampling temperature (with gradients): the output head only
        from the first action column on, each distinct prompt once (:func:`evollm.rollout.policy_forward`)."""
        logp, entropy, _ = policy_forward(model, ids, attn, action_start(action_mask), self.config.temperature,
                                          entropy_grad, info=info)
        return logp, entropy
