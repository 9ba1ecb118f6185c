"""The run's budget: its clock (:func:`budget_clock`), a learning-rate cool-down over its last share
(``train.lr_cooldown``, :func:`cool_down`), and the decay of the rates the narrowing's cuts found
(``hpo.narrowing.decay``) or raise the rate it left alone (``hpo.narrowing.lift``; both :func:`lone_factors`) over
the budget left after its last cut.

Every member trains at its own learning rates (its hyperparameters, evolving with it) until the last
``share`` of the budget, and then at those rates times a factor that falls linearly to ``floor`` at the end
of the budget: the "stable, then decay" schedule of WSD (warm-up, stable, decay; MiniCPM, 2024), without the
warm-up. The budget is the one the narrowing schedule reads (:func:`evollm.hpo.narrowing.budget_fraction`: the
larger of ``step / max_steps`` and ``elapsed / max_time``), so a population and a single run with the same
budget cool down over the same share of it.

The factor scales the optimizer's param groups only; ``member.config`` keeps the rates the member's
hyperparameters give (what mutation perturbs, what the report shows), and a mutation during the cool-down sets a
new rate that the next step scales. ``member.lr_factor`` is the factor its param groups carry now (the
cool-down's times the decay's); run checkpoints save it with the optimizer, so a resumed run checks the saved
rates against it.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from evollm.parallel import distributed as dist


def cooldown_factor(fraction: float, share: float, floor: float = 0.1) -> float:
    """The factor on every learning rate with ``fraction`` of the budget spent: 1 until the last ``share`` of it,
    then linearly down to ``floor`` at the end (``floor`` past it). ``share`` 0: always 1.

    >>> [round(cooldown_factor(f, 0.2, 0.1), 3) for f in (0.0, 0.8, 0.9, 1.0, 1.5)]
    [1.0, 1.0, 0.55, 0.1, 0.1]
    >>> cooldown_factor(0.95, 0.0)
    1.0
    """
    if not share > 0.0 or float(fraction) <= 1.0 - float(share) + 1e-12:
        return 1.0
    left = min(max(1.0 - float(fraction), 0.0), float(share))
    return float(floor) + (1.0 - float(floor)) * left / float(share)


def validate_cooldown(share: float, floor: float) -> None:
    """One line naming the option for values no run can use."""
    if not 0.0 <= float(share) < 1.0:
        raise ValueError(f"lr_cooldown must be a share of the budget in [0, 1), got {share!r}")
    if not 0.0 <= float(floor) <= 1.0:
        raise ValueError(f"lr_cooldown_floor must be a factor in [0, 1], got {floor!r}")


def agents_of(member) -> list:
    """The agents whose optimizers a member steps: itself, or every agent of an IPPO team."""
    return list(getattr(member, "agents", None) or [member])


def apply_lr_factor(members: Sequence, factor: float) -> None:
    """Set every param group of every member (each agent of a team) to the rate the member's hyperparameters give
    it times ``factor``, and record ``factor`` as ``lr_factor``. Rates unchanged where the factor is 1 and was 1
    (nothing to do before the cool-down)."""
    for member in members:
        for agent in agents_of(member):
            if factor == 1.0 and getattr(agent, "lr_factor", 1.0) == 1.0:
                continue
            groups = getattr(agent.optimizer, "param_groups", None)
            if groups is None:
                raise ValueError(f"train.lr_cooldown / hpo.narrowing.decay: member {agent.index}'s optimizer "
                                 f"({type(agent.optimizer).__name__}) has no param groups to scale")
            rates = {g.get("name"): float(g["lr"]) for g in agent._param_groups()}
            for group in groups:
                group["lr"] = rates[group.get("name")] * factor
            agent.lr_factor = float(factor)


def cool_down(agents: list, settings, done: int, elapsed: float, record=None,
              log: Callable[[str], None] | None = None) -> None:
    """Every member's param groups at its rates times the factor of the budget spent after ``done`` steps
    (``elapsed`` seconds on the budget's clock; ``settings``: the loop's): ``train.lr_cooldown``'s
    (:func:`cooldown_factor`), times, once the narrowing's schedule is finished, the lone member's
    (:func:`lone_factors`: ``hpo.narrowing.decay`` and ``hpo.narrowing.lift``; ``record``: the run's, for the rates
    it started from). ``log``: told once, where that schedule starts, what it does to each member's rates."""
    from evollm.hpo.lone import decays

    narrowing = settings.narrowing
    lone = narrowing is not None and narrowing.finished
    shaped = [lone and (decays(narrowing.decay, m) or narrowing.lift > 1.0) for m in agents]
    if not settings.lr_cooldown > 0 and not any(shaped):
        return
    from evollm.hpo.narrowing import budget_fraction
    fraction = dist.broadcast_object(budget_fraction(done, settings.max_steps, elapsed, settings.max_time))
    factor = cooldown_factor(fraction, settings.lr_cooldown, settings.lr_cooldown_floor)
    if not any(shaped):
        apply_lr_factor(agents, factor)
        return
    starts = narrowing.lone_since is None  # the first step after the last cut: the decay (or lift) starts here
    if starts:
        narrowing.lone_since = float(fraction)
    shapes = lone_factors(agents, record, fraction, narrowing)
    if starts and log is not None:  # past the end of the budget (2.0): each schedule's last factor
        log_lone_schedule(agents, shapes, lone_factors(agents, record, 2.0, narrowing), fraction, log)
    for member, shape in zip(agents, shapes):
        apply_lr_factor([member], factor * shape)


