"""Loading the shared base model: any hub id / HF folder / GGUF file (:func:`load_model`), the
packaged SmolLM2-135M-Instruct (:func:`load_smollm2`), and the offline tiny Llama with its
character-level tokenizer (:func:`build_tiny_model`, :func:`build_tokenizer`). A leaf: it imports
nothing above :mod:`evollm.adapters`. The tiny model's warm starts (SFT on the demo tasks) are
recipes: :func:`evollm.recipes.load_tiny_model`.
"""

from evollm.models.loading import (
    default_cache_dir,
    enable_gradient_checkpointing,
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

__all__ = [
    "ALPHABET",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_DEFAULTS",
    "build_tiny_model",
    "build_tokenizer",
    "config_for_tokenizer",
    "count_parameters",
    "default_cache_dir",
    "enable_gradient_checkpointing",
    "load_model",
    "load_smollm2",
    "lora_config",
    "set_threads",
    "smollm2_available",
    "set_generation_ids",
    "tiny_config",
    "tokenizer_fingerprint",
]
