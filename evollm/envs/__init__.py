"""Environments: single-turn ``ReasoningGym`` and the multi-turn token wrapper."""

from .reasoning import ReasoningGym, RewardFunctionError

__all__ = ["ReasoningGym", "RewardFunctionError"]
