"""The rollout layer: everything that samples for a group of members and scores samples for the
loss. Below the algorithms and the training loops (both call it); it imports only
:mod:`evollm.functional` and :mod:`evollm.adapters`.

* :mod:`.tokens`      prompt collation, attention / action masks, the :class:`Rollout` of one member
* :mod:`.sampling`    :class:`SamplingConfig` and ``generate`` (shared-prompt prefill)
* :mod:`.population`  one batched, adapter-routed ``generate`` for many members; evaluation
* :mod:`.episodes`    multi-turn episodes played in lockstep by many members
* :mod:`.logprobs`    memory-bounded log-prob forwards (one member, routed members, reference)
"""

from .episodes import (Episode, EnvPool, collect_episodes, model_generate_fn, play_episodes,
                       population_generate_fn, stack_episodes)
from .logprobs import (action_start, first_target, forward_logits, forward_logprobs, loss_forward, member_logprobs,
                       policy_forward)
from .population import evaluate_population, generate_for_members, generate_population, sampling_groups
from .sampling import SamplingConfig, eos_ids, generate
from .tokens import (Rollout, action_mask_for, attention_from_sequences, collate_prompts, position_ids_from_mask,
                     sequence_attention_mask, stack_rows)

__all__ = ["Episode", "EnvPool", "Rollout", "SamplingConfig", "action_mask_for", "action_start", "forward_logits",
           "policy_forward", "attention_from_sequences",
           "collate_prompts", "collect_episodes", "eos_ids", "evaluate_population", "first_target", "forward_logprobs", "generate",
           "generate_for_members", "generate_population", "loss_forward", "member_logprobs", "model_generate_fn",
           "play_episodes", "population_generate_fn", "position_ids_from_mask", "sampling_groups",
           "sequence_attention_mask", "stack_episodes", "stack_rows"]
