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
   GAE over action tokens with each turn's reward on its last token.  An episode cut short (a turn
   limit or the context length, ``truncated``) is not terminal: GAE bootstraps it from the critic's
   value of the conversation after its last turn;
4. ``update_epochs`` passes of minibatches (fewer when ``target_kl`` is exceeded): clipped policy
   loss (+ ``beta`` * k3 KL to the reference) - ``ent_coef`` * entropy on the actor, ``vf_coef`` *
   value loss (clipped by ``value_clip``) on the critic; gradients clipped per group, one optimizer
   step.  Steps 2-4 are :func:`evollm.algorithms.ppo_update.ppo_update`, the one PPO update, run with
   this member alone or with others that share its passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import functional as F
from evollm.parallel import zero
from evollm.parallel.distributed import all_reduce_gradients, batch_reduce
from .base import AgentConfig
from ..utils.fields import documented
from .compat import AgileRLMetrics, with_turn_ids
from .multiturn_rollout import (EpisodeAgent, EpisodeBatch, episode_batch, last_token_of_turn, pack_actions,
                                unpack_actions)
from .memory_plan import learn_path, member_chunks
from .ppo_update import common_width, head_values, learn_grouped, member_forward, ppo_update, value_adapter

GRANULARITIES = ("turn", "token", "auto")
TURN_VALUE_REDUCTIONS = ("first", "last", "mean")


