"""evollm: RL fine-tuning of causal LLMs with an evolving population on one shared base."""
__version__ = "0.1.0"
