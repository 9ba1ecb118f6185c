"""Loading the shared base model: any hub id / HF folder / GGUF file (:func:`load_model`), the
packaged SmolLM2-135M-Instruct (:func:`load_smollm2`), and the offline tiny model with its
character-level tokenizer and partial SFT warm start (:func:`load_tiny_model`). Each returns a
``(model, tokenizer)`` pair.
"""

from evollm.models.loading import (
    load_model,
    load_smollm2,
    lora_config,
    set_threads,
    smollm2_available,
)
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
    "load_model",
    "load_smollm2",
    "load_tiny_model",
    "lora_config",
    "set_threads",
    "smollm2_available",
    "render_prompt",
    "set_generation_ids",
    "sft_warm_start",
    "teacher_forced_accuracy",
    "tiny_config",
    "tokenizer_fingerprint",
    "well_formed_rate",
]
