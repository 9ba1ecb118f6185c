"""evollm: RL fine-tuning of causal LLMs with an evolving population on one shared base model."""

__version__ = "0.1.0"

from .population import Population  # noqa: E402

__all__ = ["Population", "__version__"]
