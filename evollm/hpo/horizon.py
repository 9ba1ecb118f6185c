"""What an early ranking can tell: whether any member has learnt yet (:func:`learnt`, ``hpo.narrowing.wait_se``),
and the short-horizon bias of a cut: early rankings favour slow learning rates (:func:`demote_slow`).

A population's first rankings come after a few steps per member. On a warm-started model, a member at a
slow rate still answers much as the model did, while faster rates move the answers, first down as often
as up, and reach what they will score later. So a ranking that early prefers slow rates by chance more
often than the long run would (the short-horizon bias of greedy learning-rate tuning: Wu, Ren, Liao and
Grosse, "Understanding Short-Horizon Bias in Stochastic Meta-Optimization", ICLR 2018). ``hpo.narrowing.slow_se``
asks a member slower than the run's starting rate for evidence before it takes a place from the others:
:func:`demote_slow`. A cut to one member that keeps a slower member over a faster one within noise of it
(:func:`within_noise`) can lean the same way: ``hpo.narrowing.faster_se`` trains the member kept at the rate
between the two.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence


def slower(rate: float, start: Optional[float]) -> bool:
    """Whether ``rate`` is below the run's starting rate ``start`` (``None``: no starting rate, never slower;
    a relative tolerance of 1e-9 absorbs the last bit a checkpoint's JSON may change).

    >>> slower(5e-5, 1e-4), slower(1e-4, 1e-4), slower(2e-4, 1e-4), slower(5e-5, None)
    (True, False, False, False)
    """
    if start is None or not math.isfinite(float(start)):
        return False
    return float(rate) < float(start) * (1.0 - 1e-9)


def beats_reference(score: float, reference: float, stderr: float, z: float) -> bool:
    """Whether ``score`` is above ``reference`` by more than ``z`` standard errors ``stderr`` of their
    difference. An unknown (NaN) standard error asks only for a higher score.

    >>> beats_reference(0.55, 0.51, 0.015, 2.0), beats_reference(0.53, 0.51, 0.015, 2.0)
    (True, False)
    >>> beats_reference(0.52, 0.51, float("nan"), 2.0), beats_reference(0.51, 0.51, 0.0, 2.0)
    (True, False)
    """
    gap = float(score) - float(reference)
    if not math.isfinite(float(stderr)):
        return gap > 0.0
    return gap > 0.0 and gap > float(z) * float(stderr)


def demote_slow(scores: Mapping[int, float], slow: set, stderr: Mapping[tuple[int, int], float],
                z: float) -> tuple[dict[int, float], list[int]]:
    """Ranking scores corrected for short-horizon bias. A member in ``slow`` (its learning rate below the run's
    starting one) ranks below every other member with a finite score, unless it :func:`beats_reference` the
    best of them by ``z`` standard errors of the difference (``stderr[(slow member, best)]``: paired over the
    same items where the evaluation gave it; a missing pair: NaN). The members demoted keep their order among
    themselves; a non-finite score (a quarantined member) is left as it is, and with no finite score outside
    ``slow`` nothing changes. Returns ``(scores, demoted ids)``.

    Eight members after ten steps, the default founder (0) at 0.51, two slow founders (1, 2) two and six
    answers of 200 above it, a fast one (3) below:

    >>> se = {(1, 0): 0.012, (2, 0): 0.012}
    >>> ranks, demoted = demote_slow({0: 0.51, 1: 0.52, 2: 0.54, 3: 0.49}, {1, 2}, se, 2.0)
    >>> sorted(ranks, key=ranks.get, reverse=True), demoted
    ([2, 0, 3, 1], [1])
    >>> demote_slow({0: 0.51, 1: 0.52}, {1}, se, 0.0)[1]  # z = 0: a higher score is enough
    []
    >>> demote_slow({1: 0.52, 2: 0.54}, {1, 2}, se, 2.0)[1]  # no one to compare with
    []
    """
    out = {int(k): float(v) for k, v in scores.items()}
    others = {k: v for k, v in out.items() if k not in slow and math.isfinite(v)}
    if not others or z < 0:
        return out, []
    best = max(others, key=lambda k: (others[k], -k))
    reference = others[best]
    demoted = [k for k, v in out.items() if k in slow and math.isfinite(v)
               and not beats_reference(v, reference, stderr.get((k, best), math.nan), z)]
    if not demoted:
        return out, []
    floor = min(others.values())
    offset = max(out[k] for k in demoted) - floor + 1.0  # every demoted score ends below the lowest other one
    for k in demoted:
        out[k] -= offset
    return out, sorted(demoted)


def learnt(scores: Sequence[float], stderrs: Sequence[float], start: float, z: float) -> bool:
    """Whether any member has learnt something its evaluation can see: a score above ``start`` (the run's
    starting level) by at least ``z`` of that member's standard error (``stderrs``, in the order of
    ``scores``; an unknown one, NaN, or a zero one: by anything). Before that the members' scores differ by the
    evaluation's noise, and a cut on them keeps members at random. With no starting level (``start`` not
    finite) every member counts as having learnt.

    >>> learnt([0.42, 0.405, 0.465], [0.035, 0.035, 0.035], start=0.41, z=2.0)  # 0.055 above: 1.6 se
    False
    >>> learnt([0.27, 0.12, 0.74], [0.031, 0.023, 0.031], start=0.17, z=2.0)
    True
    >>> learnt([0.30], [float("nan")], start=0.25, z=2.0)
    True
    >>> learnt([0.0, 0.0], [0.0, 0.0], start=0.0, z=2.0)  # nobody answers: no one has learnt
    False
    """
    if not math.isfinite(float(start)):
        return True
    for score, se in zip(scores, stderrs):
        score, se = float(score), float(se)
        if math.isnan(score):
            continue
        gap = score - float(start)
        if gap > 0.0 and (not math.isfinite(se) or gap >= float(z) * se):
            return True
    return False


def within_noise(score: float, other: float, stderr: float, z: float) -> bool:
    """Whether two scores are within ``z`` standard errors ``stderr`` of their difference of each other, so that a
    ranking between them is a coin flip. An unknown (NaN) standard error: only equal scores.

    >>> within_noise(0.373, 0.364, 0.012, 1.0), within_noise(0.373, 0.349, 0.012, 1.0)
    (True, False)
    >>> within_noise(0.5, 0.5, 0.0, 1.0), within_noise(0.5, 0.51, float("nan"), 1.0)
    (True, False)
    """
    gap = abs(float(score) - float(other))
    if not math.isfinite(float(stderr)):
        return gap == 0.0
    return gap <= float(z) * float(stderr)
