"""Training loops: one evolution loop shared by every kind of rollout."""

from .callbacks import Callback, LoopState
from .loop import evolve, finetune_llm_reasoning, learn_all
from .multiturn import finetune_llm_multiturn

__all__ = ["Callback", "LoopState", "evolve", "finetune_llm_multiturn", "finetune_llm_reasoning", "learn_all"]
