"""Algorithms: thin classes over :class:`LLMAgent` that turn rollouts into a loss."""

from .base import AgentConfig, LLMAgent, copy_attributes
from .grpo import CISPO, GRPO, GSPO, GRPOConfig
from .ippo import IPPOAgent, IPPOConfig, IPPOTeam
from .ppo import LLMPPO
from .reinforce import LLMREINFORCE

__all__ = ["AgentConfig", "CISPO", "GRPO", "GRPOConfig", "GSPO", "IPPOAgent", "IPPOConfig", "IPPOTeam", "LLMAgent", "LLMPPO", "LLMREINFORCE",
           "copy_attributes"]
