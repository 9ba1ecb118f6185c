"""The reserve of a narrowing population, in the loop (``hpo.narrowing.revive``).

At a cut after which the members left will train alone (fewer than the selection needs, or no
selection), :func:`park_runner_up` keeps the best released member on the shared base as the reserve
(:class:`~evollm.run.reserve.Reserve`). After each evaluation, :func:`revive_stalled` swaps a member that
has stalled (:func:`~evollm.hpo.lone.stalled`: ``patience`` evaluations without a new best, at least
``no_signal`` of its steps since without a learning signal, not counting steps whose samples all got the run's
best reward: :func:`~evollm.hpo.lone.failing_alike`) for the reserve, once per run. After a step
that quarantined every live member, :func:`rescue_quarantined` brings the parked member back (the
runner-up, or the member a stall swap parked) so the run trains on instead of stopping. After each
evaluation, :func:`roll_back_declined` puts a copy of the run's best state, at a lower learning rate, in the
place of a member training alone that has fallen away from it (``hpo.narrowing.rollback``), and
:func:`anneal_plateaued` lowers the learning rates of one whose fitness has stopped rising (``hpo.narrowing.anneal``).
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence

from evollm.hpo.defaults import DEFAULT_EVOLVED, LEARNING_RATES
from evollm.hpo.horizon import learnt
from evollm.hpo.lone import (decays, declined, failing_alike, lacks_signal, plateau_patience, plateaued, rate_between,
                             stalled)
from evollm.hpo.narrowing import budget_fraction
from evollm.run.population import Population, describe_rates
from .quarantine import healthy

#: the ``learn_path`` metric of a step whose update had no learning signal (every advantage zero)
NO_SIGNAL = "no_gradient"


def trains_alone(size: int, tournament) -> bool:
    """Whether ``size`` members get no selection (fewer than the tournament needs, or none)."""
    return tournament is None or size < getattr(tournament, "min_population", 2)


def park_runner_up(dropped: Sequence, rank: Callable, narrowing, kept_size: int, tournament,
                   record: Population) -> list:
    """The members of a cut to release: all of ``dropped``, except that with a reserve (``record.reserve``,
    made by the loop when ``narrowing.revive``), when the ``kept_size`` members left will end the schedule
    training alone, the best healthy dropped one (by ``rank``, higher first) is parked as the reserve
    instead."""
    final = narrowing.target(kept_size, len(narrowing.at) - narrowing.passed)
    candidates = [a for a in dropped if not getattr(a, "quarantined", False) and math.isfinite(float(rank(a)))]
    if record.reserve is None or not candidates or not trains_alone(final, tournament):
        return list(dropped)
    runner_up = max(candidates, key=lambda a: (float(rank(a)), -int(a.index)))
    record.reserve.park(runner_up)
    return [a for a in dropped if a is not runner_up]


def member_evaluations(record: Population, index: int) -> list[tuple[int, float]]:
    """``(step, fitness)`` of member ``index``'s held-out evaluations, oldest first (from the run's record)."""
    return [(int(r["step"]), float(r["fitness"])) for r in record.rows if int(r["member"]) == index]


def evaluations_between(record: Population, first: int, last: int) -> int:
    """The run's evaluations (distinct steps) from step ``first`` to step ``last``, both included, at least 1:
    how many evaluations a best state measured at ``last`` was the best of, since ``first`` (the last cut)."""
    return max(1, len({int(r["step"]) for r in record.rows if int(first) <= int(r["step"]) <= int(last)}))


def evaluation_stderr(record: Population, index: int | None, step: int | None) -> float:
    """Standard error of member ``index``'s held-out evaluation at ``step`` (NaN when not recorded)."""
    for r in record.rows:
        if index is not None and int(r["member"]) == int(index) and int(r["step"]) == step:
            return float(r.get("fitness_se", math.nan))
    return math.nan


def stall_inputs(record: Population, index: int, patience: int, count_solved: bool = True) -> tuple[list[float], list[bool]]:
    """Member ``index``'s held-out fitness history and, for its steps after its evaluation ``patience``
    evaluations ago, whether each had no learning signal (from the run's record). With ``count_solved=False`` a step
    whose every sample got the run's best reward does not count (:func:`~evollm.hpo.lone.failing_alike`)."""
    evaluations = member_evaluations(record, index)
    if len(evaluations) <= patience:
        return [f for _, f in evaluations], []
    since = evaluations[-patience - 1][0]
    rows = [r for r in record.metric_rows if int(r["member"]) == index and int(r["step"]) > since]
    flags = [r.get("learn_path") == NO_SIGNAL for r in rows]
    if not count_solved:
        seen = [x for x in (float(r.get("mean_reward", math.nan)) for r in record.metric_rows) if math.isfinite(x)]
        if seen:
            flags = failing_alike(flags, [float(r.get("mean_reward", math.nan)) for r in rows], max(seen), min(seen))
    return [f for _, f in evaluations], flags


