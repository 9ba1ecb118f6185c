"""Evidence about a member training alone, as pure functions: has it stalled, declined from the run's best
state, or stopped rising (the stall swap, the roll-back and the anneal of :class:`~evollm.hpo.narrowing.Narrowing`;
the training loop acts on them in :mod:`evollm.training.revival`)."""
from __future__ import annotations

import functools
import math
from typing import Sequence

#: evaluations without a new best after which a member whose steps carry no signal has stalled (:func:`stalled`)
STALL_PATIENCE = 3
#: share of a member's recent steps without a learning signal for :func:`stalled`
STALL_NO_SIGNAL = 0.5
#: fall below the best state's fitness, as a share of it, that counts as a decline (:func:`declined`)
DECLINE = 0.1
#: standard errors of the best state's evaluation that a decline must also exceed (:func:`declined`)
DECLINE_SE = 1.5
#: factor on a member's learning rates when it rolls back to the best state (``Narrowing.rollback``)
ROLLBACK_LR = 0.5
#: roll-backs per run at most (the learning rate falls at most ``ROLLBACK_LR ** MAX_ROLLBACKS``-fold)
MAX_ROLLBACKS = 2
#: factor on a lone member's learning rates at a plateau (``Narrowing.anneal``)
ANNEAL_LR = 0.5
#: plateau decays per run at most (``Narrowing.anneal``)
MAX_ANNEALS = 2
#: share of the budget a plateau must last before an anneal, at least ``patience`` evaluations (``Narrowing.anneal_share``)
ANNEAL_SHARE = 0.1
#: how the learning rates of the members left after the last cut fall to the run's starting rates (``Narrowing.decay``)
DECAYS = ("auto", "none", "cosine")


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """The expected maximum of ``n`` independent standard normal draws (0 for one draw): how far, in standard
    errors, the best of ``n`` evaluations of an unchanged score lies above that score by luck alone.

    >>> expected_max_normal(1)
    0.0
    >>> round(expected_max_normal(2), 4), round(1 / math.sqrt(math.pi), 4)  # exact: 1 / sqrt(pi)
    (0.5642, 0.5642)
    >>> round(expected_max_normal(3), 4), round(1.5 / math.sqrt(math.pi), 4)  # exact: 3 / (2 sqrt(pi))
    (0.8463, 0.8463)
    >>> round(expected_max_normal(10), 3), round(expected_max_normal(30), 3)  # tables: 1.539, 2.043
    (1.539, 2.043)
    """
    n = int(n)
    if n < 1:
        raise ValueError(f"expected_max_normal needs n >= 1 draws, got {n}")
    if n == 1:
        return 0.0
    h, total = 0.001, 0.0  # E[max] = integral of x n phi(x) Phi(x)^(n-1) dx, by the midpoint rule on [-9, 9]
    for i in range(18000):
        x = -9.0 + (i + 0.5) * h
        density = math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        below = 0.5 * math.erfc(-x / math.sqrt(2.0))
        total += x * n * density * below ** (n - 1)
    return total * h


def rate_between(own: float, other: float) -> float:
    """The learning rate halfway between ``own`` and ``other`` on the log scale the search samples rates on
    (their geometric mean): where a stall swap's reserve trains on (``hpo.narrowing.revive_rate``), between a
    rate that stalled and one that lost the cut.

    >>> round(rate_between(5e-5, 8e-4), 10)  # a sixteenth apart: four times the lower
    0.0002
    >>> rate_between(3e-4, 3e-4)
    0.0003
    """
    own, other = float(own), float(other)
    if not (own > 0.0 and other > 0.0 and math.isfinite(own) and math.isfinite(other)):
        raise ValueError(f"rate_between needs two positive finite learning rates, got {own!r} and {other!r}")
    return math.sqrt(own * other)


def declined(fitness: Sequence[float], best: float, patience: int = STALL_PATIENCE, drop: float = DECLINE,
             best_se: float = math.nan, z: float = DECLINE_SE, chosen_from: int = 1) -> bool:
    """Whether a member has fallen away from the run's best state: it has at least ``patience`` evaluations
    since that state was measured (``fitness``, oldest first; the caller passes only those) and the mean of
    the last ``patience`` is below ``best`` (the best state's fitness) by more than ``drop * |best|`` and by
    more than ``z`` standard errors of the best state's evaluation (``best_se``; ignored when unknown) beyond
    the luck of being the best of ``chosen_from`` evaluations (:func:`expected_max_normal` of them, in the same
    standard errors). The mean, not each one: one lucky evaluation on a fixed test set does not hide a fall,
    one unlucky one does not make it. The standard errors: on a low score a tenth of it is within the
    evaluation's noise (1.5 standard errors of one evaluation are about 1.3 of the difference between it and a
    mean of three). The luck: the best state is the highest of every evaluation since the member was chosen, so
    on a flat score it lies about 2 standard errors above the truth after 30 evaluations; without that term a
    member whose score has not moved rolls back once a run is long enough.

    >>> declined([0.70, 0.59, 0.56, 0.61], best=0.70)  # mean 0.587 < 0.63
    True
    >>> declined([0.70, 0.66, 0.55, 0.70], best=0.70)  # mean 0.637: within 10 %
    False
    >>> declined([0.40, 0.30], best=0.70)  # fewer than patience evaluations
    False
    >>> declined([0.20, 0.19, 0.18], best=0.22, best_se=0.03)  # mean 0.19: 0.03 below, less than 1.5 se (0.045)
    False
    >>> declined([0.20, 0.19, 0.18], best=0.22, best_se=0.01)  # more than 10 % and 1.5 se below
    True
    >>> declined([0.55, 0.55, 0.53], best=0.70, best_se=0.057)  # 0.157 below: more than 1.5 se (0.086)
    True
    >>> declined([0.55, 0.55, 0.53], best=0.70, best_se=0.057, chosen_from=30)  # the best of 30: 3.54 se (0.202)
    False
    """
    recent = [float(f) for f in fitness][-int(patience):]
    if len(recent) < int(patience) or not math.isfinite(float(best)) or any(math.isnan(f) for f in recent):
        return False
    margin = float(drop) * abs(float(best))
    if math.isfinite(float(best_se)):
        margin = max(margin, (float(z) + expected_max_normal(max(int(chosen_from), 1))) * float(best_se))
    return sum(recent) / len(recent) < float(best) - margin


