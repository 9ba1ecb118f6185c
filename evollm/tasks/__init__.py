"""Tasks: synthetic ones, users' own datasets (:mod:`evollm.tasks.user`) and reward functions."""

from evollm.tasks.arithmetic import ARITHMETIC_TEMPLATE, OPS, arithmetic_dataset, extra_split, solve
from evollm.tasks.rewards import (
    STOP_MARKERS,
    RewardFn,
    clean_completion,
    combine_rewards,
    exact_match_reward,
    format_reward,
    last_number_reward,
    numeric_closeness_reward,
    well_formed_rate,
)
from evollm.tasks.user import BUILTIN_REWARDS, load_split, rename_columns, resolve_reward, user_task

__all__ = [
    "BUILTIN_REWARDS",
    "load_split",
    "rename_columns",
    "resolve_reward",
    "user_task",
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
    "last_number_reward",
    "numeric_closeness_reward",
    "solve",
    "well_formed_rate",
]