def revive_stalled(agents: list, narrowing, tournament, record: Population, step: int, max_steps: int,
                   max_time: float | None, log: Callable[[str], None] | None = None) -> list:
    """After an evaluation: when the schedule is finished, the members train alone and one of them has
    stalled, put the reserve in its place (once per run) and record it (``kind == "revival"``). Returns
    the members to train on."""
    reserve = record.reserve
    if (reserve is None or reserve.member is None or reserve.swapped or not narrowing.finished or not trains_alone(len(agents), tournament) or step >= max_steps):
        return agents
    for agent in agents:
        if getattr(agent, "quarantined", False):
            continue
        fitness, no_signal = stall_inputs(record, int(agent.index), narrowing.patience, count_solved=False)
        if stalled(fitness, no_signal, narrowing.patience, narrowing.no_signal):
            return _swap(agents, agent, reserve, record, step, max_steps, max_time, narrowing, no_signal, log)
    return agents


def _swap(agents, stalled_member, reserve, record, step, max_steps, max_time, narrowing, no_signal, log) -> list:
    from evollm.hpo.selection import SelectionResult

    revived = reserve.swap(stalled_member, step)
    changed = rates_between(revived, stalled_member) if narrowing.revive_rate == "between" else {}
    members = [revived if a is stalled_member else a for a in agents]
    scores = {int(a.index): float(a.fitness[-1]) if a.fitness else math.nan for a in (stalled_member, revived)}
    result = SelectionResult(elite=None, population=members, dropped=[stalled_member], scores=scores,
                             best_index=int(revived.index), protected=[])
    fraction = budget_fraction(step, max_steps, narrowing.elapsed_s, max_time)
    share = sum(no_signal) / max(len(no_signal), 1)
    record.record_revival(result, step, fraction, share, reason="stall", rates=describe_rates(changed) or None)
    if log is not None:
        log(f"member {stalled_member.index} stalled at step {step} ({fraction:.0%} of the budget): no new best in "
            f"{narrowing.patience} evaluations, {share:.0%} of its steps without a learning signal; parked it and "
            f"revived member {revived.index} (the reserve, fitness {scores[int(revived.index)]:.3f} when parked"
            f"{', at ' + describe_rates(changed) if changed else ''})")
    return members


def rescue_quarantined(agents: list, narrowing, record: Population, step: int, max_steps: int,
                       max_time: float | None, log: Callable[[str], None] | None = None) -> list:
    """After a step's quarantine checks: when every member of ``agents`` is quarantined and the reserve
    holds a member (healthy: parked members take no step), release the quarantined members and return
    ``[reserve member]`` to train on, recorded as a ``revival`` row with ``reason == "quarantine"``;
    otherwise ``agents`` unchanged (and the loop stops with ``PopulationDiverged`` when none is healthy)."""
    from evollm.hpo.selection import SelectionResult

    reserve = getattr(record, "reserve", None)
    if reserve is None or reserve.member is None or not agents or healthy(agents):
        return agents
    member = reserve.rescue(step)
    scores = {int(a.index): -math.inf for a in agents}
    scores[int(member.index)] = float(member.fitness[-1]) if member.fitness else math.nan
    result = SelectionResult(elite=None, population=[member], dropped=list(agents), scores=scores,
                             best_index=int(member.index), protected=[])
    fraction = budget_fraction(step, max_steps, narrowing.elapsed_s, max_time)
    record.record_revival(result, step, fraction, math.nan, reason="quarantine")
    if log is not None:
        reasons = "; ".join(f"member {a.index}: {a.quarantine_reason}" for a in agents)
        log(f"every member was quarantined at step {step} ({reasons}); member {member.index}, parked on the "
            f"shared base (fitness {scores[int(member.index)]:.3f} when parked), trains on in their place")
    for agent in agents:
        agent.release()
    return [member]


def revivals(record: Population, reason: str) -> int:
    """``revival`` rows of ``reason`` so far (``"rollback"``, ``"anneal"``, ...), from the run's record: a resumed
    run counts the same."""
    return sum(1 for r in record.selection_rows if r.get("kind") == "revival" and r.get("reason") == reason)


