"""The front door: everything that turns a run config (or a demo) into objects and runs them.

* :mod:`evollm.recipes.cli` -- ``evollm train | resume | report`` (``python -m evollm ...``);
* :mod:`evollm.recipes.builders` -- config sections -> model + tokenizer, task, HPO engine (built once);
* :mod:`evollm.recipes.runners` -- per env type: build the env, measure the start, train, measure again;
* :mod:`evollm.recipes.warm_start`, :mod:`~evollm.recipes.multiturn_warm_start`,
  :mod:`~evollm.recipes.coop_warm_start` -- the offline tiny model's cached SFT warm starts on the demo
  tasks.

This room may import every other one; nothing in the library imports it.
"""

from evollm.recipes.coop_warm_start import load_tiny_coop_model
from evollm.recipes.multiturn_warm_start import evaluate_game, load_tiny_multiturn_model
from evollm.recipes.warm_start import (
    SFT_DEFAULTS,
    build_warm_start,
    evaluate_accuracy,
    generate_completions,
    load_tiny_model,
    render_prompt,
    sft_warm_start,
    teacher_forced_accuracy,
    well_formed_rate,
)

__all__ = [
    "SFT_DEFAULTS",
    "build_warm_start",
    "evaluate_accuracy",
    "evaluate_game",
    "generate_completions",
    "load_tiny_coop_model",
    "load_tiny_model",
    "load_tiny_multiturn_model",
    "render_prompt",
    "sft_warm_start",
    "teacher_forced_accuracy",
    "well_formed_rate",
]
