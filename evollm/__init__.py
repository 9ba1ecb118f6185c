"""evollm: RL fine-tuning of causal LLMs with an evolving population on one shared base model."""

import warnings as _warnings

__version__ = "0.1.0"

# PEFT calls a transformers method deprecated in 5.x on every adapter operation; the message says
# nothing actionable to an evollm user.
_warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

from .population import Population  # noqa: E402

__all__ = ["Population", "__version__"]
