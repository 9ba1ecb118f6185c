"""evollm: RL fine-tuning of causal LLMs with an evolving population on one shared base model.

The main classes are importable from the top level (loaded on first use, so ``import evollm`` stays
cheap)::

    from evollm import GRPO, ReasoningGym, Mutations, TournamentSelection, HyperparameterConfig, \\
        RLParameter, finetune_llm_reasoning
"""

import importlib as _importlib
import warnings as _warnings

__version__ = "0.1.0"

# PEFT calls a transformers method deprecated in 5.x on every adapter operation; the message says
# nothing actionable to an evollm user.
_warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

from evollm.run.population import Population  # noqa: E402

#: top-level name -> module that defines it
_EXPORTS = {
    "GRPO": "evollm.algorithms.grpo", "GSPO": "evollm.algorithms.grpo", "CISPO": "evollm.algorithms.grpo",
    "GRPOConfig": "evollm.algorithms.grpo", "LLMPPO": "evollm.algorithms.ppo",
    "LLMREINFORCE": "evollm.algorithms.reinforce",
    "ReasoningGym": "evollm.envs.reasoning", "TokenObservationWrapper": "evollm.envs.multiturn",
    "Mutations": "evollm.hpo", "TournamentSelection": "evollm.hpo", "TruncationSelection": "evollm.hpo",
    "HyperparameterConfig": "evollm.hpo", "RLParameter": "evollm.hpo",
    "finetune_llm_reasoning": "evollm.training", "LoopSettings": "evollm.training",
    "finetune_llm_multiturn": "evollm.training", "load_model": "evollm.models.loading",
    "VLLMConfig": "evollm.algorithms.compat", "load_smollm2": "evollm.models.loading",
}

__all__ = ["Population", "__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'evollm' has no attribute {name!r}")
