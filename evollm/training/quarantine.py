"""A member can fail; the population goes on.

After every learn step each member's loss and adapter parameters are checked for non-finite values.
A member that fails is quarantined at once: it no longer samples, learns or counts in selection
(its fitness is -inf), it is logged with its hyperparameters, and at the next selection it is
replaced by a clone of a healthy member. Clones never inherit the flag.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch


def healthy(agents: Sequence) -> list:
    return [a for a in agents if not a.quarantined]


def nonfinite_reason(agent, metrics: dict) -> str | None:
    """Why ``agent`` must stop (a non-finite loss or adapter/extra parameter), or ``None``."""
    loss = metrics.get("loss", 0.0)
    if loss is not None and not math.isfinite(float(loss)):
        return f"non-finite loss {loss}"
    params = agent.trainable_parameters()
    if params:
        finite = torch.stack([torch.isfinite(p).all() for p in params])
        if not bool(finite.all()):
            bad = int((~finite).sum())
            return f"{bad} adapter tensor(s) with non-finite values after the update"
    return None


def check_members(agents: Sequence, metrics: dict[int, dict], step: int, log: Callable[[str], None]) -> list:
    """Quarantine every trained member that fails :func:`nonfinite_reason`; returns the newly quarantined."""
    newly = []
    for agent in agents:
        if agent.quarantined or agent.index not in metrics:
            continue
        reason = nonfinite_reason(agent, metrics[agent.index])
        if reason is not None:
            agent.quarantine(f"step {step}: {reason}")
            hps = {}
            for name in getattr(agent, "MUTABLE", ()):
                try:
                    hps[name] = agent.get_hyperparameter(name)
                except (ValueError, AttributeError):
                    continue
            log(f"member {agent.index} quarantined at step {step}: {reason}; hyperparameters {hps} "
                "(no longer trained or evaluated; replaced by a clone of a healthy member at the next selection)")
            newly.append(agent)
    return newly


def evaluate_healthy(agents: Sequence, evaluate: Callable[[list], list[float]]) -> list[float]:
    """Fitness in the order of ``agents``: ``evaluate`` (which records nothing) for healthy members, -inf
    for quarantined ones; recorded here, once per evaluation, in every member's fitness history."""
    ok = healthy(agents)
    scores = iter(evaluate(ok) if ok else [])
    fitness = [-math.inf if agent.quarantined else next(scores) for agent in agents]
    for agent, f in zip(agents, fitness):
        agent.record_fitness(f)
    return fitness


def replace_quarantined(result, old_agents: Sequence, tournament) -> None:
    """After selection: a quarantined member, or a clone of one, that made it into the new population is
    replaced (in ``result``) by a clone of the best healthy old member, which is then mutated like any clone."""
    sick = {a.index for a in old_agents if a.quarantined}
    if not sick:
        return
    donors = [a for a in old_agents if not a.quarantined and a.fitness]
    if not donors:
        raise RuntimeError("every member of the population is quarantined (non-finite losses or adapters); "
                           "lower the learning rates or their hpo.hp_config ranges")
    donor = max(donors, key=lambda a: (a.fitness[-1], -a.index))
    for slot, agent in enumerate(list(result.population)):
        parent = result.parents.get(agent.index)
        if agent.index not in sick and parent not in sick:
            continue
        index = getattr(tournament, "next_index", None)
        child = donor.clone(index=index)
        if index is not None:
            tournament.next_index = index + 1
        child.run_mutation_hooks()
        result.population[slot] = child
        result.parents.pop(agent.index, None)
        result.parents[child.index] = int(donor.index)
        result.mutate = [child if m is agent else m for m in result.mutate]
        if child not in result.mutate:
            result.mutate.append(child)
        if agent.index not in sick:  # a fresh clone of a quarantined parent: never used, free it now
            agent.release()
        elif agent not in result.dropped:
            result.dropped.append(agent)
