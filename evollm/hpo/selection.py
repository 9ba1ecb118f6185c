"""Selection of the next generation.

Both selectors rank agents by a fitness score computed from
``agent.fitness`` (the last value, or the mean of the last ``window``
values) or from ``agent.scores`` (``fitness="train"``: the running mean of the
training rewards of the last ``window`` steps, as the PBT paper ranks), produce new members with ``winner.clone(index=new_id)`` and return a
:class:`SelectionResult`. Member ids are never reused: each selector keeps a
counter that continues after the largest id it has seen. Agents whose score
is NaN rank below every other agent; ties are broken by the lower id.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

import numpy as np

from evollm.hpo.compat import check_agilerl_selection

FitnessMode = Literal["last", "mean", "train"]
FITNESS_MODES: tuple[str, ...] = ("last", "mean", "train")
#: steps averaged by ``fitness="train"`` when no ``window`` is given
TRAIN_WINDOW = 10


def selection_signal(scores: Sequence[float], stderrs: Sequence[float],
                     pair_stderrs: Optional[Sequence[float]] = None) -> dict[str, float]:
    """How well a selection can tell its members apart: ``spread`` is the standard deviation of the
    members' scores (ddof=1), ``stderr`` the root mean square of their standard errors, ``snr`` their
    ratio. Below about 1, the ranking is mostly noise. Non-finite scores (quarantined members) and
    standard errors are left out; a value that cannot be computed is NaN.

    ``pair_stderrs``: the standard errors of the differences between every two members, paired over the
    items both scored (the same test questions or game seeds). Their root mean square over the square
    root of 2 is ``paired_stderr``: what ``stderr`` would be were every member scored on items of its own
    (it equals ``stderr`` when the members' item scores are uncorrelated, and is smaller when they agree
    on most items, as members a few steps from one start do); ``paired_snr = spread / paired_stderr``.

    >>> s = selection_signal([0.40, 0.42, 0.44], [0.035, 0.035, 0.035], [0.01, 0.01, 0.014])
    >>> round(s["snr"], 2), round(s["paired_stderr"], 4), round(s["paired_snr"], 2)
    (0.57, 0.0081, 2.46)
    """
    vals = np.asarray([s for s in scores if math.isfinite(s)], dtype=float)
    errs = np.asarray([e for e in stderrs if e is not None and math.isfinite(e)], dtype=float)
    spread = float(vals.std(ddof=1)) if len(vals) >= 2 else math.nan
    stderr = float(np.sqrt(np.mean(errs ** 2))) if len(errs) else math.nan
    snr = spread / stderr if math.isfinite(spread) and math.isfinite(stderr) and stderr > 0 else math.nan
    pairs = np.asarray([e for e in (pair_stderrs or []) if e is not None and math.isfinite(e)], dtype=float)
    paired = float(np.sqrt(np.mean(pairs ** 2) / 2.0)) if len(pairs) else math.nan
    paired_snr = spread / paired if math.isfinite(spread) and math.isfinite(paired) and paired > 0 else math.nan
    return {"spread": spread, "stderr": stderr, "snr": snr, "paired_stderr": paired, "paired_snr": paired_snr}


#: common steps a member needs before it can beat the default founder (:func:`beats`)
MIN_PAIRED_STEPS = 3


def beats(rewards: Sequence[float], incumbent: Sequence[float], margin: float) -> bool:
    """Whether a member with per-step training rewards ``rewards`` beats the ``incumbent`` beyond the noise:
    over their last common steps (both lists end at the same step; every member trains on the same
    prompts or game seeds at a step, so the difference cancels how hard each step's prompts were), the
    mean difference exceeds ``margin`` standard errors of it. Fewer than :data:`MIN_PAIRED_STEPS` common
    steps: no evidence (two differences of discrete rewards are often equal, a standard error of 0).

    >>> beats([0.50, 0.52, 0.48, 0.54], [0.40, 0.50, 0.45, 0.55], 2.0)  # +0.035, se 0.023: within the noise
    False
    >>> beats([0.42, 0.52, 0.47, 0.57], [0.40, 0.50, 0.45, 0.55], 2.0)  # +0.02 at every step
    True
    """
    n = min(len(rewards), len(incumbent))
    d = np.asarray(rewards[len(rewards) - n:], dtype=float) - np.asarray(incumbent[len(incumbent) - n:], dtype=float)
    d = d[np.isfinite(d)]
    if len(d) < MIN_PAIRED_STEPS:
        return False
    return bool(d.mean() > margin * d.std(ddof=1) / math.sqrt(len(d)))


def protected_scores(scores: dict[int, float], rewards: dict[int, Sequence[float]], incumbents: Sequence[int],
                     margin: float) -> dict[int, float]:
    """Ranking scores that give the default founder (``incumbents``) the benefit of the doubt: an incumbent
    ranks just above every member that has not :func:`beats` it (paired on their per-step training
    ``rewards``, ``margin`` standard errors), and below those that have. Other scores, and non-finite
    ones (a quarantined incumbent stays last), are left as they are.

    >>> protected_scores({0: 0.475, 1: 0.51}, {0: [0.40, 0.50, 0.45, 0.55], 1: [0.50, 0.52, 0.48, 0.54]}, [0], 2.0)
    {0: 0.5100000000000001, 1: 0.51}
    """
    out = dict(scores)
    for i in incumbents:
        s = scores.get(i, math.nan)
        if margin <= 0 or not math.isfinite(s):
            continue
        unbeaten = [v for j, v in scores.items() if j not in incumbents and math.isfinite(v) and v >= s
                    and not beats(rewards.get(j, ()), rewards.get(i, ()), margin)]
        if unbeaten:
            out[i] = math.nextafter(max(unbeaten), math.inf)
    return out


@dataclass
class SelectionResult:
    """Outcome of one selection step.

    Attributes:
        elite: the best agent when it is kept unchanged in ``population``
            (``None`` with ``TournamentSelection(elitism=False)``).
        population: the new generation.
        parents: new member id -> id of the agent it was cloned from.
        mutate: members that should be mutated next (the clones).
        dropped: old agents no longer in ``population``; the caller can free
            their adapters and optimizer state.
        scores: fitness score used for ranking, by old member id.
        best_index: id of the best old agent (kept or not).
        protected: ids of the members ranked with the default founder's benefit of the doubt
            (``protect_default``).
    """

    elite: Optional[Any]
    population: list
    parents: dict[int, int] = field(default_factory=dict)
    mutate: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    scores: dict[int, float] = field(default_factory=dict)
    best_index: Optional[int] = None
    protected: list = field(default_factory=list)

    def __iter__(self):
        """Unpacks as AgileRL's LLM selection does: ``elite, population, indices`` (``indices`` is None)."""
        return iter((self.elite, self.population, None))


class _Selection:
    """Shared fitness scoring, validation, id counter and cloning."""

    def __init__(self, population_size: Optional[int], fitness: str, window: Optional[int],
                 eval_loop: int, rand_seed: Optional[int], next_index: Optional[int],
                 protect_default: float = 0.0) -> None:
        if population_size is not None and population_size < 1:
            raise ValueError(f"population_size must be >= 1, got {population_size}")
        if fitness not in FITNESS_MODES:
            raise ValueError(f"fitness must be one of {list(FITNESS_MODES)}, got {fitness!r}")
        if eval_loop < 1:
            raise ValueError(f"eval_loop must be >= 1, got {eval_loop}")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if next_index is not None and next_index < 0:
            raise ValueError(f"next_index must be >= 0, got {next_index}")
        self.population_size = population_size
        self.fitness = fitness
        self.eval_loop = eval_loop
        self.window = window if window is not None else (TRAIN_WINDOW if fitness == "train" else eval_loop)
        self.rand_seed = rand_seed
        self.rng = np.random.default_rng(rand_seed)
        self.next_index = 0 if next_index is None else int(next_index)
        if protect_default < 0 or (protect_default > 0 and fitness != "train"):
            raise ValueError(f"protect_default must be >= 0 and needs fitness='train' (the standard error of a "
                             f"member's training rewards), got {protect_default!r} with fitness={fitness!r}")
        self.protect_default = float(protect_default)
        self.incumbent: Optional[dict] = None  # the default founder's hyperparameters (see adopt_default)

    def state_dict(self) -> dict:
        """The generator's state, the id counter, the population size (a narrowing schedule changes
        it) and the default founder's hyperparameters as JSON, so a resumed run selects the same way."""
        return {"rng": self.rng.bit_generator.state, "next_index": self.next_index,
                "population_size": self.population_size, "incumbent": self.incumbent}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.next_index = int(state["next_index"])
        if "population_size" in state:
            self.population_size = state["population_size"]
        self.incumbent = state.get("incumbent")

    # ------------------------------------------------------------------ the default founder
    def adopt_default(self, population: Sequence[Any]) -> None:
        """Remember the hyperparameters of the population's default founder (the member built with the
        starting values, ``default_founder``) when ``protect_default`` is on and none is known yet."""
        if self.protect_default <= 0 or self.incumbent is not None:
            return
        founder = next((a for a in population if getattr(a, "default_founder", False)), None)
        names = list(getattr(founder, "hp_config", None) or {}) if founder is not None else []
        if names:
            self.incumbent = {n: founder.get_hyperparameter(n) for n in names}

    def is_incumbent(self, agent: Any) -> bool:
        """``agent`` holds the default founder's hyperparameters (the founder itself, or an unmutated
        clone of it)."""
        if not self.incumbent:
            return False
        try:
            values = {n: agent.get_hyperparameter(n) for n in self.incumbent}
        except (AttributeError, ValueError):
            return False
        def same(v, w) -> bool:  # floats read back from the checkpoint JSON may differ in the last bit
            numbers = isinstance(v, (int, float)) and isinstance(w, (int, float))
            return v == w or (numbers and math.isclose(v, w, rel_tol=1e-9))
        return all(same(values[n], w) for n, w in self.incumbent.items())

    def protected_ids(self, population: Sequence[Any]) -> list[int]:
        """Ids of the members that get the default founder's benefit of the doubt."""
        return [int(a.index) for a in population if self.protect_default > 0 and self.is_incumbent(a)]

    def rank_scores(self, population: Sequence[Any], scores: dict[int, float],
                    incumbents: Optional[Sequence[int]] = None) -> dict[int, float]:
        """The scores members are ranked by: ``scores``, with the default founder protected (see
        :func:`protected_scores`) when ``protect_default`` is on (``incumbents``: :meth:`protected_ids`,
        when the caller has them)."""
        incumbents = self.protected_ids(population) if incumbents is None else incumbents
        if not incumbents:
            return scores
        rewards = {int(a.index): self._train_window(a) for a in population}
        return protected_scores(scores, rewards, incumbents, self.protect_default)

    def resize(self, population_size: int) -> None:
        """The population now has ``population_size`` members (a narrowing schedule dropped some)."""
        if self.population_size is not None:
            self.population_size = int(population_size)

    @property
    def min_population(self) -> int:
        """The smallest population this selection can work on."""
        return 2

    def score(self, agent: Any) -> float:
        """Ranking score of ``agent``: last fitness, mean of the last ``window`` evaluations, or
        (``fitness="train"``) mean training reward of its last ``window`` steps. A member that did not
        train at its last step (quarantined) scores -inf under ``"train"``."""
        if self.fitness == "train":
            return self._train_score(agent)
        history = list(getattr(agent, "fitness", None) or [])
        if not history:
            raise ValueError(f"agent {agent.index} has no fitness value; "
                             f"evaluate the population before selection")
        values = history[-1:] if self.fitness == "last" else history[-self.window:]
        value = float(np.mean(np.asarray(values, dtype=float)))
        return -math.inf if math.isnan(value) else value

    def _train_window(self, agent: Any) -> np.ndarray:
        history = list(getattr(agent, "scores", None) or [])
        if not history:
            raise ValueError(f"agent {agent.index} has no training reward; "
                             f"train the population before selection")
        return np.asarray(history[-self.window:], dtype=float)

    def _train_score(self, agent: Any) -> float:
        values = self._train_window(agent)
        if math.isnan(values[-1]) or getattr(agent, "quarantined", False):
            return -math.inf
        return float(np.nanmean(values))

    def stderr(self, agent: Any, eval_stderr: Optional[Sequence[float]] = None) -> float:
        """Standard error of :meth:`score`. ``"train"``: the standard deviation of the window's step
        rewards over the square root of their count; ``"last"``/``"mean"``: from the standard errors
        of the member's evaluations (``eval_stderr``, oldest first), NaN when they are not known."""
        if self.fitness == "train":
            values = self._train_window(agent)
            values = values[np.isfinite(values)]
            return float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) >= 2 else math.nan
        errs = list(eval_stderr or [])
        k = 1 if self.fitness == "last" else min(self.window, len(getattr(agent, "fitness", []) or [1]))
        errs = np.asarray(errs[-k:], dtype=float)
        if len(errs) < k or not len(errs):
            return math.nan
        return float(math.sqrt(float(np.sum(errs ** 2))) / len(errs))

    def _check(self, population: Sequence[Any]) -> dict[int, float]:
        """Validate the population, advance the id counter, return scores by id."""
        if not population:
            raise ValueError("population is empty")
        if self.population_size is not None and len(population) != self.population_size:
            raise ValueError(f"population has {len(population)} agents but "
                             f"population_size={self.population_size}")
        ids = [int(a.index) for a in population]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate agent ids in population: {duplicates}")
        self.next_index = max(self.next_index, max(ids) + 1)
        return {int(a.index): self.score(a) for a in population}

    @staticmethod
    def _ranked(population: Sequence[Any], scores: dict[int, float]) -> list:
        """Agents best first; ties broken by lower id."""
        return sorted(population, key=lambda a: (-scores[int(a.index)], int(a.index)))

    def _clone(self, parent: Any, parents: dict[int, int]) -> Any:
        """Clone ``parent`` with a fresh id and run its hooks. The id also comes after every id its
        shared base has handed out (members cloned by the user in between included)."""
        base_next = getattr(getattr(parent, "shared", None), "next_index", None)
        new_id = max(self.next_index, base_next()) if callable(base_next) else self.next_index
        self.next_index = new_id + 1
        child = parent.clone(index=new_id)
        child.run_mutation_hooks()
        parents[new_id] = int(parent.index)
        return child


