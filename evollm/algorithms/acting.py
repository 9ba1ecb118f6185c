"""What every sampling member shares: sampling completions.

:class:`Acting` is a mixin of the algorithms (GRPO and its variants, LLMPPO, LLMREINFORCE): ``group_size``
completions per prompt from :mod:`evollm.rollout` (one greedy completion when not training). Founders are
built by :meth:`evollm.algorithms.member.Member.population`, for every kind of member.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from ..rollout import Rollout, generate_population


class ActionResult(NamedTuple):
    """What :meth:`Acting.get_action` returns; unpacks as ``completion_ids, action_masks``."""

    completion_ids: list  # per prompt: [G, L] prompt + completion ids
    action_masks: list  # per prompt: [G, L-1], 1 on generated tokens


class Acting:
    """Sampling of a member (mixed into :class:`~evollm.algorithms.base.LLMAgent` subclasses)."""

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