@dataclass
class LLMPPOConfig(AgentConfig):
    """PPO hyperparameters (see :class:`AgentConfig` for the shared ones).

    ``lr_actor`` defaults to ``lr`` and ``lr_critic`` to ``lr_actor``'s starting value; after construction ``lr``
    and ``lr_actor`` are kept equal (setting either sets both), and ``lr_critic`` changes only when set itself."""

    lr: float = 1e-4
    lr_actor: float | None = documented(None, "AdamW learning rate of the actor adapter; None: lr (afterwards lr "
                                        "and lr_actor are kept equal: setting either sets both).")
    lr_critic: float | None = documented(None, "Learning rate of the critic adapter and the value head; None: "
                                         "lr_actor's value at construction, which the critic keeps when evolution, "
                                         "an anneal or a roll-back changes lr_actor (name lr_critic in "
                                         "hpo.hp_config to evolve it).")
    value_clip: float | None = documented(
        0.2, "Clip of the value loss around the old values (|V - V_old| <= value_clip); None: unclipped. Its own "
        "setting: the policy clip (clip_coef / clip_low / clip_high) never moves it.")
    vf_coef: float = documented(0.5, "Weight of the value loss.")
    ent_coef: float = documented(0.0, "Weight of the entropy bonus.")
    gamma: float = documented(1.0, "Discount across turns.")
    gae_lambda: float = documented(0.95, "GAE lambda across turns (or tokens with action_granularity='token').")
    update_epochs: int = 2
    batch_size: int = 8
    group_size: int = documented(1, "Samples (episodes) per prompt or seed.")
    action_granularity: str = documented("turn", "'turn': a turn is one action (GAE across turns, its reward "
                                         "counted once); 'token': GAE over action tokens, each turn's reward on "
                                         "its last token; 'auto': token for single-turn episodes, else turn.")
    turn_value_reduce: str = documented("first", "Value of a turn: 'first' (the state before the turn), 'last' (at "
                                        "its last action token) or 'mean' (over its tokens).")
    adv_whitening: bool = documented(True, "Whiten advantages per update.")

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
    HAS_CRITIC = True
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
    def critic_values(self, ids: torch.Tensor, attn: torch.Tensor, first: int = 0) -> torch.Tensor:
        """``[B, L-1]`` critic values; position ``t`` is the value of the prefix ``ids[:, :t+1]`` (the state
        from which ``ids[:, t+1]`` is generated), computed from column ``first`` on (the columns no action
        reads are the value of an all-zero state; the prompt runs once per group and the output head not at
        all, see :func:`evollm.rollout.forward_logits`). Gradients flow when called with grad enabled."""
        with member_forward([self], [value_adapter(self)], torch.is_grad_enabled()) as forward:
            return head_values(self, forward(ids, attn, True, first, logits=False)[1])

    def get_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, L-1]`` critic values of every prefix that predicts a token (see :meth:`critic_values`).
        No gradients."""
        attn = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        with torch.no_grad():
            return self.critic_values(input_ids.to(self.device), attn.to(self.device))

    def state_values(self, token_values: torch.Tensor, batch: EpisodeBatch, token_level: bool):
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
    def is_token_level(self, batch: EpisodeBatch) -> bool:
        """Whether GAE runs over action tokens for ``batch`` (action_granularity token, or auto on one turn)."""
        g = self.config.action_granularity
        return g == "token" or (g == "auto" and batch.num_turns == 1)

    def gae_advantages(self, batch: EpisodeBatch, old_values: torch.Tensor, value_mask: torch.Tensor, token_level: bool,
                        bootstrap: torch.Tensor | None = None):
        """``(token advantages [B, T], returns, advantages)``; returns/advantages are per turn ``[B, K]``
        or per token ``[B, T]``, like ``old_values``. ``bootstrap``: ``[B]`` value after each episode's last
        turn (:func:`evollm.functional.truncation_bootstrap`: the critic's, for an episode cut short; 0 for
        one that ended)."""
        c = self.config
        if token_level:
            last = last_token_of_turn(batch.turn_ids, batch.num_turns)
            token_rewards = torch.where(last, F.broadcast_turn_values(batch.rewards, batch.turn_ids), 0.0)
            r, m, index = pack_actions(token_rewards, value_mask)
            v, _, _ = pack_actions(old_values, value_mask)
            adv, ret = F.gae(r, v, m, c.gamma, c.gae_lambda, last_values=bootstrap)
            width = old_values.shape[1]
            adv, ret = unpack_actions(adv, m, index, width), unpack_actions(ret, m, index, width)
        else:
            adv, ret = F.gae(batch.rewards, old_values, value_mask, c.gamma, c.gae_lambda, last_values=bootstrap)
        if c.adv_whitening:
            adv = F.masked_whiten(adv, value_mask, reduce=batch_reduce())  # over every process's share
        token_adv = adv if token_level else F.broadcast_turn_values(adv, batch.turn_ids)
        return token_adv * batch.action_mask, ret, adv

    def advantages(self, experiences) -> dict[str, torch.Tensor]:
        """The quantities :meth:`learn` would train on, for inspection: ``advantages`` ([B, T], per
        token), ``returns`` and ``values`` (per turn ``[B, K]``, or per token at token granularity)."""
        given = episode_batch(experiences, self.pad_token_id)
        batch = common_width([given], self.pad_token_id)[0]  # a column more when an episode was cut short
        token_level = self.is_token_level(batch)
        with torch.no_grad():
            token_values = self.critic_values(batch.input_ids.to(self.device),
                                              batch.attention_mask.to(self.device)).cpu()
        values, vmask = self.state_values(token_values, batch, token_level)
        boot = F.truncation_bootstrap(token_values, batch.action_mask, batch.truncated)
        token_adv, returns, _ = self.gae_advantages(batch, values, vmask, token_level, boot)
        width = given.action_mask.shape[1]
        if token_level:
            returns, values = returns[:, :width], values[:, :width]
        return {"advantages": token_adv[:, :width], "returns": returns, "values": values}

    # ------------------------------------------------------------------ learning
    def learn(self, experiences, turn_ids=None) -> dict[str, float]:
        """One PPO update from ``(ids, action_masks, turn_ids, rewards[B, K])`` (multi-turn episodes, see
        :func:`~evollm.rollout.stack_episodes`; a 5th element ``truncated[B]`` marks episodes cut short, which
        are bootstrapped from the critic) or ``(completion_ids, action_masks, rewards)`` (single turn, as
        from :meth:`get_action`). Returns mean metrics. The update is :func:`~evollm.algorithms.ppo_update.
        ppo_update` with this one member."""
        experiences = with_turn_ids(experiences, turn_ids)  # AgileRL's learn((ids, masks, rewards), turn_ids=)
        return AgileRLMetrics(ppo_update([self], [experiences])[0])

    @classmethod
    def learn_population(cls, agents, experiences) -> list[dict[str, float]]:
        """Update several members at once, each exactly as :meth:`learn` would: members whose update schedule
        agrees share every forward and backward pass (:func:`~evollm.algorithms.ppo_update.learn_grouped`), in
        the groups the memory plan allows (:func:`~evollm.algorithms.memory_plan.member_chunks`: a small
        model's members fuse, a large one's learn one by one, so the peak memory does not grow with the
        population). The metrics say which path ran (``learn_path``, ``learn_chunks``)."""
        experiences = [with_turn_ids(e, None) for e in experiences]
        batches = [episode_batch(e, a.pad_token_id) for a, e in zip(agents, experiences)]
        rows = max(min(b.input_ids.shape[0], a.config.batch_size) for a, b in zip(agents, batches))
        chunks = member_chunks(agents, rows, max(b.input_ids.shape[1] for b in batches))
        out: dict[int, dict] = {}
        for chunk in chunks:
            out.update(zip(chunk, learn_grouped([agents[i] for i in chunk], [experiences[i] for i in chunk])))
        path = learn_path(len(agents), len(chunks))
        return [AgileRLMetrics({**out[i], "learn_path": path, "learn_chunks": float(len(chunks))})
                for i in range(len(agents))]

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
