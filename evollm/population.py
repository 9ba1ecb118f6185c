"""The record of an evolving population: who was born from whom, with which mutation,
which hyperparameters, and every fitness and train-reward measurement.

``report()`` is one row per member per evaluation; ``lineage()`` one row per birth.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pandas as pd


def _hyperparameters(agent) -> dict[str, Any]:
    names = list(agent.hp_config.names()) if getattr(agent, "hp_config", None) is not None else []
    for default in ("lr", "beta", "clip_coef", "lora_rank"):
        if default not in names:
            names.append(default)
    out = {}
    for name in names:
        try:
            value = agent.get_hyperparameter(name)
        except (ValueError, AttributeError):
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


@dataclass
class Birth:
    member: int
    parent: int | None
    generation: int
    step: int
    mutation: str = "none"
    mutation_kind: str = "none"
    old_value: Any = None
    new_value: Any = None
    hyperparameters: dict = field(default_factory=dict)


class Population:
    """History of a population of agents; the agents themselves are in ``members``."""

    def __init__(self, agents: Sequence | None = None, algorithm: str | None = None):
        self.members: list = []
        self.births: list[Birth] = []
        self.rows: list[dict] = []
        self.generation = 0
        self.algorithm = algorithm
        for agent in agents or []:
            self.add_founder(agent)

    # ------------------------------------------------------------------ recording
    def add_founder(self, agent, step: int = 0) -> None:
        self.members.append(agent)
        self.algorithm = self.algorithm or type(agent).__name__
        self.births.append(Birth(agent.index, None, self.generation, step, hyperparameters=_hyperparameters(agent)))

    def record_mutations(self, agents: Sequence, step: int) -> None:
        """Note mutations applied outside selection (e.g. a pre-training mutation of founders)."""
        for agent in agents:
            m = getattr(agent, "last_mutation", None)
            if m is None or m.kind == "none":
                continue
            birth = self._birth(agent.index)
            birth.mutation, birth.mutation_kind = m.name, m.kind
            birth.old_value, birth.new_value = _jsonable(m.old), _jsonable(m.new)
            birth.hyperparameters = _hyperparameters(agent)

    def record_evaluation(self, step: int, agents: Sequence, fitness: Sequence[float],
                          train_rewards: dict[int, float] | None = None, extra: dict[int, dict] | None = None) -> None:
        for agent, f in zip(agents, fitness):
            row = {"step": step, "generation": self.generation, "member": agent.index,
                   "parent": self._birth(agent.index).parent, "fitness": float(f),
                   "train_reward": (train_rewards or {}).get(agent.index, math.nan)}
            row.update({f"hp_{k}": v for k, v in _hyperparameters(agent).items()})
            row.update((extra or {}).get(agent.index, {}))
            self.rows.append(row)

    def record_selection(self, result, step: int) -> None:
        """After selection + mutation: register the clones as births of a new generation."""
        self.generation += 1
        for agent in result.population:
            if agent.index in result.parents:
                m = getattr(agent, "last_mutation", None)
                self.births.append(Birth(
                    agent.index, result.parents[agent.index], self.generation, step,
                    mutation=(m.name or "none") if m is not None and m.kind != "none" else "none",
                    mutation_kind=m.kind if m is not None else "none",
                    old_value=_jsonable(m.old) if m is not None else None,
                    new_value=_jsonable(m.new) if m is not None else None,
                    hyperparameters=_hyperparameters(agent)))
        self.members = list(result.population)

    def _birth(self, index: int) -> Birth:
        for b in reversed(self.births):
            if b.member == index:
                return b
        raise KeyError(f"member {index} is not in this population's record")

    # ------------------------------------------------------------------ views
    def report(self) -> pd.DataFrame:
        """One row per member per evaluation: step, generation, member, parent, fitness,
        train_reward, and every hyperparameter as ``hp_<name>``."""
        return pd.DataFrame(self.rows)

    def lineage(self) -> pd.DataFrame:
        """One row per birth: member, parent, generation, step, mutation (name, kind, old, new) and
        the member's hyperparameters at birth as ``hp_<name>``."""
        rows = []
        for b in self.births:
            d = asdict(b)
            hps = d.pop("hyperparameters")
            d.update({f"hp_{k}": v for k, v in hps.items()})
            rows.append(d)
        return pd.DataFrame(rows)

    def to_optuna(self, study_name: str, storage: str | None = None, hp_config=None):
        """Export the run as an Optuna study: one trial per member lineage segment, with its
        hyperparameters and fitness, so Optuna's visualisations and importance tools work on it."""
        from .hpo.optuna_utils import population_to_study

        hp_config = hp_config or next((a.hp_config for a in self.members if a.hp_config is not None), None)
        if hp_config is None:
            raise ValueError("to_optuna needs an hp_config (none of the members has one)")
        return population_to_study(self.lineage(), self.report(), hp_config, study_name, storage)

    def best(self):
        """The current member with the highest last fitness, among members evaluated since their
        birth (clones start with an empty fitness history, so an unevaluated clone never wins)."""
        scored = [a for a in self.members if a.fitness]
        return max(scored, key=lambda a: a.fitness[-1]) if scored else self.members[0]

    # ------------------------------------------------------------------ files
    def write(self, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"report": out / "report.csv", "lineage": out / "lineage.csv"}
        self.report().to_csv(paths["report"], index=False)
        self.lineage().to_csv(paths["lineage"], index=False)
        if plots and self.rows:
            from .plots import plot_population
            paths.update(plot_population(self.report(), out))
        return paths

    def state_dict(self) -> dict:
        return {"generation": self.generation, "algorithm": self.algorithm,
                "births": [asdict(b) for b in self.births], "rows": self.rows}

    def load_state_dict(self, state: dict) -> None:
        self.generation = state["generation"]
        self.algorithm = state.get("algorithm")
        self.births = [Birth(**b) for b in state["births"]]
        self.rows = list(state["rows"])

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.state_dict(), indent=1, default=_jsonable))

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self):
        return iter(self.members)

    def __getitem__(self, i):
        return self.members[i]


def _jsonable(value):
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "item"):
        return value.item()
    return value
