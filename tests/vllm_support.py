"""Shared pieces of the vLLM tests (run in the vLLM stage; skipped when vLLM is missing).

vLLM's CPU attention supports head sizes 32, 64, 80, ...; the default tiny model has 24, so these
tests use the same tiny Llama with 3 heads of 32 (a warm start of it is built once per cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evollm.rollout.vllm_engine import apply_environment_defaults, vllm_available

apply_environment_defaults()
requires_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install evollm[vllm])")
VLLM_HEADS = dict(num_attention_heads=3, num_key_value_heads=3)


def tiny_vllm_model(cache_dir: str, warm_start: bool = True, sft_steps: int = 400):
    """``(model, tokenizer)``: the tiny Llama with vLLM-supported heads, SFT-warm-started on arithmetic."""
    import torch

    from evollm.models.tiny import build_tiny_model
    from evollm.models.tokenizer import build_tokenizer
    from evollm.recipes.warm_start import TASK_DEFAULTS, load_or_build, sft_warm_start
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset

    def build():
        tok = build_tokenizer()
        model = build_tiny_model(tok, seed=0, **VLLM_HEADS)
        if warm_start:
            train, _ = arithmetic_dataset(seed=0, **TASK_DEFAULTS)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                sft_warm_start(model, tok, train, ARITHMETIC_TEMPLATE, steps=sft_steps, lr=3e-3, schedule="constant")
            finally:
                torch.set_num_threads(threads)
        return model.eval(), tok

    name = f"tiny-vllm-h32-{'sft' + str(sft_steps) if warm_start else 'init'}-v1"
    return load_or_build(Path(cache_dir) / name, build)
