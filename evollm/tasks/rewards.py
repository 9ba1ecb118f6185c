"""Reward functions for question/answer tasks.

Every reward function has the signature
``reward_fn(completion: str, answer: str, question: str) -> float``, where
``completion`` is the decoded model output (it may still contain ``<eos>``,
padding or other special tokens and whatever followed them).
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

RewardFn = Callable[[str, str, str], float]

#: Markers that end a completion: special tokens of the char tokenizer and a
#: few common ones of other tokenizers.
STOP_MARKERS: tuple[str, ...] = (
    "<eos>",
    "<pad>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "</s>",
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
)

_SPECIAL_RE = re.compile(r"<\|[^|>]*\|>")
_INT_RE = re.compile(r"[+-]?\d+")


def clean_completion(completion: str, stop_markers: Sequence[str] = STOP_MARKERS) -> str:
    """Cut ``completion`` at the first stop marker / special token and strip whitespace."""
    cut = len(completion)
    for marker in stop_markers:
        idx = completion.find(marker)
        if idx != -1:
            cut = min(cut, idx)
    m = _SPECIAL_RE.search(completion)
    if m is not None:
        cut = min(cut, m.start())
    return completion[:cut].strip()


def exact_match_reward(completion: str, answer: str, question: str = "") -> float:
    """1.0 if the cleaned completion equals the (stripped) answer, else 0.0."""
    return 1.0 if clean_completion(completion) == str(answer).strip() else 0.0


def format_reward(completion: str, answer: str = "", question: str = "", value: float = 0.1) -> float:
    """Partial credit ``value`` if the cleaned completion is a well-formed integer, else 0.0."""
    return value if _INT_RE.fullmatch(clean_completion(completion)) else 0.0


_NUMBER_RE = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?")


def _as_number(text) -> float | None:
    try:
        return float(str(text).replace(",", "").strip())
    except ValueError:
        return None


def last_number_reward(completion: str, answer, question: str = "") -> float:
    """1.0 if the last number in the cleaned completion equals the answer numerically (``"The
    answer is 42."`` scores for answer ``42``), else 0.0. Suits chat models that wrap the number
    in words; thousands separators are ignored."""
    numbers = _NUMBER_RE.findall(clean_completion(completion))
    target = _as_number(answer)
    if not numbers or target is None:
        return 0.0
    return 1.0 if _as_number(numbers[-1]) == target else 0.0


def numeric_closeness_reward(completion: str, answer: str, question: str = "") -> float:
    """Dense reward in [0, 1]: ``1 / (1 + |pred - answer|)`` for integer completions, else 0."""
    pred = clean_completion(completion)
    if not _INT_RE.fullmatch(pred):
        return 0.0
    try:
        target = int(str(answer).strip())
    except ValueError:
        return 0.0
    return 1.0 / (1.0 + abs(int(pred) - target))


def combine_rewards(*fns: RewardFn, weights: Sequence[float] | None = None) -> RewardFn:
    """Return a reward function computing the weighted sum of ``fns``.

    Args:
        *fns: Reward functions with the standard signature.
        weights: One weight per function; defaults to all 1.0.

    Raises:
        ValueError: If no function is given or the weights do not match.
    """
    if not fns:
        raise ValueError("combine_rewards needs at least one reward function")
    w = [1.0] * len(fns) if weights is None else [float(x) for x in weights]
    if len(w) != len(fns):
        raise ValueError(f"got {len(fns)} reward functions but {len(w)} weights")

    def combined(completion: str, answer: str, question: str = "") -> float:
        return float(sum(wi * fn(completion, answer, question) for wi, fn in zip(w, fns)))

    combined.__name__ = "combined_" + "_".join(getattr(f, "__name__", "fn") for f in fns)
    return combined


def well_formed_rate(completions: Sequence[str], eos_token: str = "<eos>") -> float:
    """Fraction of completions that are an integer immediately followed by ``eos_token``."""
    if not completions:
        return 0.0
    ok = 0
    for c in completions:
        head, sep, _ = c.partition(eos_token)
        ok += int(bool(sep) and head == head.strip() and format_reward(head) > 0)
    return ok / len(completions)
