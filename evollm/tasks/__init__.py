"""Synthetic tasks and reward functions."""

from evollm.tasks.arithmetic import ARITHMETIC_TEMPLATE, OPS, arithmetic_dataset, extra_split, solve
from evollm.tasks.rewards import (
    STOP_MARKERS,
    RewardFn,
    clean_completion,
    combine_rewards,
    exact_match_reward,
    format_reward,
    numeric_closeness_reward,
    well_formed_rate,
)

__all__ = [
    "ARITHMETIC_TEMPLATE",
    "OPS",
    "STOP_MARKERS",
    "RewardFn",
    "arithmetic_dataset",
    "clean_completion",
    "combine_rewards",
    "exact_match_reward",
    "extra_split",
    "format_reward",
    "numeric_closeness_reward",
    "solve",
    "well_formed_rate",
]
