"""Offline tiny model, character-level tokenizer and the partial SFT warm start.

The main entry point is :func:`load_tiny_model`, which returns a
``(model, tokenizer)`` pair that needs no network access.
"""

from evollm.models.tiny import (
    TINY_DEFAULTS,
    build_tiny_model,
    config_for_tokenizer,
    count_parameters,
    set_generation_ids,
    tiny_config,
)
from evollm.models.tokenizer import (
    ALPHABET,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
    tokenizer_fingerprint,
)
from evollm.models.warm_start import (
    SFT_DEFAULTS,
    build_warm_start,
    default_cache_dir,
    evaluate_accuracy,
    generate_completions,
    load_tiny_model,
    render_prompt,
    sft_warm_start,
    teacher_forced_accuracy,
    well_formed_rate,
)

__all__ = [
    "ALPHABET",
    "CHAT_TEMPLATE",
    "SFT_DEFAULTS",
    "SPECIAL_TOKENS",
    "TINY_DEFAULTS",
    "build_tiny_model",
    "build_tokenizer",
    "build_warm_start",
    "config_for_tokenizer",
    "count_parameters",
    "default_cache_dir",
    "evaluate_accuracy",
    "generate_completions",
    "load_tiny_model",
    "render_prompt",
    "set_generation_ids",
    "sft_warm_start",
    "teacher_forced_accuracy",
    "tiny_config",
    "tokenizer_fingerprint",
    "well_formed_rate",
]