def learning_rate_names(agent) -> list[str]:
    """The learning rates of ``agent`` that the narrowing's rules change: those its search space evolves, else
    its policy's (:data:`~evollm.hpo.defaults.DEFAULT_EVOLVED`, the first it has)."""
    space = getattr(agent, "hp_config", None)
    names = [n for n in (space.rl_hp_names() if space is not None else ()) if n in LEARNING_RATES]
    if not names:
        mutable = set(agent.mutable_hyperparameters())
        names = [n for n in DEFAULT_EVOLVED if n in mutable][:1]
    return names


def _set_learning_rates(agent, new_rate: Callable[[str, float], float]) -> dict[str, tuple[float, float]]:
    """Set each of ``agent``'s learning rates (:func:`learning_rate_names`) to ``new_rate(name, old)``; returns
    ``{name: (old, new)}`` for the rates that changed."""
    changed = {}
    for name in learning_rate_names(agent):
        old = float(agent.get_hyperparameter(name))
        new = float(new_rate(name, old))
        if new != old:
            agent.set_hyperparameter(name, new)
            changed[name] = (old, new)
    return changed


def range_min(agent, name: str) -> float | None:
    """The lower end of ``agent``'s search range for ``name``; ``None`` when its search space does not hold it."""
    space = getattr(agent, "hp_config", None)
    return float(space[name].min) if space is not None and name in space.rl_hp_names() else None


def scaled_learning_rates(agent, factor: float, fell=None, floor: dict[str, float] | None = None
                          ) -> dict[str, tuple[float, float]]:
    """Set ``agent``'s learning rates (:func:`learning_rate_names`) to ``factor`` times the lower of its own and
    those of ``fell`` (the member that fell away, when given: a second roll-back lowers the rate again), not below
    their search range's lower end, nor below ``floor[name]`` (where given) unless the rate was below it already
    (a rate at or below its floor stays as it is). Returns ``{name: (old, new)}``."""
    def scaled(name: str, old: float) -> float:
        base = min(old, float(fell.get_hyperparameter(name))) if fell is not None else old
        lowest = range_min(agent, name) or 0.0
        if floor and name in floor:
            lowest = max(lowest, min(old, float(floor[name])))
        return max(base * factor, lowest)

    return _set_learning_rates(agent, scaled)


def rates_between(agent, other) -> dict[str, tuple[float, float]]:
    """Set ``agent``'s learning rates (:func:`learning_rate_names`) to :func:`~evollm.hpo.lone.rate_between` its
    own and ``other``'s: both lie in the search range, so their log-midpoint does too. Returns
    ``{name: (old, new)}`` (the rates that changed)."""
    return _set_learning_rates(agent, lambda name, old: rate_between(old, float(other.get_hyperparameter(name))))


def roll_back_declined(agents: list, narrowing, tournament, record: Population, step: int, max_steps: int,
                       max_time: float | None, log: Callable[[str], None] | None = None) -> list:
    """After an evaluation: when the schedule is finished and the members train alone, a member that has
    :func:`~evollm.hpo.lone.declined` from the run's kept best state (``record.kept``, when it was measured
    at or after the last cut or swap (:func:`last_cut`): a best of several members, or the plateau a
    stall swap replaced, is not this member's to match; judged on the
    evaluations after it, beyond ``narrowing.decline_se`` standard errors of the state's evaluation and the luck of
    being the best of the evaluations since the last cut, :func:`evaluations_between`) gives its place
    to a copy of that state whose learning rates are ``narrowing.rollback_lr`` times the lower of the state's
    and the fallen member's (:func:`scaled_learning_rates`; at most
    ``narrowing.max_rollbacks`` times per run); the declined member is released. Recorded as a ``revival``
    row with ``reason == "rollback"`` and a lineage row (the copy's parent: the member the state was kept
    from). Only from a state that had learnt something (:func:`~evollm.hpo.horizon.learnt`: above the run's
    starting level, :func:`starting_fitness`, by ``narrowing.decline_se`` of its standard errors): a task whose
    score first falls as the warm start's answers give way, then climbs, would otherwise be rolled back to the
    start with a lower rate. Returns the members to train on."""
    kept = getattr(record, "kept", None)
    if (not narrowing.rollback or kept is None or kept.member is None or not narrowing.finished
            or not trains_alone(len(agents), tournament) or step >= max_steps
            or revivals(record, "rollback") >= narrowing.max_rollbacks):
        return agents
    if kept.step is None or kept.step < last_cut(record):  # another member's best: not this one's to match
        return agents
    best_se = evaluation_stderr(record, kept.source, kept.step)
    if not learnt([kept.fitness], [best_se], starting_fitness(record), narrowing.decline_se):
        return agents  # a best state at the starting level: a fall from it is the dip of learning, nothing to go back to
    for agent in agents:
        if getattr(agent, "quarantined", False):
            continue
        fitness = fitness_since_change(record, int(agent.index), after=int(kept.step))
        if declined(fitness, kept.fitness, narrowing.patience, narrowing.decline,
                    best_se=best_se, z=narrowing.decline_se,
                    chosen_from=evaluations_between(record, last_cut(record), kept.step)):
            return _roll_back(agents, agent, fitness, kept, record, step, max_steps, max_time, narrowing, log)
    return agents


