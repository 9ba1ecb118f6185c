"""AgileRL's ``finetune_llm_reasoning`` keywords, mapped onto evollm's loop.

* ``selection_strategy=`` is ``tournament=`` (any selector with ``select(population)``).
* ``max_steps``: evollm counts **iterations** (each: every member answers one batch of
  ``data_batch_size_per_gpu`` prompts, then learns). AgileRL counts **prompts**, summed over the
  population. ``max_steps_unit="prompts"`` follows AgileRL's meaning; a script that looks written
  for AgileRL (it passes one of AgileRL's own keywords) and does not say is warned.
* ``num_epochs``: passes over the training set, instead of ``max_steps``.
* ``max_reward``: stop after an evaluation whose best fitness reaches it.
* ``init_hp``, ``wb``, ``accelerator``, ``checkpoint_steps=None``, ``wandb_api_key``: accepted; they
  have no effect here (logging and checkpoints are callbacks; ``wb=True`` and an ``accelerator`` print a
  one-time note). ``max_steps`` with ``num_epochs``: ``num_epochs`` is used, with a warning.
* ``env_fn=`` instead of ``env=``: evollm calls it once; every member answers the same prompts.
"""

from __future__ import annotations

import math
import warnings

AGILERL_ONLY = ("init_hp", "wb", "accelerator", "checkpoint_steps", "wandb_api_key", "checkpoint_path",
                "overwrite_checkpoints")
UNITS = ("iterations", "prompts")


def resolve_max_steps(max_steps: int | None, num_epochs: float | None, unit: str | None, prompts_per_member: int,
                      n_members: int, dataset_rows: int, agilerl_style: bool) -> int:
    """Iterations of the evolution loop for the given budget (see the module docstring)."""
    if unit is not None and unit not in UNITS:
        raise ValueError(f"max_steps_unit={unit!r} is not valid; choose one of {list(UNITS)}")
    if max_steps is not None and num_epochs is not None:  # AgileRL: num_epochs wins, with a warning
        warnings.warn(f"num_epochs={num_epochs} and max_steps={max_steps} both given: num_epochs is used, "
                      "max_steps ignored", UserWarning, stacklevel=3)
        max_steps = None
    if num_epochs is not None:
        if num_epochs <= 0:
            raise ValueError(f"num_epochs must be > 0, got {num_epochs}")
        return max(1, math.ceil(num_epochs * dataset_rows / prompts_per_member))
    if max_steps is None:
        raise ValueError("max_steps (or num_epochs) is required")
    if unit == "prompts":
        return max(1, math.ceil(max_steps / (prompts_per_member * n_members)))
    if unit is None and agilerl_style:
        warnings.warn(f"max_steps={max_steps} counts iterations in evollm (each: {n_members} member(s) x "
                      f"{prompts_per_member} prompts); AgileRL counts prompts, so this run does "
                      f"{prompts_per_member * n_members}x the work an AgileRL run would. Pass "
                      "max_steps_unit='prompts' to follow AgileRL, or 'iterations' to silence this.", stacklevel=3)
    return int(max_steps)


def agilerl_extras(kwargs: dict) -> bool:
    """Check AgileRL-only keywords of ``finetune_llm_reasoning``; True when any was given."""
    unknown = sorted(set(kwargs) - set(AGILERL_ONLY))
    if unknown:
        raise TypeError(f"finetune_llm_reasoning got unexpected keyword(s) {unknown}")
    from evollm.algorithms.compat import note_once
    if kwargs.get("wb"):
        note_once("wb", "Weights & Biases logging is not started by this flag: pass a logging callback "
                        "(or logging.wandb in a run config)")
    if kwargs.get("accelerator") is not None:
        note_once("accelerator", "the Accelerator object is not used; launch with `accelerate launch` for "
                                 "several processes")
    return bool(kwargs)


def pick_env(env, env_fn):
    """AgileRL's ``env_fn=``: evollm builds ONE env from it (every member answers the same prompts)."""
    if env is not None and env_fn is not None:
        raise ValueError("Provide exactly one of 'env' or 'env_fn'")
    if env is None and env_fn is None:
        raise ValueError("Either 'env' or 'env_fn' must be provided")
    return env if env is not None else env_fn()


def pick_selection(tournament, selection_strategy):
    """``selection_strategy`` is AgileRL's name for ``tournament``."""
    if tournament is not None and selection_strategy is not None and tournament is not selection_strategy:
        raise ValueError("give tournament= or selection_strategy= (its AgileRL name), not both")
    return tournament if tournament is not None else selection_strategy