class TournamentSelection(_Selection):
    """Tournament selection with optional elitism.

    Args:
        tournament_size: members per tournament, drawn WITHOUT replacement
            (so ``1 <= tournament_size <= population_size``); the best wins.
        elitism: keep the best agent unchanged (same object) in slot 0.
        population_size: expected population size (``None``: that of the
            list passed to :meth:`select`).
        eval_loop: number of evaluations per generation; the default
            ``window`` for ``fitness="mean"``.
        fitness: ``"last"`` (last fitness value), ``"mean"`` (mean of the
            last ``window`` values) or ``"train"`` (mean training reward of the
            last ``window`` steps: no evaluation needed).
        window: number of recent values averaged with ``fitness="mean"``
            (default ``eval_loop``) or steps with ``"train"`` (default 10).
        rand_seed: seed of the tournament draws.
        next_index: first id to give to clones (it is raised past the largest
            id seen anyway).
        protect_default: with ``fitness="train"``, the default founder (and
            unmutated clones of it) is kept (as the elite; by a narrowing) ahead of
            every member that has not beaten it by this many standard errors of
            their paired per-step reward difference (:func:`protected_scores`):
            the run a user gets without a search is only discarded on evidence.
            Tournaments that pick the parents of clones use the scores as
            measured. 0 (the default): ranked like any other.

    Every non-elite slot is a clone of a tournament winner; the clones are
    the members to mutate.
    """

    def __init__(self, tournament_size: int, elitism: bool = True,
                 population_size: Optional[int] = None, eval_loop: int = 1,
                 fitness: FitnessMode = "last", window: Optional[int] = None,
                 rand_seed: Optional[int] = None, next_index: Optional[int] = None,
                 protect_default: float = 0.0) -> None:
        check_agilerl_selection(tournament_size, elitism, population_size)
        super().__init__(population_size, fitness, window, eval_loop, rand_seed, next_index, protect_default)
        if tournament_size < 1:
            raise ValueError(f"tournament_size must be >= 1, got {tournament_size}")
        if population_size is not None and tournament_size > population_size:
            raise ValueError(f"tournament_size ({tournament_size}) must be <= "
                             f"population_size ({population_size})")
        self.tournament_size = int(tournament_size)
        self.elitism = bool(elitism)

    @property
    def min_population(self) -> int:
        """A tournament needs ``tournament_size`` members (and selection at least 2)."""
        return max(2, self.tournament_size)

    def _tournament(self, population: Sequence[Any], scores: dict[int, float]) -> Any:
        picks = self.rng.choice(len(population), size=self.tournament_size, replace=False)
        contenders = [population[int(i)] for i in picks]
        return self._ranked(contenders, scores)[0]

    def select(self, population: Sequence[Any]) -> SelectionResult:
        """Build the next generation (see the class docstring)."""
        population = list(population)
        if self.tournament_size > len(population):
            raise ValueError(f"tournament_size ({self.tournament_size}) must be <= "
                             f"population_size ({len(population)})")
        scores = self._check(population)
        protected = self.protected_ids(population)
        best = self._ranked(population, self.rank_scores(population, scores, protected))[0]  # the elite: the
        parents: dict[int, int] = {}                                          # default's benefit of the doubt
        new_population = [best] if self.elitism else []
        clones = [self._clone(self._tournament(population, scores), parents)  # parents: on the scores as measured
                  for _ in range(len(population) - len(new_population))]
        new_population.extend(clones)
        kept = {id(best)} if self.elitism else set()
        dropped = [a for a in population if id(a) not in kept]
        return SelectionResult(elite=best if self.elitism else None, population=new_population,
                               parents=parents, mutate=clones, dropped=dropped,
                               scores=scores, best_index=int(best.index), protected=protected)