def plateaued(fitness: Sequence[float], patience: int = STALL_PATIENCE, start: float = -math.inf) -> bool:
    """Whether a member's held-out fitness has stopped rising: none of its last ``patience`` evaluations
    (``fitness``, oldest first) is above its best before them (at least one evaluation before them; an
    unmeasured one, NaN, decides nothing), and that best is above ``start`` (the level the run started from:
    a member whose greedy play has not yet changed is not on a plateau, it has not begun).

    >>> plateaued([0.69, 0.68, 0.66, 0.68])  # 0.69 not beaten in three evaluations
    True
    >>> plateaued([0.69, 0.68, 0.66, 0.70])  # a new best
    False
    >>> plateaued([0.69, 0.68, 0.66])  # not yet patience + 1 evaluations
    False
    >>> plateaued([0.26, 0.26, 0.26, 0.26], start=0.26)  # still at the starting level
    False
    """
    fitness = [float(f) for f in fitness]
    if len(fitness) <= patience:
        return False
    before, recent = fitness[:-patience], fitness[-patience:]
    return not any(math.isnan(f) for f in recent) and max(recent) <= max(before) and max(before) > float(start)


def plateau_patience(patience: int, evaluations: int, spent: float, share: float = ANNEAL_SHARE) -> int:
    """Evaluations a plateau must last: at least ``patience``, and as many as span ``share`` of the budget at the
    rate the member has been evaluated since it was last chosen or changed (``evaluations`` in ``spent`` of the
    budget). A patience counted in evaluations alone is a smaller share of a longer run: with a time budget a
    machine three times as fast makes three times the evaluations, and three in a row without a new best on a
    noisy held-out score then come by chance during a slow rise. The rate is the lone member's own (a population's
    evaluations cost more of the budget each). Without a budget share spent (or with ``share`` 0): ``patience``.

    >>> plateau_patience(3, evaluations=5, spent=0.25)  # 20 evaluations per budget: 2 < 3
    3
    >>> plateau_patience(3, evaluations=20, spent=0.3)  # about 67 per budget: a tenth is 7
    7
    >>> plateau_patience(3, evaluations=20, spent=0.3, share=0.0)
    3
    """
    if not share > 0.0 or not spent > 0.0 or not math.isfinite(float(spent)):
        return int(patience)
    return max(int(patience), int(math.ceil(float(share) * int(evaluations) / min(float(spent), 1.0) - 1e-9)))


def lacks_signal(no_signal: Sequence[bool], share: float = STALL_NO_SIGNAL) -> bool:
    """Whether at least ``share`` of a member's steps (``no_signal``: one flag per step, True when the step had no
    learning signal) carried none; False without steps.

    >>> lacks_signal([True, True, False]), lacks_signal([True, False, False]), lacks_signal([])
    (True, False, False)
    """
    return bool(no_signal) and sum(bool(x) for x in no_signal) >= share * len(no_signal)


def failing_alike(no_signal: Sequence[bool], rewards: Sequence[float], top: float, bottom: float) -> list[bool]:
    """Which steps of ``no_signal`` (one flag per step, True when the step had no learning signal) lacked it because
    the samples failed alike, not because they all succeeded: a step without signal whose mean reward (``rewards``)
    is the best any step of the run reached (``top``) had every sample at that reward, and is solved, not stuck.
    Where every step of the run had the same mean reward (``top == bottom``) nothing tells the two apart, and every
    step without signal counts; so does one whose reward is unknown (NaN).

    >>> failing_alike([True, True, True, False], [1.0, 0.0, 0.5, 1.0], top=1.0, bottom=0.0)
    [False, True, True, False]
    >>> failing_alike([True, True], [0.0, 0.0], top=0.0, bottom=0.0)  # nothing better ever seen
    [True, True]
    >>> failing_alike([True], [float("nan")], top=1.0, bottom=0.0)
    [True]
    """
    solved = [top > bottom and math.isfinite(r) and r >= top for r in rewards]
    return [bool(n) and not s for n, s in zip(no_signal, solved)]


