"""Algorithms: thin classes over :class:`LLMAgent` that turn rollouts into a loss."""

from .base import AgentConfig, LLMAgent, copy_attributes
from .grpo import CISPO, GRPO, GSPO, GRPOConfig
from .ppo import LLMPPO
from .reinforce import LLMREINFORCE

__all__ = ["AgentConfig", "CISPO", "GRPO", "GRPOConfig", "GSPO", "LLMAgent", "LLMPPO", "LLMREINFORCE",
           "copy_attributes"]
