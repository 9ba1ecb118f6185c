"""The run directory: crash-safe checkpoints of a whole run and exact resume."""

from .checkpoints import RunCheckpointer, RunInterrupted, list_checkpoints, newest_valid

__all__ = ["RunCheckpointer", "RunInterrupted", "list_checkpoints", "newest_valid"]
