"""Environments: single-turn ``ReasoningGym`` and the multi-turn ``TokenObservationWrapper``."""

from .multiturn import TokenObservationWrapper
from .reasoning import ReasoningGym, RewardFunctionError

__all__ = ["ReasoningGym", "RewardFunctionError", "TokenObservationWrapper"]
