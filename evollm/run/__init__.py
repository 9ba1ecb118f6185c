"""The run directory: what a run leaves behind and how it is watched and continued: loop callbacks,
crash-safe checkpoints and exact resume, live logging, run files and the ``evollm report`` rebuild.
Sits between :mod:`evollm.run.population` and :mod:`evollm.training`."""

from .checkpoints import RunCheckpointer, RunInterrupted, list_checkpoints, newest_valid

__all__ = ["RunCheckpointer", "RunInterrupted", "list_checkpoints", "newest_valid"]
