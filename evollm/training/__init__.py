"""Training loops: one evolution loop shared by every kind of rollout."""

from .callbacks import Callback, LoopState
from .ippo import IPPOTrainer, finetune_ippo
from .loop import evolve, finetune_llm_reasoning, learn_all
from .quarantine import DivergenceLimits, PopulationDiverged
from .multiturn import finetune_llm_multiturn
from .settings import LoopSettings

__all__ = ["Callback", "DivergenceLimits", "IPPOTrainer", "LoopSettings", "LoopState", "PopulationDiverged", "evolve",
           "finetune_ippo", "finetune_llm_multiturn", "finetune_llm_reasoning", "learn_all"]
