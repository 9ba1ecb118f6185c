"""What every sampling member shares: building a population of founders and sampling completions.

:class:`Acting` is a mixin of the algorithms (GRPO and its variants, LLMPPO, LLMREINFORCE): members
built on ONE shared base with founders drawn from an ``hp_config``, and ``group_size`` completions per
prompt from :mod:`evollm.rollout` (one greedy completion when not training).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..rollout import Rollout, generate_population


class ActionResult(NamedTuple):
    """What :meth:`Acting.get_action` returns; unpacks as ``completion_ids, action_masks``."""

    completion_ids: list  # per prompt: [G, L] prompt + completion ids
    action_masks: list  # per prompt: [G, L-1], 1 on generated tokens


class Acting:
    """Population constructor and sampling of a member (mixed into :class:`~evollm.algorithms.base.LLMAgent`
    subclasses)."""

    @classmethod
    def population(cls, size: int, actor_network: torch.nn.Module | None = None, hp_config=None,
                   init_hyperparameters=None, init_sampler: str | None = "qmc", **kwargs) -> list:
        """``size`` members on ONE shared base.

        With an ``hp_config`` the founders' hyperparameters are drawn from it with ``init_sampler``
        (``"qmc"``: scrambled Sobol, the default; ``"random"``, ``"tpe"``, an Optuna sampler, or
        ``None`` for identical founders), seeded with ``seed``; a value the caller passes as a keyword
        (e.g. ``lr=1e-3``) is kept for every founder. ``init_hyperparameters``: an explicit list of
        per-member dicts instead (e.g. from :func:`evollm.hpo.initial_population_hyperparameters`)."""
        from ..hpo.founders import founder_hyperparameters
        from .base import _resolve_actor
        if actor_network is None:  # AgileRL's model_name=: load the base once, share it
            actor_network, tok = _resolve_actor(None, kwargs.pop("model_name", None), kwargs.get("tokenizer"))
            kwargs.setdefault("tokenizer", tok)
        if size < 1:
            raise ValueError(f"population size must be >= 1, got {size}")
        init = founder_hyperparameters(size, hp_config, init_hyperparameters, init_sampler,
                                       fixed=kwargs, seed=kwargs.get("seed", 0))
        members = []
        for hps in init:
            member = cls(actor_network, hp_config=hp_config, **kwargs)
            for name, value in hps.items():
                member.set_hyperparameter(name, value)
            members.append(member)
        return members

    def get_action(self, prompts: Sequence[dict], training: bool = True) -> ActionResult:
        """Sample ``group_size`` completions per prompt (one greedy completion when not training).

        Returns an :class:`ActionResult` ``(completion_ids, action_masks)``: lists with one tensor
        per prompt, of shapes ``[G, L]`` (prompt + completion) and ``[G, L-1]``.
        """
        rollout = self.rollout(prompts, training)
        return ActionResult(*rollout.per_prompt())

    def rollout(self, prompts: Sequence[dict], training: bool = True) -> Rollout:
        """This member's samples of ``prompts`` (``group_size`` per prompt when training, else one greedy)."""
        return generate_population([self], prompts, training)[self.index]
