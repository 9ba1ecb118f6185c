"""The ``hpo:`` section of a run config: evolvable ranges, mutation and selection settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evollm.config.schema import ConfigError, Section, option


def _evolving(value) -> bool:
    return value is not None


@dataclass
class ParamSection(Section):
    """Range and mutation rule of one evolvable hyperparameter (see :class:`evollm.hpo.RLParameter`)."""

    min: float | None = option(None, "Smallest value (numeric parameters).")
    max: float | None = option(None, "Largest value (numeric parameters).")
    grow_factor: float = option(1.2, "Multiplier of an upward perturbation.")
    shrink_factor: float = option(0.8, "Multiplier of a downward perturbation.")
    dtype: str = option("float", "'float', 'int' or 'categorical'.", choices=("float", "int", "categorical"))
    log: bool = option(False, "Sample log-uniformly (min must be > 0).")
    choices: list[Any] | None = option(None, "Values of a categorical parameter.")

    def finalize(self) -> None:
        self.parameter()

    def parameter(self):
        from evollm.hpo import RLParameter
        try:
            return RLParameter(**self.to_dict())
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{self.path()}: {e}") from e


@dataclass
class MutationSection(Section):
    """How clones are mutated (see :class:`evollm.hpo.Mutations`); probabilities are normalised."""

    no_mutation: float = option(0.4, "Relative probability of leaving a clone unchanged.")
    rl_hp: float = option(0.6, "Relative probability of mutating one hpo.hp_config hyperparameter.")
    lora_rank: float = option(0.0, "Relative probability of resizing the adapters (needs hp_config.lora_rank).")
    explore_prob: float = option(0.0, "Probability that a mutation resamples over the whole range.")
    resample_prob: float | None = option(None, "PBT name of explore_prob (resample from the prior); wins when set.")
    perturb: str = option("one", "'one': each rl_hp mutation changes one hp_config hyperparameter; 'all': every "
                          "one (PBT's explore step).", choices=("one", "all"))
    mutate_elite: bool = option(False, "Also mutate the elite that selection keeps (off: it stays the "
                                "evaluated member).")

    def build(self, seed: int):
        from evollm.hpo import Mutations
        try:
            return Mutations(**self.to_dict(), rand_seed=seed)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"hpo.mutation: {e}") from e


@dataclass
class SelectionSection(Section):
    """How the next generation is chosen (see :mod:`evollm.hpo.selection`)."""

    type: str = option("tournament", "'tournament' or 'truncation'.", choices=("tournament", "truncation"))
    tournament_size: int = option(2, "Members per tournament.", when={"type": ("tournament",)})
    elitism: bool = option(True, "Keep the best member unchanged.", when={"type": ("tournament",)})
    quantile: float = option(0.25, "Fraction replaced by truncation.", when={"type": ("truncation",)})
    fitness: str = option("last", "Rank by the 'last' fitness or the 'mean' of the last `window`.",
                          choices=("last", "mean"))
    window: int | None = option(None, "Evaluations averaged with fitness: mean (default eval_loop).")
    eval_loop: int = option(1, "Evaluations per generation.")

    def build(self, population_size: int, seed: int):
        from evollm.hpo import TournamentSelection, TruncationSelection
        common = dict(population_size=population_size, fitness=self.fitness, window=self.window,
                      eval_loop=self.eval_loop, rand_seed=seed)
        try:
            if self.type == "tournament":
                return TournamentSelection(tournament_size=self.tournament_size, elitism=self.elitism, **common)
            return TruncationSelection(quantile=self.quantile, **common)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"hpo.selection: {e}") from e


@dataclass
class HPOSection(Section):
    """Evolutionary hyperparameter optimisation (used when train.evo_steps is set)."""

    hp_config: dict[str, ParamSection] = option({}, "Evolvable hyperparameters by name (any of the algorithm's "
                                                "mutable hyperparameters, or lora_rank).")
    mutation: MutationSection = option(default_factory=MutationSection, help="Mutation settings.",
                                       when={"train.evo_steps": _evolving})
    selection: SelectionSection = option(default_factory=SelectionSection, help="Selection settings.",
                                         when={"train.evo_steps": _evolving})
