"""Synthetic integer-arithmetic question/answer tasks.

Questions look like ``"12+34="`` and answers like ``"46"``.  Datasets are
generated deterministically from a seed, and the train and test splits never
share a question.
"""

from __future__ import annotations

import random
from typing import Sequence

from datasets import Dataset

#: Supported operators and their Python implementation.
OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}

#: Conversation template for arithmetic prompts; ``{question}`` is filled with
#: ``str.format`` before the tokenizer chat template is applied.
ARITHMETIC_TEMPLATE: list[dict[str, str]] = [{"role": "user", "content": "{question}"}]


def _operand_range(digits: tuple[int, int]) -> tuple[int, int]:
    """Inclusive range of non-negative integers with ``digits[0]..digits[1]`` digits."""
    lo_d, hi_d = digits
    if lo_d < 1 or hi_d < lo_d:
        raise ValueError(f"digits must be (min, max) with 1 <= min <= max, got {digits}")
    lo = 0 if lo_d == 1 else 10 ** (lo_d - 1)
    return lo, 10**hi_d - 1


def solve(question: str) -> str:
    """Compute the answer to a question like ``"12+34="`` (or ``"7-9"``)."""
    a, op, b = _split(question)
    return str(OPS[op](int(a), int(b)))


def arithmetic_dataset(
    n_train: int = 2000,
    n_test: int = 200,
    ops: Sequence[str] = ("+",),
    digits: tuple[int, int] = (1, 2),
    seed: int = 0,
) -> tuple[Dataset, Dataset]:
    """Generate disjoint train/test splits of arithmetic questions.

    Args:
        n_train: Number of training examples.
        n_test: Number of test examples.
        ops: Operators to use, among ``"+"``, ``"-"``, ``"*"``.
        digits: Inclusive (min, max) number of digits of each operand.
        seed: Seed; the same arguments always give the same datasets.

    Returns:
        ``(train, test)`` :class:`datasets.Dataset` objects with string columns
        ``question`` (e.g. ``"12+34="``), ``answer`` (e.g. ``"46"``) and ``a``, ``op``, ``b``.
        All questions are distinct, so no question is in both splits.

    Raises:
        ValueError: On an unknown operator, bad ``digits``, or when fewer than
            ``n_train + n_test`` distinct questions exist.
    """
    ops = tuple(ops)
    if not ops:
        raise ValueError("ops must not be empty")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown operators {unknown}; supported: {sorted(OPS)}")
    if n_train < 0 or n_test < 0:
        raise ValueError("n_train and n_test must be non-negative")
    lo, hi = _operand_range(digits)
    n_operands = hi - lo + 1
    space = len(set(ops)) * n_operands * n_operands
    needed = n_train + n_test
    if needed > space:
        raise ValueError(
            f"only {space} distinct questions exist for ops={ops}, digits={digits}, "
            f"but n_train + n_test = {needed}"
        )

    rng = random.Random(seed)
    questions: list[str] = []
    seen: set[str] = set()
    if needed > space // 2:
        # Dense request: enumerate the whole space and sample without replacement.
        everything = [f"{a}{op}{b}=" for op in dict.fromkeys(ops)
                      for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        questions = rng.sample(everything, needed)
    else:
        # Sparse request: rejection-sample distinct questions.
        while len(questions) < needed:
            q = f"{rng.randint(lo, hi)}{rng.choice(ops)}{rng.randint(lo, hi)}="
            if q not in seen:
                seen.add(q)
                questions.append(q)

    return _to_dataset(questions[:n_train]), _to_dataset(questions[n_train:])


def _split(question: str) -> tuple[str, str, str]:
    q = question.strip().rstrip("=")
    for i in range(1, len(q)):  # skip a leading sign
        if q[i] in OPS:
            return q[:i], q[i], q[i + 1:]
    raise ValueError(f"not an arithmetic question: {question!r}")


def _to_dataset(qs: list[str]) -> Dataset:
    """Columns ``question`` (``"12+34="``), ``answer`` (``"46"``) and the parts ``a``, ``op``, ``b``
    (templates may use them, e.g. ``"What is {a} {op} {b}?"``)."""
    parts = [_split(q) for q in qs]
    return Dataset.from_dict({"question": qs, "answer": [solve(q) for q in qs], "a": [p[0] for p in parts],
                              "op": [p[1] for p in parts], "b": [p[2] for p in parts]})


def extra_split(
    exclude: set[str] | Sequence[str],
    n: int,
    ops: Sequence[str] = ("+",),
    digits: tuple[int, int] = (1, 2),
    seed: int = 0,
) -> Dataset:
    """``n`` distinct questions (seeded) none of which is in ``exclude``.

    Useful for a validation set disjoint from the splits of
    :func:`arithmetic_dataset`; it enumerates the whole question space, so keep
    the operands small (up to ~3 digits).
    """
    exclude = set(exclude)
    lo, hi = _operand_range(digits)
    pool = [f"{a}{op}{b}=" for op in dict.fromkeys(ops)
            for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    pool = [q for q in pool if q not in exclude]
    if n > len(pool):
        raise ValueError(f"only {len(pool)} distinct questions left, {n} requested")
    return _to_dataset(random.Random(seed + 7919).sample(pool, n))
