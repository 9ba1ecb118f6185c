"""The narrowing's cuts in the training loop: when one is due, whether it waits for a member to learn, and the
cut itself (rank, keep the best, release the rest, record it). The schedule's rules are
:class:`~evollm.hpo.narrowing.Narrowing`'s; this module applies them to the live members."""
from __future__ import annotations

import math
from typing import Callable

from evollm.hpo.horizon import learnt
from evollm.hpo.narrowing import budget_fraction
from evollm.parallel import distributed as dist
from evollm.run.population import Population, describe_rates
from .revival import learning_rate_names, park_runner_up, rates_between, starting_fitness, starting_rates


def cut_due(narrowing, size: int, step: int, max_steps: int, elapsed: float, max_time: float | None) -> bool:
    """Whether the loop should evaluate at this step for ``narrowing``'s sake (that interval's regular
    evaluation is then not repeated at its usual step, so the run evaluates as often as without): a cut
    waiting for a member to learn (``wait_se``) has reached ``wait_until``, so the wait ends there and the
    search costs no more of the budget than that; or, with ``evaluate`` on, a milestone is due that would
    release members of a population of ``size``."""
    if narrowing is None or narrowing.passed >= len(narrowing.at) or narrowing.deferred \
            or not (narrowing.waited or narrowing.evaluate):
        return False  # milestones a tied cut deferred (on_tie: one_rung) wait for the next regular evaluation
    fraction = dist.broadcast_object(budget_fraction(step, max_steps, elapsed, max_time))
    if narrowing.waited:
        return fraction >= narrowing.wait_until - 1e-12
    due = narrowing.due(fraction)
    return due > 0 and narrowing.target(size, due) < size


