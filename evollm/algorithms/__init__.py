"""Algorithms: thin classes over :class:`LLMAgent` that turn rollouts into a loss."""

from .base import AgentConfig, LLMAgent, copy_attributes
from .grpo import CISPO, GRPO, GSPO, GRPOConfig

__all__ = ["AgentConfig", "CISPO", "GRPO", "GRPOConfig", "GSPO", "LLMAgent", "copy_attributes"]
