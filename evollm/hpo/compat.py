"""AgileRL's ``Mutations`` and ``TournamentSelection`` arguments, accepted so that AgileRL scripts run unchanged.

AgileRL mutates network architectures, weights and activations as well as RL hyperparameters.
On an LLM population the members are LoRA adapters on one frozen base, so those kinds do not
apply: as AgileRL does for LLMs, a drawn architecture mutation raises :class:`MutationError` and a
drawn parameters/activation mutation leaves the member unchanged with a warning (a one-time note
says so when the probabilities are set). Adapter rank is evolved with ``Mutations(lora_rank=...)``.
"""

from __future__ import annotations

import warnings

#: AgileRL keywords that are probabilities of mutation kinds an LLM population cannot have
NETWORK_KINDS = ("architecture", "new_layer_prob", "parameters", "activation")
#: AgileRL keywords with no effect here (what they tune does not exist on an adapter population)
NO_EFFECT = ("mutation_sd", "activation_selection", "agent_ids", "device", "accelerator")


#: AgileRL's mutation kinds drawn on networks (``new_layer_prob`` is a sub-probability of ``architecture``)
NETWORK_MUTATIONS = ("architecture", "parameters", "activation")


class MutationError(RuntimeError):
    """A mutation that cannot apply to an LLM population (AgileRL's architecture mutation)."""


def check_agilerl_mutation_options(options: dict) -> dict[str, float]:
    """Accept AgileRL's extra ``Mutations`` keywords (one-line errors for anything else); returns the
    probability masses of AgileRL's network mutation kinds. A non-zero one is accepted with a note and
    behaves as AgileRL's does on an LLM population (see :func:`network_mutation`)."""
    unknown = sorted(set(options) - set(NETWORK_KINDS) - set(NO_EFFECT))
    if unknown:
        raise TypeError(f"Mutations got unknown keyword(s) {unknown}; evollm's are no_mutation, rl_hp, "
                        f"lora_rank, explore_prob, rand_seed (AgileRL's {list(NETWORK_KINDS + NO_EFFECT)} "
                        "are accepted for compatibility)")
    masses = {name: float(options.get(name) or 0.0) for name in NETWORK_MUTATIONS}
    if any(masses.values()):
        warnings.warn("Mutations: network mutations (architecture, parameters, activation) cannot apply to LoRA "
                      "adapters on a shared frozen base; as in AgileRL for LLMs, an architecture draw raises "
                      "MutationError and a parameters/activation draw leaves the member unchanged with a warning "
                      "(evolve the adapter rank with lora_rank= instead)", UserWarning, stacklevel=3)
    return masses


def network_mutation(kind: str):
    """What AgileRL does when a network mutation is drawn for an LLM member."""
    from evollm.hpo.protocol import MutationRecord
    if kind == "architecture":
        raise MutationError("Architecture mutations are not supported for LLM algorithms: members are LoRA "
                            "adapters on one frozen base (evolve lora_rank instead)")
    warnings.warn(f"{kind.capitalize()} mutations are not supported for LLM algorithms; the member is left "
                  "unchanged", UserWarning, stacklevel=3)
    return MutationRecord(kind="none")


#: AgileRL's positional order of ``Mutations(...)``
AGILERL_POSITIONAL = ("no_mutation", "architecture", "new_layer_prob", "parameters", "activation", "rl_hp",
                      "mutation_sd", "activation_selection", "mutate_elite", "rand_seed", "device", "accelerator")


class AgileRLCheckError(ValueError, AssertionError):
    """A value AgileRL's constructors reject with an ``AssertionError`` (a ``ValueError`` too)."""


def agilerl_positional(args: tuple) -> dict:
    """AgileRL's positional ``Mutations(no_mutation, architecture, new_layer_prob, parameters, activation,
    rl_hp, mutation_sd, ...)`` as keywords (AgileRL needs at least six positionals, evollm's own call takes
    at most six with a string ``perturb`` sixth, so the two cannot be confused)."""
    if len(args) > len(AGILERL_POSITIONAL):
        raise TypeError(f"Mutations takes at most {len(AGILERL_POSITIONAL)} positional arguments "
                        f"(AgileRL's order), got {len(args)}")
    return dict(zip(AGILERL_POSITIONAL, args))


def check_agilerl_values(options: dict) -> None:
    """AgileRL's own checks, with its messages: probabilities >= 0, ``new_layer_prob`` in [0, 1]."""
    for name in ("no_mutation", "architecture", "parameters", "activation", "rl_hp", "mutation_sd"):
        value = options.get(name)
        if value is not None and not value >= 0:
            raise AgileRLCheckError(f"Mutations.{name} must be a finite probability >= 0 (greater than or equal to "
                                    f"zero), got {value!r}")
    new_layer = options.get("new_layer_prob")
    if new_layer is not None and not 0 <= new_layer <= 1:
        raise AgileRLCheckError(f"Probability of new layer must be between zero and one (inclusive), got {new_layer}")


def check_agilerl_selection(tournament_size, elitism, population_size) -> None:
    """AgileRL's TournamentSelection checks, with its messages."""
    if not tournament_size > 0:
        raise AgileRLCheckError(f"tournament_size must be >= 1 (Tournament size must be greater than zero), got {tournament_size}")
    if not isinstance(elitism, (bool, int)) or isinstance(elitism, str):
        raise AgileRLCheckError(f"elitism must be a boolean (True or False), got {elitism!r}")
    if population_size is not None and not population_size > 0:
        raise AgileRLCheckError(f"population_size must be >= 1 (Population size must be greater than zero), got {population_size}")