def narrow_population(agents: list, narrowing, step: int, max_steps: int, max_time: float | None, tournament,
                      record: Population, log: Callable[[str], None] | None = None, pair: bool = False):
    """Act on the milestones of ``narrowing`` the budget has reached: rank the members (by the
    selection's score when there is a selection, else by their last fitness), keep the best, release
    the others (adapters and optimizer state freed on the shared base) and record them as dropped.
    ``pair``: a selection among the last two members is due and is this cut (``hpo.narrowing.pair_cut``):
    every milestone left acts now. Returns ``(agents, result)``; ``result`` is ``None`` when nothing was due."""
    from evollm.hpo.selection import SelectionResult

    fraction = dist.broadcast_object(budget_fraction(step, max_steps, narrowing.elapsed_s, max_time))
    due = narrowing.remaining if pair else narrowing.due(fraction)
    if not due or (not pair and _waits(agents, narrowing, record, step, fraction, log)):
        return agents, None
    waited, narrowing.waited = narrowing.waited, 0  # the cut acts now: nothing waits any more

    def score(agent) -> float:
        if getattr(agent, "quarantined", False):
            return -math.inf
        if tournament is not None:
            return tournament.score(agent)
        return agent.fitness[-1] if agent.fitness else -math.inf

    scores = {int(a.index): float(score(a)) for a in agents}
    protected = tournament.protected_ids(agents) if hasattr(tournament, "protected_ids") else []
    ranks = tournament.rank_scores(agents, scores, protected) if protected else scores
    stderr = {int(a.index): ranking_stderr(tournament, a, record) for a in agents}
    demoted = []
    if narrowing.slow_se > 0:
        ranks, demoted = slow_ranks(agents, ranks, stderr, narrowing.slow_se, record, step)
    rank, error = (lambda a: ranks[int(a.index)]), (lambda a: stderr[int(a.index)])
    kept, dropped = narrowing.narrow(agents, rank, due, tiebreak=narrowing.tie_key(), stderr=error)
    if not dropped:  # already at the schedule's smallest size
        return agents, None
    if tournament is not None and hasattr(tournament, "resize"):
        tournament.resize(len(kept))
    best = max(kept, key=lambda a: (ranks[int(a.index)], -int(a.index)))
    result = SelectionResult(elite=None, population=list(kept), dropped=list(dropped), scores=scores,
                             best_index=int(best.index), protected=protected)
    tied = narrowing.is_tied(kept, dropped, rank, error)
    # your starting values kept on purpose (the incumbent, protect_default) train on as they are
    held = any(int(a.index) in protected or (narrowing.incumbent and getattr(a, "default_founder", False))
               for a in kept)
    faster = None if held else faster_within_noise(kept, dropped, scores, ranks, stderr, record, step,
                                                    narrowing.faster_se)
    changed = rates_between(kept[0], faster) if faster is not None else {}
    record.record_narrowing(result, step, fraction, stderr, source=getattr(tournament, "fitness", "last"), tied=tied,
                            deferred=narrowing.deferred, waited=waited, demoted=demoted,
                            rates=describe_rates(changed) or None)
    for agent in park_runner_up(dropped, lambda a: ranks[int(a.index)], narrowing, len(kept), tournament, record):
        agent.release()
    if log is not None:
        row = record.selection_rows[-1]
        snr, paired = row["snr"], row.get("paired_snr", math.nan)
        told = paired if math.isfinite(paired) else snr  # paired over the same items where known: the real noise
        hint = (" (below 1: the ranking was mostly noise; a later hpo.narrowing.at, a longer budget or more rows "
                "per step would inform it)") if told < 1 else ""
        breaker = ("the default founder's lineage first, then the recent training rewards"
                   if narrowing.tiebreak == "default_first" else "the recent training rewards")
        within = f"scores within {narrowing.tie_se:g} standard errors" if narrowing.tie_se else "equal scores"
        tie = f"; the cut fell between {within}: {breaker} broke the tie" if tied else ""
        if waited:
            tie += f"; it waited {waited} ranking(s) for a member to learn (hpo.narrowing.wait_se)"
        if narrowing.deferred:
            tie += f"; {narrowing.deferred} more milestone(s) wait for the next ranking (hpo.narrowing.on_tie: one_rung)"
        if demoted:
            tie += (f"; member(s) {demoted}, slower than the starting learning rate, ranked last: none scored "
                    f"{narrowing.slow_se:g} standard errors above the best faster member (hpo.narrowing.slow_se)")
        if changed:
            tie += (f"; member {faster.index}, released, faster, scored within {narrowing.faster_se:g} standard "
                    f"errors of member {kept[0].index}: it trains on between their rates, {describe_rates(changed)} "
                    "(hpo.narrowing.faster_se)")
        if pair:
            tie += ("; a selection among the last two members was due, so it is the last cut "
                    "(hpo.narrowing.pair_cut)")
        log(f"narrowing at step {step} ({fraction:.0%} of the budget): kept {[a.index for a in kept]}, "
            f"released {[a.index for a in dropped]}; ranking signal-to-noise {snr:.2f}"
            + (f" ({paired:.2f} paired over the same items)" if math.isfinite(paired) else "") + f"{hint}{tie}")
    return list(kept), result


def faster_within_noise(kept: list, dropped: list, scores: dict[int, float], ranks: dict[int, float],
                        stderr: dict[int, float], record: Population, step: int, z: float):
    """``hpo.narrowing.faster_se``: when a cut leaves one member (``kept``), the best by ``ranks`` of the members
    of ``dropped`` whose learning rate (the first of :func:`~evollm.training.revival.learning_rate_names`) is above
    the kept member's (healthy, with a finite score), if its score lies within ``z`` standard errors of their
    difference (paired over the items of the evaluation at ``step`` where it gave them, else from the two members'
    own ``stderr``) of the kept member's (:func:`~evollm.hpo.horizon.within_noise`); else ``None`` (also with ``z``
    0: off). A slower member is never returned: early rankings favour slow rates already (short-horizon bias)."""
    from evollm.hpo.horizon import within_noise

    if not z > 0 or len(kept) != 1 or not learning_rate_names(kept[0]):
        return None
    name = learning_rate_names(kept[0])[0]
    own = float(kept[0].get_hyperparameter(name))
    candidates = [a for a in dropped if not getattr(a, "quarantined", False) and math.isfinite(scores[int(a.index)])
                  and name in learning_rate_names(a) and float(a.get_hyperparameter(name)) > own]
    if not candidates or not math.isfinite(scores[int(kept[0].index)]):
        return None
    faster = max(candidates, key=lambda a: (ranks[int(a.index)], -int(a.index)))
    i, j = int(kept[0].index), int(faster.index)
    paired = record.pair_stderrs_at(step)
    se = paired.get((i, j), paired.get((j, i), math.hypot(stderr[i], stderr[j])))
    return faster if within_noise(scores[i], scores[j], se, z) else None


