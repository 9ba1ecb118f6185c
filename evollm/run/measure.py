"""What a training step costs: wall time in generation and learning, tokens generated, tokens per
second and peak memory, added to each member's learn metrics by the loops' ``train_step``.

Generation and (fused) learning run once for the whole population, so ``time_generate_s`` and
``time_learn_s`` are the step's shared wall times, the same on every member's row;
``tokens_per_s`` is the member's generated tokens over that shared generation time, so the rows of
one step add up to the population's throughput.
"""

from __future__ import annotations

import resource
import sys
from typing import Sequence

import torch


def peak_memory_mb() -> float:
    """Peak memory of this process so far, in MiB: ``torch.cuda.max_memory_allocated()`` when CUDA
    is in use, else the peak resident set size (RSS) of the process."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def count_tokens(masks) -> int:
    """Generated tokens in an action mask (a tensor or a list of per-prompt tensors)."""
    if torch.is_tensor(masks):
        return int(masks.sum())
    return sum(int(m.sum()) for m in masks)


def with_costs(metrics: dict[int, dict], tokens: dict[int, int], generate_s: float, learn_s: float) -> dict[int, dict]:
    """``metrics`` (member index -> learn metrics) with the step's costs added to every member's dict."""
    memory = peak_memory_mb()
    for index, m in metrics.items():
        n = int(tokens.get(index, 0))
        m.update(time_generate_s=generate_s, time_learn_s=learn_s, gen_tokens=n,
                 tokens_per_s=n / generate_s if generate_s > 0 else float("nan"), peak_memory_mb=memory)
    return metrics


def member_tokens(agents: Sequence, masks: Sequence) -> dict[int, int]:
    """``{agent.index: generated tokens}`` for parallel lists of members and their action masks."""
    return {a.index: count_tokens(m) for a, m in zip(agents, masks)}
