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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import functional as F
from ..rollout import first_target, loss_forward
from .base import AgentConfig, LLMAgent
from ..utils.fields import documented
from .compat import with_turn_ids
from .updates import mean_metrics, optimizer_only_update, record, run_epochs, zero_gradient
from .multiturn_rollout import (EpisodeAgent, EpisodeBatch, episode_batch, last_token_of_turn, pack_actions,
                                unpack_actions)

GRANULARITIES = ("turn", "token", "auto")
#: the per-minibatch metrics of an update (``kl``: k3 to the reference; ``approx_kl``: to the sampling policy)
METRICS = ("loss", "kl", "approx_kl", "clip_fraction", "entropy", "grad_norm", "shared_prompt")


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
            return unpack_actions(F.rebn(r, m, c.gamma), m, index, batch.action_mask.shape[1])
        returns = F.rebn(batch.rewards, batch.turn_mask(), c.gamma)
        return F.broadcast_turn_values(returns, batch.turn_ids) * batch.action_mask

    def learn(self, experiences, turn_ids=None) -> dict[str, float]:
        """One update from ``(ids, action_masks, turn_ids, rewards[B, K])`` or ``(completion_ids,
        action_masks, rewards)``. Returns mean metrics (``mean_reward`` is the mean episode return)."""
        experiences = with_turn_ids(experiences, turn_ids)  # AgileRL's learn((ids, masks, rewards), turn_ids=)
        c = self.config
        batch = episode_batch(experiences, self.pad_token_id)
        dev = self.device
        ids, attn, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.action_mask.to(dev)
        advantages = self.normalised_returns(batch).to(dev)
        n = ids.shape[0]
        if zero_gradient(self, advantages, n):  # every return equal: no signal, only the optimizer steps
            return self._optimizer_only_metrics(batch, n)
        needs_old = c.update_epochs > 1 or c.batch_size < n
        first = first_target(mask)  # the loss reads no column before the first action token
        old_logp = self.get_logprobs(ids, attn, start=first) if needs_old else None
        ref_logp = self.get_logprobs(ids, attn, use_reference=True, start=first) if c.beta > 0 else None
        params = self.shared.parameters(self.adapter_name("actor"))

        low, high = c.clip_range()

        def step(members, rows, stats) -> None:
            rows, st = rows[0].to(dev), stats[0]
            info: dict = {}
            logp, entropy = self._policy_forward(model, ids[rows], attn[rows], mask[rows], info=info)
            # with old == current (first pass) the clipped surrogate's gradient is exactly -A * grad log pi
            loss, s = F.policy_loss_with_stats(
                logp, old_logp[rows] if old_logp is not None else logp.detach(), advantages[rows], mask[rows],
                loss_type="dapo", clip_low=low, clip_high=high,
                ref_logp=ref_logp[rows] if ref_logp is not None else None, beta=c.beta)
            record(st, grad_norm=self.optimizer_step(loss, params), loss=loss.detach(), kl=s["kl"],
                   approx_kl=s["approx_kl"], clip_fraction=s["clip_fraction"],
                   entropy=F.masked_mean(entropy, mask[rows]), shared_prompt=info["shared_prompt"])

        with loss_forward(self.shared, self.adapter_name("actor"), True, c.disable_dropout) as model:
            stats = run_epochs([self], n, step, [{k: [] for k in METRICS}])[0]
        self.steps += 1
        return self._metrics(mean_metrics(stats), batch)

    def _optimizer_only_metrics(self, batch, n: int) -> dict[str, float]:
        """The update of a batch whose advantages are all zero, without its forwards and backward
        (:func:`~evollm.algorithms.updates.optimizer_only_update`); entropy and ``approx_kl`` not measured."""
        optimizer_only_update(self, self.shared.parameters(self.adapter_name("actor")), n)
        self.steps += 1
        nan = float("nan")
        return self._metrics({"loss": 0.0, "kl": 0.0, "approx_kl": nan, "clip_fraction": 0.0, "entropy": nan,
                              "grad_norm": 0.0, "epochs": float(self.config.update_epochs),
                              "learn_path": "no_gradient"}, batch)

    @staticmethod
    def _metrics(metrics: dict, batch) -> dict[str, float]:
        returns = batch.episode_returns()
        metrics.update(mean_reward=float(returns.mean()), mean_return=float(returns.mean()),
                       mean_turns=float(batch.turn_mask().sum(1).float().mean()),
                       completion_length=float(batch.action_mask.sum(1).float().mean()))
        return metrics
