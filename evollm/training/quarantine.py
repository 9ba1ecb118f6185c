"""A member can fail; the population goes on.

After every learn step each member's loss and adapter parameters are checked for non-finite values
and for finite blow-ups beyond :class:`DivergenceLimits` (whether a huge learning rate ends in NaN or
in finite garbage depends on the CPU's arithmetic, so both must be caught). A member that fails is
quarantined at once: it no longer samples, learns or counts in selection
(its fitness is -inf), it is logged with its hyperparameters, and at the next selection it is
replaced by a clone of a healthy member. Clones never inherit the flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from evollm.rollout.population import Fitness


def healthy(agents: Sequence) -> list:
    return [a for a in agents if not a.quarantined]


@dataclass(frozen=True)
class DivergenceLimits:
    """Finite values past which a member counts as diverged (``None`` switches a check off).

    ``max_adapter_abs``: the largest absolute value of any trained weight (LoRA A/B, value head).
    Healthy adapters stay far below it: LoRA A starts at about ``1/sqrt(fan_in)`` and B at 0, and Adam
    moves a weight by at most about ``lr`` per step, so 1e3 takes 1e5 steps at lr 1e-2; a blown-up
    update (lr 1e6) jumps there in one step. ``max_kl``: the mean per-token k3 KL to the reference
    policy (reported when ``beta > 0``); 50 nats per token means the policy left the reference
    entirely. ``max_loss_abs``: off by default, because a loss's scale follows the reward's (a
    critic's value loss grows with the square of the rewards)."""

    max_adapter_abs: float | None = 1e3
    max_kl: float | None = 50.0
    max_loss_abs: float | None = None

    def __post_init__(self):
        for name in ("max_adapter_abs", "max_kl", "max_loss_abs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"DivergenceLimits.{name} must be a number > 0 or None, got {value!r}")


def _beyond(value, limit) -> bool:
    return limit is not None and value is not None and math.isfinite(float(value)) and abs(float(value)) > limit


def nonfinite_reason(agent, metrics: dict, limits: DivergenceLimits | None = None) -> str | None:
    """Why ``agent`` must stop (a non-finite loss or adapter/extra parameter, or a finite value beyond
    ``limits``), or ``None``."""
    limits = limits or DivergenceLimits()
    loss = metrics.get("loss", 0.0)
    if loss is not None and not math.isfinite(float(loss)):
        return f"non-finite loss {loss}"
    if _beyond(loss, limits.max_loss_abs):
        return f"loss {float(loss):.4g} beyond max_loss_abs={limits.max_loss_abs:g}"
    if _beyond(metrics.get("kl"), limits.max_kl):
        return f"KL to the reference {float(metrics['kl']):.4g} beyond max_kl={limits.max_kl:g}"
    params = agent.trainable_parameters()
    if params:
        finite = torch.stack([torch.isfinite(p).all() for p in params])
        if not bool(finite.all()):
            bad = int((~finite).sum())
            return f"{bad} adapter tensor(s) with non-finite values after the update"
        if limits.max_adapter_abs is not None:
            largest = float(torch.stack([p.detach().abs().max() for p in params if p.numel()]).max())
            if largest > limits.max_adapter_abs:
                return (f"a trained weight reached {largest:.3g} in absolute value, beyond "
                        f"max_adapter_abs={limits.max_adapter_abs:g} (the update blew up)")
    return None


class PopulationDiverged(RuntimeError):
    """Every member of the population is quarantined: nothing is left to train (``.step``, ``.reasons``)."""

    def __init__(self, step: int, agents: Sequence):
        self.step = step
        self.reasons = {int(a.index): str(a.quarantine_reason or "quarantined") for a in agents}
        shown = "; ".join(f"member {i}: {r}" for i, r in list(self.reasons.items())[:2])
        more = f"; and {len(self.reasons) - 2} more" if len(self.reasons) > 2 else ""
        super().__init__(f"every member of the population diverged by step {step} ({shown}{more}), so nothing is "
                         "left to train")


def check_members(agents: Sequence, metrics: dict[int, dict], step: int, log: Callable[[str], None],
                  limits: DivergenceLimits | None = None) -> list:
    """Quarantine every trained member that fails :func:`nonfinite_reason`; returns the newly quarantined."""
    newly = []
    for agent in agents:
        if agent.quarantined or agent.index not in metrics:
            continue
        reason = nonfinite_reason(agent, metrics[agent.index], limits)
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


def stop_if_none_healthy(agents: Sequence, step: int) -> None:
    """:class:`PopulationDiverged` when every member is quarantined: the run stops before it checkpoints
    a population with nothing left to train."""
    if agents and not healthy(agents):
        raise PopulationDiverged(step, agents)


def evaluate_healthy(agents: Sequence, evaluate: Callable[[list], list[float]]) -> list[float]:
    """Fitness in the order of ``agents``: ``evaluate`` (which records nothing) for healthy members, -inf
    for quarantined ones; recorded here, once per evaluation, in every member's fitness history. Its
    ``pair_se`` holds the paired standard errors between healthy members by id, where ``evaluate`` gave them."""
    ok = healthy(agents)
    measured = evaluate(ok) if ok else []
    scores, errors = iter(measured), iter(getattr(measured, "stderr", None) or [math.nan] * len(measured))
    fitness, stderr = [], []
    for agent in agents:
        fitness.append(-math.inf if agent.quarantined else next(scores))
        stderr.append(math.nan if agent.quarantined else next(errors))
    for agent, f in zip(agents, fitness):
        agent.record_fitness(f)
    out = Fitness(fitness, stderr)
    pairs = measured.pair_stderrs() if isinstance(measured, Fitness) else None
    if pairs is not None:
        out.pair_se = {(int(a.index), int(b.index)): pairs[i][j] for i, a in enumerate(ok) for j, b in enumerate(ok)}
    return out


def replace_quarantined(result, old_agents: Sequence, tournament) -> None:
    """After selection: a quarantined member, or a clone of one, that made it into the new population is
    replaced (in ``result``) by a clone of the best healthy old member, which is then mutated like any clone."""
    sick = {a.index for a in old_agents if a.quarantined}
    if not sick:
        return
    scores = getattr(result, "scores", None) or {}  # the selection's ranking (held-out or training rewards)
    score = (lambda a: scores[int(a.index)]) if scores else (lambda a: a.fitness[-1])
    donors = [a for a in old_agents if not a.quarantined and (int(a.index) in scores if scores else a.fitness)]
    if not donors:
        raise PopulationDiverged(max((len(a.scores) for a in old_agents), default=0), old_agents)
    donor = max(donors, key=lambda a: (score(a), -a.index))
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
