"""The interface between the evolutionary HPO engine and the agents it evolves.

The engine (mutations, selection, population seeding) never touches model
internals: everything it needs from an agent is described by
:class:`EvolvableAgent`. Any object with these attributes and methods can be
evolved, which keeps the engine testable with small stand-in objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover - import only for type checkers
    from evollm.hpo.parameters import HyperparameterConfig

MutationKind = Literal["none", "rl_hp", "lora_rank"]


@dataclass
class MutationRecord:
    """What the last mutation did to an agent (set as ``agent.last_mutation``).

    Attributes:
        kind: ``"none"`` (left unchanged), ``"rl_hp"`` (one hyperparameter
            perturbed or resampled) or ``"lora_rank"`` (adapters resized).
        name: the mutated hyperparameter name (``"lora_rank"`` for rank
            mutations), ``None`` when ``kind == "none"``.
        old: value before the mutation (``None`` when ``kind == "none"``).
        new: value after the mutation (``None`` when ``kind == "none"``).
        explored: ``True`` when the value was resampled from the whole range
            rather than perturbed around the old value.
    """

    kind: MutationKind = "none"
    name: Optional[str] = None
    old: Any = None
    new: Any = None
    explored: bool = False

    @property
    def changed(self) -> bool:
        """Whether the mutation actually changed the value."""
        return self.kind != "none" and self.old != self.new

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly representation (for logs and checkpoints)."""
        return {"kind": self.kind, "name": self.name, "old": self.old,
                "new": self.new, "explored": self.explored}


@runtime_checkable
class EvolvableAgent(Protocol):
    """What the HPO engine requires from a population member.

    Attributes:
        index: unique member id; ids are never reused within a run.
        hp_config: which hyperparameters evolve for this agent (``None``: none).
        fitness: fitness history, appended by the training loop after each
            evaluation (higher is better).
        lora_rank: current adapter rank.
        last_mutation: set by the engine after each mutation.
    """

    index: int
    hp_config: Optional["HyperparameterConfig"]
    fitness: list[float]
    lora_rank: int
    last_mutation: Optional[MutationRecord]

    def get_hyperparameter(self, name: str) -> Any:
        """Current value of hyperparameter ``name``."""
        ...

    def set_hyperparameter(self, name: str, value: Any) -> None:
        """Set ``name`` to ``value`` so that it takes effect immediately.

        Raises:
            ValueError: if the agent cannot evolve ``name``.
        """
        ...

    def mutable_hyperparameters(self) -> tuple[str, ...]:
        """Names of the hyperparameters this agent can evolve."""
        ...

    def set_lora_rank(self, r: int) -> None:
        """Resize the agent's adapters to rank ``r``."""
        ...

    def clone(self, index: Optional[int] = None) -> "EvolvableAgent":
        """Independent copy (adapters, optimizer state, fitness) with id ``index``."""
        ...

    def run_mutation_hooks(self) -> None:
        """Run user hooks; called after every mutation and every engine clone."""
        ...
