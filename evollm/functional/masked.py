"""Masked reductions over valid cells (see the shape conventions in :mod:`evollm.functional`)."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

#: ``reduce(stats) -> stats``: sums a 1-D tensor of statistics over the shares of one batch (in a
#: multi-process run, over processes: :func:`evollm.parallel.distributed.batch_reduce`); None: this tensor
#: is the whole batch
Reduce = Callable[[Tensor], Tensor]


# --------------------------------------------------------------------------- #
# Masked reductions
# --------------------------------------------------------------------------- #
def _valid(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x`` over valid cells (all cells if ``dim`` is None, else along ``dim``).

    Invalid cells are excluded with ``torch.where``, so ``NaN``/``inf`` there
    do not leak into the result or its gradient.
    """
    x = torch.where(_valid(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over valid cells (whole tensor, or along ``dim``).

    The count is clamped to at least 1, so a reduction over zero valid cells
    returns 0 rather than NaN.
    """
    count = _valid(mask).to(x.dtype)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def _summed(reduce: Optional[Reduce], *values: Tensor) -> Tuple[Tensor, ...]:
    """``values`` summed over the batch's shares by ``reduce`` (as they are without one); constants."""
    if reduce is None:
        return values
    out = torch.as_tensor(reduce(torch.stack([v.detach() for v in values])))
    return tuple(out.to(dtype=values[0].dtype, device=values[0].device).unbind())


def _masked_std(x: Tensor, mask: Tensor, reduce: Optional[Reduce] = None) -> Tuple[Tensor, Tensor]:
    """(mean, unbiased std) over all valid cells (of every share, with ``reduce``); std is 0 with fewer
    than 2 cells."""
    valid = _valid(mask)
    n, total = _summed(reduce, valid.sum().to(x.dtype), masked_sum(x, valid))
    mean = total / n.clamp(min=1)
    (sq,) = _summed(reduce, masked_sum((x - mean) ** 2, valid))
    var = torch.where(n > 1, sq / (n - 1).clamp(min=1), torch.zeros_like(sq))
    return mean, var.sqrt()


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True,
                  reduce: Optional[Reduce] = None) -> Tensor:
    """Standardise ``x`` using mean/std computed over valid cells only.

    Returns ``(x - mean) / (std + eps)`` (std unbiased, 0 when fewer than two
    valid cells); with ``shift_mean=False`` the mean is added back, i.e. only
    the scale is normalised.  Invalid cells are 0.  Same shape as ``x``.
    With ``reduce`` (:data:`Reduce`), ``x`` is one share of a batch split over
    processes, and the mean and std are those of the whole batch.
    """
    valid = _valid(mask)
    mean, std = _masked_std(x, valid, reduce)
    out = (x - mean) / (std + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, torch.zeros_like(out))