def stalled(fitness: Sequence[float], no_signal: Sequence[bool], patience: int = STALL_PATIENCE,
            share: float = STALL_NO_SIGNAL) -> bool:
    """Whether a member has stopped learning: none of its last ``patience`` evaluations (``fitness``, oldest
    first) is above its best before them, *and* at least ``share`` of its training steps over those
    evaluations (``no_signal``: one flag per step, True when the step had no learning signal, e.g. every
    GRPO group with equal rewards) carried no signal. Flat fitness alone is not enough (a member may be
    improving below the resolution of a greedy evaluation); flat fitness on steps whose samples all agree
    is a policy that can no longer learn from its own samples.

    >>> stalled([0.10, 0.22, 0.22, 0.21, 0.22], [True] * 9 + [False])
    True
    >>> stalled([0.10, 0.22, 0.22, 0.21, 0.25], [True] * 10)  # a new best: still learning
    False
    >>> stalled([0.10, 0.22, 0.22, 0.21, 0.22], [False] * 6 + [True] * 4)  # its steps still carry signal
    False
    >>> stalled([0.22, 0.22, 0.22], [True] * 10)  # not yet patience + 1 evaluations
    False
    """
    return plateaued(fitness, patience) and lacks_signal(no_signal, share)


def decays(decay: str, member) -> bool:
    """Whether ``member``'s rates follow the decay (``Narrowing.decay``): always with ``"cosine"``, never with
    ``"none"``, and with ``"auto"`` where the member learns a critic (``HAS_CRITIC``: LLMPPO, IPPO teams). Side by
    side with the anneal it replaces, the decay lifted every actor-critic task measured and cost the GRPO and
    REINFORCE arithmetic tasks (benchmarks/README.md, "The decay for actor-critic members").

    >>> class Actor: HAS_CRITIC = False
    >>> class ActorCritic: HAS_CRITIC = True
    >>> decays("auto", ActorCritic()), decays("auto", Actor()), decays("cosine", Actor()), decays("none", ActorCritic())
    (True, False, True, False)
    """
    return decay == "cosine" or (decay == "auto" and bool(getattr(member, "HAS_CRITIC", False)))


def decay_factor(fraction: float, since: float, floor: float, peak: float = 1.0) -> float:
    """The factor on a lone member's learning rates with ``fraction`` of the budget spent (``Narrowing.decay``,
    ``Narrowing.lift``): 1 up to ``since`` (the fraction at which the last cut left it alone), then ``peak`` falling
    along a half cosine to ``floor`` at the end of the budget (``floor`` past it). For the decay ``peak`` is 1 and
    ``floor`` the run's starting rate over the member's own (:func:`decay_floor`), so the rate the cuts found falls
    back to the one the run started from; for the lift ``peak`` is ``Narrowing.lift`` and ``floor`` 1.

    >>> [round(decay_factor(f, 0.2, 0.25), 4) for f in (0.1, 0.2, 0.6, 1.0, 1.2)]
    [1.0, 1.0, 0.625, 0.25, 0.25]
    >>> round(decay_factor(0.4, 0.2, 0.25), 4)  # a quarter of the way: 0.25 + 0.75 * (1 + cos(pi / 4)) / 2
    0.8902
    >>> [round(decay_factor(f, 0.2, 1.0, peak=3.0), 4) for f in (0.1, 0.2, 0.6, 1.0)]  # the lift: 3x, down to 1x
    [1.0, 3.0, 2.0, 1.0]
    """
    fraction, since, floor, peak = float(fraction), float(since), float(floor), float(peak)
    if fraction <= since:
        return 1.0 if fraction < since else peak
    t = min((fraction - since) / (1.0 - since), 1.0) if since < 1.0 else 1.0
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def decay_floor(own: float, start: float) -> float:
    """The factor at the end of the decay for a member at rate ``own`` in a run that started at ``start``:
    ``start / own``, and 1 for a member at or below the starting rate (the decay brings only the faster rates the
    cuts kept back toward it; a slower one trains on as it is).

    >>> decay_floor(4e-4, 1e-4), decay_floor(5e-5, 1e-4), decay_floor(1e-4, 1e-4)
    (0.25, 1.0, 1.0)
    """
    own, start = float(own), float(start)
    return min(1.0, start / own) if own > 0.0 else 1.0


def lifted(lift: float, own: float, start) -> bool:
    """Whether a lone member at rate ``own``, in a run that started at ``start`` (``None``: unknown), follows
    ``Narrowing.lift``: the lift is on (above 1) and the cuts left the member at or below the starting rate, so
    the search found nothing faster to keep.

    >>> lifted(3.0, 1e-4, 1e-4), lifted(3.0, 5e-5, 1e-4), lifted(3.0, 2e-4, 1e-4), lifted(1.0, 1e-4, 1e-4)
    (True, True, False, False)
    """
    return float(lift) > 1.0 and start is not None and float(own) <= float(start) * (1.0 + 1e-9)
