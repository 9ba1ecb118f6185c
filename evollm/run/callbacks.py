"""Hooks into the evolution loop.

:func:`evollm.training.loop.evolve` calls every callback at fixed points of a run, with a
:class:`LoopState` that says where the run is. Checkpointing, live logging and progress reports
are callbacks, so the loop itself stays readable top to bottom.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class LoopState:
    """Where a run is: ``step`` counts completed training steps; ``since_eval`` holds each member's train
    rewards since the last evaluation (a resuming callback restores both in ``on_train_begin``)."""

    step: int
    max_steps: int
    agents: list
    record: Any  # evollm.run.population.Population
    extra: dict = field(default_factory=dict)
    since_eval: dict = field(default_factory=dict)


class Callback:
    """Base class: override the events you need; each default does nothing."""

    def on_train_begin(self, state: LoopState) -> None:
        """Before the first step (``state.step`` is the step the run starts from)."""

    def on_step_end(self, state: LoopState, metrics: dict[int, dict]) -> None:
        """After every training step; ``metrics`` maps member index to its learn metrics."""

    def on_evaluation(self, state: LoopState, fitness: Sequence[float]) -> None:
        """After an evaluation of every member (``fitness`` in the order of ``state.agents``)."""

    def on_selection(self, state: LoopState, result: Any) -> None:
        """After selection and mutation (``state.agents`` is already the new population)."""

    def on_step_complete(self, state: LoopState) -> None:
        """After everything a step does (learning, evaluation, selection): a consistent point to checkpoint."""

    def on_train_end(self, state: LoopState) -> None:
        """After the last step (also reached when the run stops early)."""


def call(callbacks: Sequence[Callback], event: str, *args) -> None:
    for cb in callbacks:
        getattr(cb, event)(*args)
