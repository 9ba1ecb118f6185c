"""LLMREINFORCE: value-free policy gradient with batch-normalised returns (ReBN).

Read top to bottom in :meth:`LLMREINFORCE.learn`:

1. stack the experiences: multi-turn episodes ``(ids, action_masks, turn_ids, rewards[B, K])`` or
   single-turn samples ``(completion_ids, action_masks, rewards)`` (the call
   :func:`~evollm.training.loop.finetune_llm_reasoning` makes, rewards ``[P, G]``);
2. discounted return of every turn (``gamma`` across turns), z-scored over all valid
   (episode, turn) cells of the batch (:func:`evollm.functional.rebn`), broadcast to the
   turn's tokens; ``action_granularity="token"`` z-scores per-token returns instead, with
   each turn's reward on its last token;
3. policy-gradient loss ``-A * log pi`` (token mean).  With ``update_epochs > 1`` (or several
   minibatches) the PPO clipped surrogate keeps later passes close to the sampling policy;
   ``beta`` adds the k3 KL to the reference (the base with adapters disabled).

The update itself is :func:`evollm.algorithms.reinforce_update.reinforce_update`: one member
(:meth:`LLMREINFORCE.learn`) or a population sharing every forward and backward pass
(:meth:`LLMREINFORCE.learn_population`, what the training loops call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import functional as F
from evollm.parallel.distributed import batch_reduce
from .base import AgentConfig, LLMAgent
from ..utils.fields import documented
from .compat import with_turn_ids
from .reinforce_update import learn_grouped, reinforce_update
from .multiturn_rollout import (EpisodeAgent, EpisodeBatch, last_token_of_turn, pack_actions,
                                unpack_actions)

GRANULARITIES = ("turn", "token", "auto")


@dataclass
class LLMREINFORCEConfig(AgentConfig):
    """REINFORCE hyperparameters (see :class:`AgentConfig` for the shared ones)."""

    lr: float = 1e-4
    gamma: float = documented(1.0, "Discount across turns of the returns.")
    update_epochs: int = 1
    batch_size: int = 8
    group_size: int = documented(1, "Samples (episodes) per prompt or seed.")
    action_granularity: str = documented("turn", "'turn': returns per turn, z-scored over the batch's (episode, "
                                         "turn) cells; 'token': per-token returns, each turn's reward on its last "
                                         "token; 'auto': token for single-turn episodes, else turn.")

    def validate(self) -> None:
        super().validate()
        if self.action_granularity not in GRANULARITIES:
            raise ValueError(f"action_granularity={self.action_granularity!r}; choose one of {list(GRANULARITIES)}")
        if self.batch_size < 1 or self.update_epochs < 1 or self.group_size < 1:
            raise ValueError(f"batch_size, update_epochs and group_size must be >= 1, got {self.batch_size}, "
                             f"{self.update_epochs}, {self.group_size}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")


class LLMREINFORCE(EpisodeAgent):
    """Turn-level REINFORCE with ReBN on a LoRA adapter of a shared base model.

    ``LLMREINFORCE(model, pad_token_id, pad_token, lr=1e-4, gamma=1.0, ...)``: any
    :class:`LLMREINFORCEConfig` field as a keyword, or ``config=``. Works with
    ``finetune_llm_reasoning`` (single turn, ``group_size`` samples per prompt) and
    ``finetune_llm_multiturn``.
    """

    config_cls = LLMREINFORCEConfig
    MUTABLE = LLMAgent.MUTABLE + ("gamma",)

    def normalised_returns(self, batch: EpisodeBatch) -> torch.Tensor:
        """``[B, T]`` per-token advantages: ReBN returns of each turn (or token) on its tokens."""
        c = self.config
        g = c.action_granularity
        if g == "token" or (g == "auto" and batch.num_turns == 1):
            last = last_token_of_turn(batch.turn_ids, batch.num_turns)
            token_rewards = torch.where(last, F.broadcast_turn_values(batch.rewards, batch.turn_ids), 0.0)
            r, m, index = pack_actions(token_rewards, batch.action_mask)
            return unpack_actions(F.rebn(r, m, c.gamma, reduce=batch_reduce()), m, index, batch.action_mask.shape[1])
        returns = F.rebn(batch.rewards, batch.turn_mask(), c.gamma, reduce=batch_reduce())  # over every process's share
        return F.broadcast_turn_values(returns, batch.turn_ids) * batch.action_mask

    def learn(self, experiences, turn_ids=None) -> dict[str, float]:
        """One update from ``(ids, action_masks, turn_ids, rewards[B, K])`` or ``(completion_ids,
        action_masks, rewards)``. Returns mean metrics (``mean_reward`` is the mean episode return). The
        update is :func:`~evollm.algorithms.reinforce_update.reinforce_update` with this one member."""
        experiences = with_turn_ids(experiences, turn_ids)  # AgileRL's learn((ids, masks, rewards), turn_ids=)
        return reinforce_update([self], [experiences])[0]

    @classmethod
    def learn_population(cls, agents, experiences) -> list[dict[str, float]]:
        """Update several members at once, each exactly as :meth:`learn` would: members whose update schedule
        agrees share every forward and backward pass (one routed batch over the shared base), in the groups
        the memory plan allows (:func:`~evollm.algorithms.memory_plan.member_chunks`). The metrics say which
        path ran (``learn_path``, ``learn_chunks``)."""
        return learn_grouped(agents, [with_turn_ids(e, None) for e in experiences])

    @staticmethod
    def _metrics(metrics: dict, batch) -> dict[str, float]:
        returns = batch.episode_returns()
        metrics.update(mean_reward=float(returns.mean()), mean_return=float(returns.mean()),
                       mean_turns=float(batch.turn_mask().sum(1).float().mean()),
                       completion_length=float(batch.action_mask.sum(1).float().mean()))
        return metrics