def slow_ranks(agents: list, ranks: dict[int, float], stderr: dict[int, float], z: float, record: Population,
               step: int) -> tuple[dict[int, float], list[int]]:
    """``hpo.narrowing.slow_se``: the ranking ``ranks`` with the members slower than the run's starting learning
    rate (the first of :func:`~evollm.training.revival.learning_rate_names`, against the default founder's at
    birth) ranked below the faster ones unless they beat the best of them by ``z`` standard errors of the
    difference (:func:`~evollm.hpo.horizon.demote_slow`): paired over the items of the evaluation at ``step`` where
    it gave them, else from the members' own standard errors ``stderr``. No starting rate known: ``ranks``."""
    from evollm.hpo.horizon import demote_slow, slower

    start = starting_rates(record)
    if not start:
        return ranks, []
    slow = set()
    for agent in agents:
        names = learning_rate_names(agent)
        if names and slower(agent.get_hyperparameter(names[0]), start.get(names[0])):
            slow.add(int(agent.index))
    if not slow:
        return ranks, []
    errors = {pair: math.hypot(stderr[pair[0]], stderr[pair[1]]) for pair in
              ((i, j) for i in stderr for j in stderr if i != j)}
    errors.update(record.pair_stderrs_at(step))
    return demote_slow(ranks, slow, errors, z)


def ranking_stderr(tournament, agent, record: Population) -> float:
    """Standard error of ``agent``'s ranking score (NaN when it cannot be told)."""
    if tournament is None or not hasattr(tournament, "stderr"):
        history = record.fitness_stderr(agent.index)
        return history[-1] if history else math.nan
    try:
        return float(tournament.stderr(agent, record.fitness_stderr(agent.index)))
    except ValueError:
        return math.nan


def _waits(agents: list, narrowing, record: Population, step: int, fraction: float,
           log: Callable[[str], None] | None) -> bool:
    """Whether the cut due now waits for a member to learn (``hpo.narrowing.wait_se``): no live member's last
    held-out score is ``wait_se`` standard errors above the run's starting level (:func:`learnt`), and the budget
    has not reached ``wait_until``. Counts the wait (``narrowing.waited``, recorded with the cut)."""
    if not narrowing.wait_se > 0.0:
        return False
    live = [a for a in agents if not getattr(a, "quarantined", False)]
    scores = [a.fitness[-1] if a.fitness else math.nan for a in live]
    errors = [(record.fitness_stderr(a.index) or [math.nan])[-1] for a in live]
    start = starting_fitness(record)
    if not narrowing.waits(fraction, dist.broadcast_object(learnt(scores, errors, start, narrowing.wait_se))):
        return False
    narrowing.waited += 1
    if log is not None and narrowing.waited == 1:  # once: with rankings on training rewards, one comes every step
        log(f"narrowing at step {step} ({fraction:.0%} of the budget) waits: no member scores {narrowing.wait_se:g} "
            f"standard errors above the start ({start:.3f}) yet; every member trains on, without selection, until "
            f"one does or {narrowing.wait_until:.0%} of the budget (hpo.narrowing.wait_se)")
    return True