class TruncationSelection(_Selection):
    """Truncation selection (population-based-training style exploit step).

    The bottom ``quantile`` of the population (at least one agent) is
    replaced, slot by slot, by clones of members drawn uniformly (with
    replacement) from the top ``quantile``; the other agents survive as the
    same objects and are not mutated.

    Args:
        population_size: expected population size (``None``: that of the
            list passed to :meth:`select`); at least 2.
        quantile: fraction replaced, in ``(0, 0.5]``.
        fitness, window, eval_loop, rand_seed, next_index, protect_default: as in
            :class:`TournamentSelection`.
    """

    def __init__(self, population_size: Optional[int] = None, quantile: float = 0.25,
                 fitness: FitnessMode = "last", window: Optional[int] = None,
                 rand_seed: Optional[int] = None, next_index: Optional[int] = None,
                 eval_loop: int = 1, protect_default: float = 0.0) -> None:
        super().__init__(population_size, fitness, window, eval_loop, rand_seed, next_index, protect_default)
        if not 0.0 < quantile <= 0.5:
            raise ValueError(f"quantile must be in (0, 0.5], got {quantile!r}")
        if population_size is not None and population_size < 2:
            raise ValueError(f"population_size must be >= 2 for truncation, "
                             f"got {population_size}")
        self.quantile = float(quantile)

    def n_replaced(self, population_size: int) -> int:
        """How many agents a population of this size loses per selection."""
        return max(1, int(math.floor(self.quantile * population_size + 1e-9)))

    def select(self, population: Sequence[Any]) -> SelectionResult:
        """Build the next generation (see the class docstring)."""
        population = list(population)
        if len(population) < 2:
            raise ValueError(f"truncation needs at least 2 agents, got {len(population)}")
        scores = self._check(population)
        protected = self.protected_ids(population)
        ranked = self._ranked(population, self.rank_scores(population, scores, protected))
        k = self.n_replaced(len(population))
        top, bottom = self._ranked(population, scores)[:k], ranked[-k:]  # the protected one is not replaced
        bottom_ids = {id(a) for a in bottom}
        parents: dict[int, int] = {}
        new_population, clones = [], []
        for agent in population:
            if id(agent) in bottom_ids:
                parent = top[int(self.rng.integers(len(top)))]
                child = self._clone(parent, parents)
                clones.append(child)
                new_population.append(child)
            else:
                new_population.append(agent)
        return SelectionResult(elite=ranked[0], population=new_population, parents=parents,
                               mutate=clones, dropped=list(bottom), scores=scores,
                               best_index=int(ranked[0].index), protected=protected)
