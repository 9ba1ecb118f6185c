"""Evolutionary hyperparameter optimisation of a population of agents.

The engine talks to agents only through :class:`EvolvableAgent`; it mutates
hyperparameters (:class:`Mutations`), selects the next generation
(:class:`TournamentSelection`, :class:`TruncationSelection`) and seeds
initial hyperparameters (:func:`initial_population_hyperparameters`); :class:`Narrowing` narrows
the population as its budget is spent; :func:`default_hp_config` is the search space a user gets by
default (LoRA learning rates).
"""
from evollm.hpo.compat import MutationError
from evollm.hpo.defaults import DEFAULT_RANGES, default_hp_config
from evollm.hpo.mutation import Mutations
from evollm.hpo.narrowing import Narrowing
from evollm.hpo.optuna_utils import hp_config_to_distributions, initial_population_hyperparameters
from evollm.hpo.parameters import HyperparameterConfig, RLParameter
from evollm.hpo.protocol import EvolvableAgent, MutationRecord
from evollm.hpo.selection import SelectionResult, TournamentSelection, TruncationSelection, selection_signal

__all__ = [
    "RLParameter",
    "HyperparameterConfig",
    "Mutations",
    "MutationError",
    "MutationRecord",
    "TournamentSelection",
    "TruncationSelection",
    "SelectionResult",
    "EvolvableAgent",
    "initial_population_hyperparameters",
    "Narrowing",
    "default_hp_config",
    "DEFAULT_RANGES",
    "selection_signal",
    "hp_config_to_distributions",
]
