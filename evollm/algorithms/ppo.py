"""LLMPPO: turn-level actor-critic PPO on LoRA adapters of a shared base model.

A member owns two adapters on the shared base, ``actor`` and ``critic``, plus a value head
(``Linear(hidden, 1)``) on the critic's last hidden state, and ONE optimizer with two
named param groups: ``"actor"`` (lr ``lr_actor``) and ``"critic"`` (lr ``lr_critic``:
critic adapter + value head).  ``lr`` is an alias of ``lr_actor``.  The reference policy
for the KL penalty is the base with every adapter disabled.

Read top to bottom in :meth:`LLMPPO.learn`:

1. stack the episodes (``(ids, action_masks, turn_ids, rewards[B, K])``, or the single-turn
   ``(ids, action_masks, rewards)`` where every action token is turn 0);
2. value of each turn from the critic: by default the value of the state *before* the turn
   (``turn_value_reduce="first"``: the position that predicts the turn's first token, which
   has not seen the action), or at the turn's last action token (``"last"``) or the mean over
   the turn's tokens (``"mean"``);
3. GAE across turns (a turn is one action; its reward counts once), optional whitening,
   advantages broadcast to the turn's tokens.  ``action_granularity="token"`` instead runs
   GAE over action tokens with each turn's reward on its last token;
4. ``update_epochs`` passes of minibatches: clipped policy loss (+ ``beta`` * k3 KL to the
   reference) - ``ent_coef`` * entropy on the actor, ``vf_coef`` * clipped value loss on the
   critic; gradients clipped per group, one optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import functional as F
from evollm.parallel import zero
from evollm.parallel.distributed import all_reduce_gradients
from ..rollout import action_start, first_target, forward_logits, loss_forward
from .base import AgentConfig
from .multiturn_rollout import (EpisodeAgent, EpisodeBatch, episode_batch, last_token_of_turn, pack_actions,
                                unpack_actions)

GRANULARITIES = ("turn", "token", "auto")
TURN_VALUE_REDUCTIONS = ("first", "last", "mean")


@dataclass
class LLMPPOConfig(AgentConfig):
    """PPO hyperparameters (see :class:`AgentConfig` for the shared ones).

    ``lr_actor`` defaults to ``lr`` and ``lr_critic`` to ``lr_actor``; after construction ``lr`` and
    ``lr_actor`` are kept equal (setting either sets both)."""

    lr: float = 1e-4
    lr_actor: float | None = None
    lr_critic: float | None = None
    #: clip of the value loss around the old values (``|V - V_old| <= value_clip``); None: unclipped. Its own
    #: setting: the policy clip (clip_coef / clip_low / clip_high) never moves it
    value_clip: float | None = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    gamma: float = 1.0
    gae_lambda: float = 0.95
    update_epochs: int = 2
    batch_size: int = 8
    group_size: int = 1
    action_granularity: str = "turn"
    turn_value_reduce: str = "first"
    adv_whitening: bool = True

    def validate(self) -> None:
        super().validate()
        self.lr_actor = self.lr if self.lr_actor is None else self.lr_actor
        self.lr = self.lr_actor
        self.lr_critic = self.lr_actor if self.lr_critic is None else self.lr_critic
        if self.action_granularity not in GRANULARITIES:
            raise ValueError(f"action_granularity={self.action_granularity!r}; choose one of {list(GRANULARITIES)}")
        if self.turn_value_reduce not in TURN_VALUE_REDUCTIONS:
            raise ValueError(f"turn_value_reduce={self.turn_value_reduce!r}; choose one of "
                             f"{list(TURN_VALUE_REDUCTIONS)}")
        if self.batch_size < 1 or self.update_epochs < 1 or self.group_size < 1:
            raise ValueError(f"batch_size, update_epochs and group_size must be >= 1, got {self.batch_size}, "
                             f"{self.update_epochs}, {self.group_size}")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.gae_lambda <= 1.0):
            raise ValueError(f"gamma and gae_lambda must be in [0, 1], got {self.gamma}, {self.gae_lambda}")
        if self.value_clip is not None and not (isinstance(self.value_clip, (int, float)) and self.value_clip >= 0):
            raise ValueError(f"value_clip must be >= 0 or None (unclipped), got {self.value_clip!r}")


class LLMPPO(EpisodeAgent):
    """Turn-level PPO with actor and critic adapters and a value head, all on ONE shared base.

    ``LLMPPO(model, pad_token_id, pad_token, lr_actor=1e-4, lr_critic=1e-4, clip_coef=0.2, vf_coef=0.5,
    gamma=1.0, gae_lambda=0.95, ...)``: any :class:`LLMPPOConfig` field as a keyword, or ``config=``.
    """

    config_cls = LLMPPOConfig
    ROLES = ("actor", "critic")
    MUTABLE = ("lr", "lr_actor", "lr_critic", "clip_coef", "clip_low", "clip_high", "value_clip", "vf_coef", "ent_coef",
               "gamma", "gae_lambda", "beta", "update_epochs", "batch_size", "temperature", "top_p", "top_k",
               "max_grad_norm")

    # ------------------------------------------------------------------ networks and optimizer
    def _init_extra_modules(self) -> None:
        hidden = self.shared.model.get_base_model().config.hidden_size
        self.value_head = torch.nn.Linear(hidden, 1).to(self.device)
        torch.nn.init.zeros_(self.value_head.weight)  # V = 0 until the critic learns
        torch.nn.init.zeros_(self.value_head.bias)

    def _extra_parameters(self) -> dict[str, list[torch.nn.Parameter]]:
        return {"value_head": list(self.value_head.parameters())}

    def _param_groups(self) -> list[dict]:
        c = self.config
        return [
            {"name": "actor", "params": self.shared.parameters(self.adapter_name("actor")), "lr": c.lr_actor},
            {"name": "critic", "params": self.shared.parameters(self.adapter_name("critic"))
             + list(self.value_head.parameters()), "lr": c.lr_critic},
        ]

    def _group_params(self, name: str) -> list[torch.nn.Parameter]:
        return next(g["params"] for g in self.optimizer.param_groups if g.get("name") == name)

    def _apply_hyperparameter(self, name: str, value) -> None:
        if name in ("lr", "lr_actor"):
            self.config.lr = self.config.lr_actor = value
            self._set_group_lr("actor", value)
        elif name == "lr_critic":
            self._set_group_lr("critic", value)

    # ------------------------------------------------------------------ critic
    def _token_values(self, ids: torch.Tensor, attn: torch.Tensor, first: int = 0) -> torch.Tensor:
        """``[B, L-1]`` critic values; position ``t`` is the value of the prefix ``ids[:, :t+1]`` (the state
        from which ``ids[:, t+1]`` is generated), from column ``first`` on (0 before it: the columns no action
        reads; the prompt runs once per group, see :func:`evollm.rollout.forward_logits`, and the output head
        not at all). Gradients flow when called with grad enabled."""
        with loss_forward(self.shared, self.adapter_name("critic"), torch.is_grad_enabled(),
                          self.config.disable_dropout) as model:
            hidden = forward_logits(model, ids, attn, first, head=False)[1]
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        return torch.nn.functional.pad(values, (first, 0))

    def get_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, L-1]`` critic values of every prefix (see :meth:`_token_values`). No gradients."""
        attn = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        with torch.no_grad():
            return self._token_values(input_ids.to(self.device), attn.to(self.device))

    def _state_values(self, token_values: torch.Tensor, batch: EpisodeBatch, token_level: bool):
        """The values the critic is trained on: per token (token level) or per turn. Returns
        ``(values, mask)``, ``[B, T]`` or ``[B, K]``."""
        if token_level:
            return token_values, batch.action_mask.bool()
        k, reduce = batch.num_turns, self.config.turn_value_reduce
        if reduce == "first":  # the last position when read right to left
            values = F.turn_values_from_tokens(token_values.flip(1), batch.turn_ids.flip(1), k, "last")
        else:
            values = F.turn_values_from_tokens(token_values, batch.turn_ids, k, reduce)
        return values, batch.turn_mask()

    # ------------------------------------------------------------------ advantages
    def _token_level(self, batch: EpisodeBatch) -> bool:
        g = self.config.action_granularity
        return g == "token" or (g == "auto" and batch.num_turns == 1)

    def _advantages(self, batch: EpisodeBatch, old_values: torch.Tensor, value_mask: torch.Tensor, token_level: bool):
        """``(token advantages [B, T], returns, advantages)``; returns/advantages are per turn ``[B, K]``
        or per token ``[B, T]``, like ``old_values``."""
        c = self.config
        if token_level:
            last = last_token_of_turn(batch.turn_ids, batch.num_turns)
            token_rewards = torch.where(last, F.broadcast_turn_values(batch.rewards, batch.turn_ids), 0.0)
            r, m, index = pack_actions(token_rewards, value_mask)
            v, _, _ = pack_actions(old_values, value_mask)
            adv, ret = F.gae(r, v, m, c.gamma, c.gae_lambda)
            width = old_values.shape[1]
            adv, ret = unpack_actions(adv, m, index, width), unpack_actions(ret, m, index, width)
        else:
            adv, ret = F.gae(batch.rewards, old_values, value_mask, c.gamma, c.gae_lambda)
        if c.adv_whitening:
            adv = F.masked_whiten(adv, value_mask)
        token_adv = adv if token_level else F.broadcast_turn_values(adv, batch.turn_ids)
        return token_adv * batch.action_mask, ret, adv

    def advantages(self, experiences) -> dict[str, torch.Tensor]:
        """The quantities :meth:`learn` would train on, for inspection: ``advantages`` ([B, T], per
        token), ``returns`` and ``values`` (per turn ``[B, K]``, or per token at token granularity)."""
        batch = episode_batch(experiences, self.pad_token_id)
        token_level = self._token_level(batch)
        values, vmask = self._state_values(self.get_values(batch.input_ids, batch.attention_mask).cpu(), batch,
                                           token_level)
        token_adv, returns, _ = self._advantages(batch, values, vmask, token_level)
        return {"advantages": token_adv, "returns": returns, "values": values}

    # ------------------------------------------------------------------ learning
    def learn(self, experiences) -> dict[str, float]:
        """One PPO update from ``(ids, action_masks, turn_ids, rewards[B, K])`` (multi-turn episodes, see
        :func:`~evollm.rollout.stack_episodes`) or ``(completion_ids, action_masks,
        rewards)`` (single turn, as from :meth:`get_action`). Returns mean metrics."""
        c = self.config
        batch = episode_batch(experiences, self.pad_token_id)
        dev = self.device
        ids, attn, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.action_mask.to(dev)
        batch = EpisodeBatch(ids, attn, mask, batch.turn_ids.to(dev), batch.rewards.to(dev))
        token_level = self._token_level(batch)
        n = ids.shape[0]
        needs_old = c.update_epochs > 1 or c.batch_size < n
        with torch.no_grad():
            first = first_target(mask)  # the loss reads no column before the first action token
            old_values, vmask = self._state_values(self._token_values(ids, attn, action_start(mask)), batch,
                                                   token_level)
            old_logp = self.get_logprobs(ids, attn, start=first) if needs_old else None
            ref_logp = self.get_logprobs(ids, attn, use_reference=True, start=first) if c.beta > 0 else None
            token_adv, returns, _ = self._advantages(batch, old_values, vmask, token_level)

        stats: dict[str, list[float]] = {k: [] for k in ("loss", "policy_loss", "value_loss", "entropy", "kl",
                                                         "clip_fraction", "grad_norm_actor", "grad_norm_critic",
                                                         "shared_prompt")}
        gen = torch.Generator().manual_seed(c.seed + self.steps)
        for _ in range(c.update_epochs):
            order = torch.randperm(n, generator=gen)
            for start in range(0, n, c.batch_size):
                rows = order[start:start + c.batch_size].to(dev)
                sub = EpisodeBatch(ids[rows], attn[rows], mask[rows], batch.turn_ids[rows], batch.rewards[rows])
                self.optimizer.zero_grad(set_to_none=True)
                # actor: clipped policy loss (+ KL) - entropy bonus
                with loss_forward(self.shared, self.adapter_name("actor"), True, c.disable_dropout) as model:
                    info: dict = {}
                    logp, entropy = self._policy_forward(model, sub.input_ids, sub.attention_mask, sub.action_mask,
                                                         c.ent_coef != 0, info)
                    entropy = F.masked_mean(entropy, sub.action_mask)
                    pg_loss, st = F.policy_loss_with_stats(
                        logp, old_logp[rows] if old_logp is not None else logp.detach(), token_adv[rows],
                        sub.action_mask, loss_type="dapo", clip_low=c.clip_range()[0], clip_high=c.clip_range()[1],
                        ref_logp=ref_logp[rows] if ref_logp is not None else None, beta=c.beta)
                    actor_loss = pg_loss - c.ent_coef * entropy
                    zero.track(self.optimizer, actor_loss, "actor").backward()
                # critic: clipped value loss
                values, _ = self._state_values(self._token_values(sub.input_ids, sub.attention_mask,
                                                                  action_start(sub.action_mask)), sub, token_level)
                v_loss = F.value_loss(values, old_values[rows], returns[rows], vmask[rows], clip=c.value_clip)
                zero.track(self.optimizer, c.vf_coef * v_loss, "critic").backward()
                for name, norm in zip(("grad_norm_actor", "grad_norm_critic"), self.clip_and_step_groups()):
                    stats[name].append(norm)
                stats["loss"].append(float(actor_loss.detach() + c.vf_coef * v_loss.detach()))
                stats["policy_loss"].append(float(pg_loss.detach()))
                stats["value_loss"].append(float(v_loss.detach()))
                stats["entropy"].append(float(entropy.detach()))
                stats["kl"].append(st["kl"])
                stats["clip_fraction"].append(st["clip_fraction"])
                stats["shared_prompt"].append(info["shared_prompt"])
        self.steps += 1
        metrics = {k: sum(v) / len(v) for k, v in stats.items()}
        episode_returns = batch.episode_returns()
        metrics.update(mean_reward=float(episode_returns.mean()), mean_return=float(episode_returns.mean()),
                       explained_variance=_explained_variance(old_values, returns, vmask),
                       mean_turns=float(batch.turn_mask().sum(1).float().mean()),
                       completion_length=float(mask.sum(1).float().mean()))
        return metrics

    def clip_and_step_groups(self) -> tuple[float, float]:
        """Clip the actor's and the critic's gradients to ``max_grad_norm`` each, then one optimizer
        step; returns both norms before clipping. Under DeepSpeed ZeRO each group is its own engine,
        which reduces, clips and steps it (:class:`evollm.parallel.zero.ZeroGroups`)."""
        if zero.is_zero(self.optimizer):
            self.optimizer.max_grad_norm = self.config.max_grad_norm
            self.optimizer.step()
            norms = self.optimizer.last_grad_norms
            return norms["actor"], norms["critic"]
        norms = self._clip("actor"), self._clip("critic")
        self.optimizer.step()
        return norms

    def _clip(self, group: str) -> float:
        """Clip one param group's gradient to ``max_grad_norm``; returns the norm before clipping."""
        max_norm = self.config.max_grad_norm
        all_reduce_gradients(list(self._group_params(group)))  # multi-process: average over processes
        params = [p for p in self._group_params(group) if p.grad is not None]
        if not params:
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf")))


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over valid cells (nan when the returns do not vary)."""
    m = mask.bool()
    r, v = returns[m].float(), values[m].float()
    if r.numel() < 2 or float(r.var()) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var() / r.var())
