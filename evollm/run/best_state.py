"""The best evaluated state of a run, kept so that a late collapse cannot cost the run (``keep_best``).

RL fine-tuning does not improve monotonically: a member can reach its best held-out fitness and then
fall (a learning rate that is too high, a lone survivor of a narrowed population, a reward hack). With
``keep_best`` the loop clones the member with the best fitness of each evaluation whenever that
fitness is at least every earlier one (a tie keeps the later state: it measured the same on the fixed
test set and trained longer; greedy evaluations stay flat for long stretches while the sampled policy
still improves). The clone is a whole member (adapters, optimizer state, hyperparameters) on the
shared base that takes no further step. At the end :meth:`~evollm.run.population.Population.best`
returns it when its fitness, less its luck, is strictly above every live member's last fitness, so
``best_member/``, the elite and ``evollm export`` hold the best state the run measured, not only the last one.

Its luck: the kept state is the highest of every evaluation the run has made, so on a flat score it lies
above its true fitness by about :func:`~evollm.hpo.lone.expected_max_normal` of their number standard errors
of its evaluation (2.0 after 30 evaluations, 2.5 after 100), while a live member's last evaluation is not
selected. Without that allowance a run whose held-out score is flat within the noise returns whichever old
state drew the luckiest evaluation, and drops every later step; with it, the kept state is returned when the
live members have fallen further than luck explains (a collapse), and the last state otherwise.

Fitness is a greedy evaluation on a fixed test set, so the kept member's recorded fitness is the
measured fitness of exactly its weights. The kept member is saved with every run checkpoint
(``kept_best/``, the member file format plus ``kept.json``) and restored on resume, so a resumed run
keeps the same state. Its id is a fresh one of the base (it is a clone); ``source`` and ``step`` say
which member it was copied from and when.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from evollm.algorithms.checkpoint import write_agent
from evollm.hpo.lone import expected_max_normal
from .checkpoints import load_member

KEPT_DIR = "kept_best"
KEPT_FILE = "kept.json"


def best_of_evaluation(agents: Sequence, fitness: Sequence[float]) -> tuple[int, float] | None:
    """``(position, fitness)`` of the best healthy member of one evaluation (ties: the lower id), or
    ``None`` when no member has a finite fitness."""
    found = [(float(f), -int(a.index), i) for i, (a, f) in enumerate(zip(agents, fitness))
             if not getattr(a, "quarantined", False) and f is not None and math.isfinite(float(f))]
    if not found:
        return None
    f, _, i = max(found)
    return i, f


def beats_members(fitness: float, members: Sequence) -> bool:
    """Whether ``fitness`` is strictly above the last fitness of every evaluated, healthy member of ``members``."""
    last = [a.fitness[-1] for a in members if a.fitness and not getattr(a, "quarantined", False)]
    return all(fitness > f for f in last)


def write_parked(member, folder: Path, name: str, info_file: str, info: dict) -> None:
    """Write a member outside the population (kept best state, reserve) into ``folder/name/`` (the member
    file format) with ``info`` as ``info_file`` beside it: part of a run checkpoint. ``member`` ``None``:
    ``info`` alone (a reserve that was used up)."""
    out = Path(folder) / name
    if member is not None:
        out = write_agent(member, out)
    out.mkdir(parents=True, exist_ok=True)
    (out / info_file).write_text(json.dumps(info, indent=1))


def read_parked(folder: Path, name: str, info_file: str, live: Sequence):
    """``(member, info)`` written by :func:`write_parked` into checkpoint ``folder``, restored onto the base of
    ``live`` (cloned from a live member of the same kind, with the saved id, rank and files; ``None`` when
    ``info`` was written alone); ``None`` when the checkpoint has none."""
    where = Path(folder) / name
    if not (where / info_file).is_file():
        return None
    info = json.loads((where / info_file).read_text())
    member = None if info.get("member") is None else load_member(list(live), where, int(info["member"]))
    return member, info


class KeptBest:
    """The best evaluated state of the run (see the module docstring); ``member`` is ``None`` until the
    first evaluation."""

    def __init__(self) -> None:
        self.member = None
        self.source: int | None = None  # id of the member it was copied from
        self.step: int | None = None  # completed steps when it was evaluated
        self.fitness = -math.inf
        self.se = math.nan  # standard error of its evaluation (NaN: not recorded)
        self.draws = 0  # member evaluations it was the best of (every finite fitness offered)

    def offer(self, agents: Sequence, fitness: Sequence[float], step: int) -> bool:
        """After an evaluation: keep a clone of its best member when its fitness is at least the kept
        one's (a tie keeps the later state); the previous kept member is released. Returns whether a new
        state was kept."""
        self.draws += sum(1 for f in fitness if f is not None and math.isfinite(float(f)))
        best = best_of_evaluation(agents, fitness)
        if best is None or not best[1] >= self.fitness:
            return False
        agent = agents[best[0]]
        clone = agent.clone()
        clone.record_fitness(best[1])
        self._replace(clone, source=int(agent.index), step=int(step), fitness=best[1])
        stderr = getattr(fitness, "stderr", None)
        self.se = float(stderr[best[0]]) if stderr is not None and stderr[best[0]] is not None else math.nan
        return True

    def luck(self) -> float:
        """How far above its true fitness the kept state's evaluation lies by chance, as the best of
        :attr:`draws` evaluations: ``expected_max_normal(draws)`` standard errors of it (0 when unknown)."""
        if self.member is None or not math.isfinite(self.se):
            return 0.0
        return expected_max_normal(max(int(self.draws), 1)) * self.se

    def _replace(self, member, source: int, step: int, fitness: float) -> None:
        if self.member is not None:
            self.member.release()
        self.member, self.source, self.step, self.fitness = member, source, step, float(fitness)

    def beats(self, members: Sequence) -> bool:
        """Whether the kept state, less its :meth:`luck`, is strictly better than every evaluated member of
        ``members``."""
        return self.member is not None and beats_members(self.fitness - self.luck(), members)

    def info(self) -> dict:
        """``{member, source, step, fitness, se, draws}`` (JSON; ``se`` ``None`` when not recorded), or ``{}``
        before the first evaluation."""
        if self.member is None:
            return {}
        return {"member": int(self.member.index), "source": self.source, "step": self.step, "fitness": self.fitness,
                "se": self.se if math.isfinite(self.se) else None, "draws": self.draws}

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: Path) -> None:
        """Write the kept member into ``folder/kept_best/`` (part of a run checkpoint); nothing before
        the first evaluation."""
        if self.member is not None:
            write_parked(self.member, folder, KEPT_DIR, KEPT_FILE, self.info())

    def load(self, folder: Path, live: Sequence) -> None:
        """Restore the kept member of checkpoint ``folder`` onto the base of ``live`` (cloned from a live
        member of the same kind, with the saved id, rank and files). A checkpoint without one leaves
        nothing kept."""
        if self.member is not None:
            self.member.release()
        self.member, self.source, self.step, self.fitness = None, None, None, -math.inf
        self.se, self.draws = math.nan, 0
        found = read_parked(folder, KEPT_DIR, KEPT_FILE, live)
        if found is not None:
            member, info = found
            self.member, self.source, self.step = member, info.get("source"), info.get("step")
            self.fitness = float(info["fitness"])
            self.se = math.nan if info.get("se") is None else float(info["se"])
            self.draws = int(info.get("draws", 0))  # a checkpoint written before draws were counted: 0
