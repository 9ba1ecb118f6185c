"""The loop's callback hooks; defined in :mod:`evollm.run.callbacks` so that the run layer (live
logging, run files, checkpoints) can implement them without importing the training layer."""

from ..run.callbacks import Callback, LoopState, call

__all__ = ["Callback", "LoopState", "call"]
