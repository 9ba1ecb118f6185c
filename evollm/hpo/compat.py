"""AgileRL's ``Mutations`` keywords, accepted so that AgileRL scripts run unchanged.

AgileRL mutates network architectures, weights and activations as well as RL hyperparameters.
On an LLM population the members are LoRA adapters on one frozen base, so those kinds do not
apply: their probabilities must be 0 (a non-zero value is an error that says so). Adapter rank is
evolved with ``Mutations(lora_rank=...)`` instead.
"""

from __future__ import annotations

#: AgileRL keywords that are probabilities of mutation kinds an LLM population cannot have
NETWORK_KINDS = ("architecture", "new_layer_prob", "parameters", "activation")
#: AgileRL keywords with no effect here (what they tune does not exist on an adapter population)
NO_EFFECT = ("mutation_sd", "activation_selection", "agent_ids", "device", "accelerator")


def check_agilerl_mutation_options(options: dict) -> None:
    """Accept AgileRL's extra ``Mutations`` keywords; one-line errors for anything else."""
    unknown = sorted(set(options) - set(NETWORK_KINDS) - set(NO_EFFECT))
    if unknown:
        raise TypeError(f"Mutations got unknown keyword(s) {unknown}; evollm's are no_mutation, rl_hp, "
                        f"lora_rank, explore_prob, rand_seed (AgileRL's {list(NETWORK_KINDS + NO_EFFECT)} "
                        "are accepted for compatibility)")
    for name in NETWORK_KINDS:
        value = options.get(name, 0)
        if value:
            raise ValueError(f"Mutations({name}={value!r}): network {name} mutations do not apply to LLM "
                             f"adapters on a shared frozen base; set {name}=0 (evolve the adapter rank "
                             "with lora_rank= instead)")
