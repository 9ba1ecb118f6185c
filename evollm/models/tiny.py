"""A tiny Llama-architecture causal LM that runs fast on CPU.

The model is a regular :class:`transformers.LlamaForCausalLM`, so everything
that works with a real checkpoint (``generate``, peft LoRA on the usual
``q_proj``/``k_proj``/``v_proj``/``o_proj``/``gate_proj``/``up_proj``/
``down_proj`` modules, ``save_pretrained``) works with it too.  The Llama
architecture is used on purpose: with it, ``AutoTokenizer`` reloads the
character-level tokenizer saved next to the model unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

#: Default size of the tiny model (about 0.3M parameters with the char vocab).
TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=96,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.02,
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    hidden_act="silu",
)


def tiny_config(
    vocab_size: int,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    bos_token_id: int | None = None,
    **overrides: Any,
) -> LlamaConfig:
    """Return a small :class:`LlamaConfig`.

    Args:
        vocab_size: Size of the tokenizer vocabulary.
        pad_token_id: Padding id (``<pad>`` of the char tokenizer is 0).
        eos_token_id: End-of-sequence id.
        bos_token_id: Beginning-of-sequence id; the char tokenizer has none, so
            it defaults to the eos id.
        **overrides: Any :class:`LlamaConfig` field overriding :data:`TINY_DEFAULTS`.
    """
    kwargs = dict(TINY_DEFAULTS)
    kwargs.update(overrides)
    return LlamaConfig(
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id if bos_token_id is None else bos_token_id,
        **kwargs,
    )


def config_for_tokenizer(tokenizer: PreTrainedTokenizerBase, **overrides: Any) -> LlamaConfig:
    """Return :func:`tiny_config` with vocab size and special ids taken from ``tokenizer``."""
    return tiny_config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **overrides,
    )


def set_generation_ids(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase) -> None:
    """Point ``model.generation_config`` at the tokenizer's pad/eos ids (no length limits)."""
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        bos_token_id=bos,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, seed: int = 0, **overrides: Any
) -> LlamaForCausalLM:
    """Build a randomly initialised tiny model, deterministic in ``seed``.

    The global RNG state is saved and restored, so calling this does not
    perturb other random streams.

    Args:
        tokenizer: Tokenizer giving the vocab size and pad/eos ids.
        seed: Seed of the weight initialisation.
        **overrides: :class:`LlamaConfig` fields overriding :data:`TINY_DEFAULTS`.
    """
    config = config_for_tokenizer(tokenizer, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    set_generation_ids(model, tokenizer)
    model.eval()
    return model


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of (optionally only trainable) parameters, counting tied weights once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total
