"""Training loops: one evolution loop shared by every kind of rollout."""

from .callbacks import Callback, LoopState
from .ippo import IPPOTrainer, finetune_ippo
from .loop import evolve, finetune_llm_reasoning, learn_all
from .quarantine import DivergenceLimits
from .multiturn import finetune_llm_multiturn

__all__ = ["Callback", "DivergenceLimits", "IPPOTrainer", "LoopState", "evolve", "finetune_ippo", "finetune_llm_multiturn", "finetune_llm_reasoning", "learn_all"]
