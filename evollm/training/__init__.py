"""Training loops: one evolution loop shared by every kind of rollout."""

from .batched import evaluate_population, generate_population
from .loop import evolve, finetune_llm_reasoning

__all__ = ["evaluate_population", "evolve", "finetune_llm_reasoning", "generate_population"]