#: revival reasons that bring in a member from outside the lineage training alone (the reserve)
SWAPS = ("stall", "quarantine")


def last_cut(record: Population) -> int:
    """Step of the run's last narrowing or swap (0 when none): the last time the member training alone was
    chosen from others. A best state measured before it is not the member's own to fall from: a best of
    several members, or, after a stall swap or a quarantine rescue, the stalled member's plateau that the
    reserve replaced (rolling back to it would undo the swap). A roll-back is not a swap: its copy starts
    from the best state."""
    return max((int(r["step"]) for r in record.selection_rows
                if r.get("kind") == "narrowing" or (r.get("kind") == "revival" and r.get("reason") in SWAPS)),
               default=0)


def fitness_since_change(record: Population, index: int, after: int = 0) -> list[float]:
    """Member ``index``'s held-out fitness at the evaluations after step ``after`` (the best state's) and
    after the population last changed (its last cut, swap or roll-back), oldest first: a fall is measured
    from the best, and a member that has just come back is judged on its own steps."""
    since = max([int(r["step"]) for r in record.selection_rows] + [int(after)])
    return [f for step, f in member_evaluations(record, index) if step > since]


def _roll_back(agents, member, fitness, kept, record, step, max_steps, max_time, narrowing, log) -> list:
    from evollm.hpo.selection import SelectionResult

    copy = kept.member.clone()
    changed = scaled_learning_rates(copy, narrowing.rollback_lr, fell=member)
    members = [copy if a is member else a for a in agents]
    recent = fitness[-narrowing.patience:]
    scores = {int(member.index): sum(recent) / len(recent), int(copy.index): kept.fitness}
    result = SelectionResult(elite=None, population=members, dropped=[member], scores=scores,
                             best_index=int(copy.index), protected=[])
    fraction = budget_fraction(step, max_steps, narrowing.elapsed_s, max_time)
    record.record_rollback(result, step, fraction, copy, parent=int(kept.source), changed=changed)
    member.release()
    if log is not None:
        log(f"member {member.index} fell away at step {step} ({fraction:.0%} of the budget): mean fitness "
            f"{scores[int(member.index)]:.3f} over its last {len(recent)} evaluations, the best state {kept.fitness:.3f} "
            f"(member {kept.source} at step {kept.step}); member {copy.index}, a copy of that state, trains on "
            f"({describe_rates(changed) or 'learning rate unchanged'})")
    return members


def starting_fitness(record: Population) -> float:
    """The level a run started from: the median held-out fitness of its first evaluation (every member then
    had trained ``evaluation_interval`` steps); -inf before any."""
    if not record.rows:
        return -math.inf
    first = min(int(r["step"]) for r in record.rows)
    values = [float(r["fitness"]) for r in record.rows if int(r["step"]) == first]
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else -math.inf


def changed_at(record: Population) -> float:
    """The budget fraction at which the population last changed (its last cut, swap, roll-back or anneal; the
    step :func:`fitness_since_change` counts from); NaN when not recorded (a tournament's selection row)."""
    if not record.selection_rows:
        return 0.0
    step = max(int(r["step"]) for r in record.selection_rows)
    known = [float(r.get("budget_fraction", math.nan)) for r in record.selection_rows if int(r["step"]) == step]
    known = [f for f in known if not math.isnan(f)]
    return max(known) if known else math.nan