def log_lone_schedule(agents: Sequence, firsts: Sequence[float], ends: Sequence[float], fraction: float,
                      log: Callable[[str], None]) -> None:
    """One line per member whose rates the decay or the lift will change: from which factor to which."""
    for member, first, end in zip(agents, firsts, ends):
        if first != end:
            why = "hpo.narrowing.lift" if first > 1.0 else "hpo.narrowing.decay"
            log(f"member {member.index} trains alone from {fraction:.0%} of the budget: its learning rates x{first:.3g}, "
                f"falling along a half cosine to x{end:.3g} at the end ({why})")


def lone_factors(members: Sequence, record, fraction: float, narrowing) -> list[float]:
    """The factor on each lone member's rates at ``fraction`` of the budget, from ``narrowing.lone_since`` on
    (:func:`~evollm.hpo.lone.decay_factor`), over the member's policy rate (the first of
    :func:`~evollm.training.revival.learning_rate_names`) and the rate the run started from (``record``'s default
    founder's, :func:`~evollm.training.revival.starting_rates`):

    - ``hpo.narrowing.lift``: a member the cuts left at or below the starting rate (:func:`~evollm.hpo.lone.lifted`)
      trains at ``lift`` times its rate, falling to its rate at the end of the budget;
    - ``hpo.narrowing.decay``: any other member it applies to (:func:`~evollm.hpo.lone.decays`) falls from its rate
      to the starting one (without a default founder: to its search range's lower end, as the anneal's floor does);
    - otherwise 1 (a rate nobody searched keeps its value)."""
    from evollm.hpo.lone import decay_factor, decay_floor, decays, lifted
    from .revival import learning_rate_names, range_min, starting_rates

    start = starting_rates(record) if record is not None else {}
    since = narrowing.lone_since
    factors = []
    for member in members:
        names = learning_rate_names(member)
        if not names:
            factors.append(1.0)
            continue
        own = float(member.get_hyperparameter(names[0]))
        if lifted(narrowing.lift, own, start.get(names[0])):
            factors.append(decay_factor(fraction, since, 1.0, peak=narrowing.lift))
        elif decays(narrowing.decay, member):
            target = start.get(names[0], range_min(member, names[0]))
            factors.append(decay_factor(fraction, since, decay_floor(own, own if target is None else target)))
        else:
            factors.append(1.0)
    return factors


def budget_clock(kind) -> Callable[[], float]:
    """Seconds on the budget's clock: ``"wall"`` (``time.perf_counter``), ``"cpu"`` (this process's
    CPU time over all its threads, ``time.process_time``: on a shared machine the fairer budget), or
    ``kind`` itself when it is a callable returning seconds."""
    if callable(kind):
        return kind
    if kind == "wall":
        return time.perf_counter
    if kind == "cpu":
        return time.process_time
    raise ValueError(f"max_time_clock={kind!r} is not valid; choose 'wall', 'cpu' or a callable returning seconds")


def clock_name(kind) -> str:
    """``"wall"``, ``"cpu"``, or a callable clock's name (for log lines)."""
    return kind if isinstance(kind, str) else getattr(kind, "__qualname__", type(kind).__name__)
