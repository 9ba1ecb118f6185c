"""Pure tensor functions for the RL objectives used by evollm.

Everything here is stateless and works on plain ``torch.Tensor`` inputs, so
it can be unit-tested against hand-computed values and reused by every
algorithm (GRPO family, PPO, REINFORCE variants, multi-turn training).

Shape conventions
-----------------
``B``  number of sequences (samples) in the batch.
``G``  group size (completions per prompt) for group-relative methods.
``T``  number of completion (action) token positions per sequence.
``L``  sequence length of a logits tensor, ``V`` vocabulary size.
``K``  number of turns in a multi-turn episode.

Masks may be bool, integer or float tensors; a cell is *valid* when its mask
value is non-zero.  Values in invalid cells are never read arithmetically
(they may hold garbage, ``inf`` or ``NaN``) and outputs are 0 there.
"""

from .advantages import (ADVANTAGE_SCALES, explained_variance, gae, group_advantages, informative_groups,
                         overlong_penalty, rebn, truncation_bootstrap)
from .losses import (LOSS_PRESETS, LOSS_TYPES, SAMPLER_CORRECTIONS, SAMPLER_STATS, approx_kl, k3_kl,
                     policy_loss, policy_loss_with_stats, sampler_importance_weights, value_loss)
from .masked import masked_mean, masked_sum, masked_whiten
from .tokens import broadcast_turn_values, entropy_from_logits, token_logprobs, turn_values_from_tokens

__all__ = [
    "LOSS_TYPES", "LOSS_PRESETS", "ADVANTAGE_SCALES", "group_advantages", "overlong_penalty",
    "informative_groups", "k3_kl", "approx_kl", "policy_loss",
    "policy_loss_with_stats", "gae", "truncation_bootstrap", "explained_variance", "rebn", "masked_mean",
    "masked_sum", "masked_whiten",
    "value_loss", "token_logprobs", "entropy_from_logits", "broadcast_turn_values",
    "turn_values_from_tokens", "SAMPLER_CORRECTIONS", "SAMPLER_STATS", "sampler_importance_weights",
]