def starting_rates(record: Population) -> dict[str, float]:
    """The learning rates the run started from: the default founder's at its birth (the values set in the
    config, else the algorithm's defaults; ``algorithm.default_founder``); ``{}`` when no founder held them.

    >>> from evollm.run.population import Birth
    >>> record = Population()
    >>> record.births = [Birth(0, None, 0, 0, hyperparameters={"lr": 1e-4, "beta": 0.0}, default_founder=True),
    ...                  Birth(1, None, 0, 0, hyperparameters={"lr": 5e-4}), Birth(2, 0, 1, 10, default_founder=True,
    ...                  hyperparameters={"lr": 1.2e-4})]
    >>> starting_rates(record)
    {'lr': 0.0001}
    """
    founder = next((b for b in record.births if b.parent is None and b.default_founder), None)
    if founder is None:
        return {}
    return {k: float(v) for k, v in founder.hyperparameters.items() if k in LEARNING_RATES}


def starved(record: Population, index: int, patience: int, narrowing) -> bool:
    """Whether at least ``narrowing.no_signal`` of member ``index``'s steps since its evaluation ``patience``
    evaluations ago had no learning signal (every advantage zero): its plateau is a want of signal, which a
    lower rate cannot mend (the stall swap's case, :func:`revive_stalled`), not a rate too coarse to settle.

    >>> from types import SimpleNamespace as NS
    >>> record = NS(rows=[{"member": 1, "step": s, "fitness": 0.2} for s in (10, 20, 30)],
    ...             metric_rows=[{"member": 1, "step": s, "learn_path": "no_gradient" if s % 3 else "full"}
    ...                          for s in range(11, 31)])
    >>> starved(record, 1, 2, NS(no_signal=0.5)), starved(record, 1, 2, NS(no_signal=0.7))
    (True, False)
    """
    return lacks_signal(stall_inputs(record, index, patience)[1], narrowing.no_signal)


def anneal_plateaued(agents: list, narrowing, tournament, record: Population, step: int, max_steps: int,
                     max_time: float | None, log: Callable[[str], None] | None = None) -> list:
    """After an evaluation: when the schedule is finished and the members train alone, a member whose held-out
    fitness has :func:`~evollm.hpo.lone.plateaued` (over :func:`~evollm.hpo.lone.plateau_patience`
    evaluations: ``patience``, or more where they span less than ``narrowing.anneal_share`` of the budget) since the
    population last changed (its cut, a swap, a
    roll-back or an earlier anneal: :func:`fitness_since_change`), above the level the run started from
    (:func:`starting_fitness`), and that is not starved of signal (:func:`starved`), trains on with its learning
    rates times
    ``narrowing.anneal_lr`` (:func:`scaled_learning_rates`: not below their search range; with
    ``narrowing.anneal_floor == "start"`` not below the rates the run started from, :func:`starting_rates`), at most
    ``narrowing.max_anneals`` times per run. Recorded as a ``revival`` row with ``reason == "anneal"`` (the
    member stays: the row's ``kept``). Not for a member ``narrowing.decay`` applies to (:func:`~evollm.hpo.lone.decays`:
    its rates fall on a schedule already; both
    together halved the falling rates again on the plateaus the fall itself made: tiny GRPO -0.044 +- 0.018).
    Returns the members to train on (the same ones)."""
    from evollm.hpo.selection import SelectionResult

    if (not narrowing.anneal or not narrowing.finished
            or not trains_alone(len(agents), tournament)
            or step >= max_steps or revivals(record, "anneal") >= narrowing.max_anneals):
        return agents
    start = starting_fitness(record)
    floor = starting_rates(record) if narrowing.anneal_floor == "start" else None
    for agent in agents:
        if (getattr(agent, "quarantined", False) or revivals(record, "anneal") >= narrowing.max_anneals
                or decays(narrowing.decay, agent)):
            continue
        fitness = fitness_since_change(record, int(agent.index))
        fraction = budget_fraction(step, max_steps, narrowing.elapsed_s, max_time)
        patience = plateau_patience(narrowing.patience, len(fitness), fraction - changed_at(record),
                                    narrowing.anneal_share)
        if not plateaued(fitness, patience, start=start) or starved(record, int(agent.index), patience, narrowing):
            continue
        changed = scaled_learning_rates(agent, narrowing.anneal_lr, floor=floor)
        if not changed:  # at the lower end of its range (or at its floor) already
            continue
        scores = {int(agent.index): fitness[-1]}
        result = SelectionResult(elite=None, population=list(agents), dropped=[], scores=scores,
                                 best_index=int(agent.index), protected=[])
        record.record_revival(result, step, fraction, math.nan, reason="anneal", rates=describe_rates(changed))
        if log is not None:
            log(f"member {agent.index} plateaued at step {step} ({fraction:.0%} of the budget): no new best in its "
                f"last {patience} evaluations (best {max(fitness):.3f}); it trains on at "
                f"{describe_rates(changed)}")
    return agents
