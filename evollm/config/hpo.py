"""The ``hpo:`` section of a run config: evolvable ranges, mutation and selection settings."""

from __future__ import annotations

import dataclasses
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
        if not self.uses_default_range():
            self.parameter()

    def uses_default_range(self) -> bool:
        """Neither bounds nor choices given: the name's default range applies (evollm.hpo.DEFAULT_RANGES)."""
        return self.min is None and self.max is None and self.choices is None and self.dtype != "categorical"

    def parameter(self, name: str | None = None):
        if name is not None and self.uses_default_range():
            from evollm.hpo.defaults import DEFAULT_RANGES
            if name not in DEFAULT_RANGES:
                raise ConfigError(f"{self.path()}: no default range for {name!r}; give min and max (names with a "
                                  f"default: {sorted(DEFAULT_RANGES)})")
            spec = {**self.to_dict(), **DEFAULT_RANGES[name]}
            spec["dtype"] = DEFAULT_RANGES[name].get("dtype", "float")
            from evollm.hpo import RLParameter
            return RLParameter(**spec)
        from evollm.hpo import RLParameter
        try:
            return RLParameter(**self.to_dict())
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{self.path()}: {e}") from e


@dataclass
class MutationSection(Section):
    """How clones are mutated (see :class:`evollm.hpo.Mutations`); probabilities are normalised."""

    no_mutation: float = option(0.0, "Relative probability of leaving a clone unchanged (0: every clone "
                                "explores; a clone identical to its parent only duplicates it).")
    rl_hp: float = option(1.0, "Relative probability of mutating one hpo.hp_config hyperparameter.")
    lora_rank: float = option(0.0, "Relative probability of resizing the adapters (needs hp_config.lora_rank).")
    explore_prob: float = option(0.0, "Probability that a mutation resamples over the whole range.")
    model_prob: float = option(0.0, "Probability that a mutation takes every hp_config value from a model fitted on "
                               "the population's own history (PB2-style: hyperparameters -> score improvement "
                               "between selections).")
    model_sampler: str = option("gp", "The model of model_prob: 'gp' (Optuna's GPSampler, as PB2) or 'tpe'.",
                                choices=("gp", "tpe"))
    model_history: int = option(64, "Most recent observations (one per member per selection) the model is "
                                "fitted on.")
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
    fitness: str = option("last", "Rank on the 'last' held-out fitness (the default: greedy answers to the fixed "
                          "test set, which every member gets every evaluation_interval steps anyway; on the HPO "
                          "benchmark it ranked as well as training rewards on the tiny task and the game and found "
                          "SmolLM2's better learning rate where training rewards of 8 samples a step could not), "
                          "the 'mean' of the last `window` evaluations, or 'train': the running mean of the training "
                          "rewards of the last `window` steps (free and available at every step, as the PBT paper "
                          "ranks; noisy when a step has few samples).",
                          choices=("last", "mean", "train"))
    window: int | None = option(None, "Evaluations averaged with fitness: mean (default eval_loop), or steps "
                                "with fitness: train (default 10).")
    eval_loop: int = option(1, "Evaluations per generation.")
    protect_default: float = option(0.0, "With fitness: train, the default founder (algorithm.default_founder) is kept "
                                    "(as the elite, or by a narrowing) ahead of every member whose per-step training "
                                    "rewards have not beaten its own by this many standard errors (paired by step: "
                                    "members share each step's prompts): the run you would get without a search is "
                                    "discarded on evidence, not on noise. Parents of clones are picked on the scores "
                                    "as measured. 0 (default): ranked like any member; with rungs of fewer than 3 "
                                    "steps per member (a real model on a small budget) protection keeps the default "
                                    "for good (benchmarks/README.md, HPO section). Needs fitness: train.")

    def build(self, population_size: int, seed: int):
        from evollm.hpo import TournamentSelection, TruncationSelection
        common = dict(population_size=population_size, fitness=self.fitness, window=self.window,
                      eval_loop=self.eval_loop, rand_seed=seed, protect_default=self.protect_default)
        try:
            if self.type == "tournament":
                return TournamentSelection(tournament_size=self.tournament_size, elitism=self.elitism, **common)
            return TruncationSelection(quantile=self.quantile, **common)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"hpo.selection: {e}") from e


@dataclass
class NarrowingSection(Section):
    """A population that narrows as the budget is spent (see :class:`evollm.hpo.narrowing.Narrowing`)."""

    at: list[float] = option([0.05, 0.1, 0.2], "Fractions of the budget (train.max_steps, and train.max_time when "
                             "set) at which the worst members are released; a cut waits for the first ranking at or "
                             "after its fraction (with held-out fitness: the next evaluation, so each rung lasts at "
                             "least train.evaluation_interval steps). Default: 8 -> 4 -> 2 -> 1 by about a fifth of the "
                             "budget, the best member alone after it (0.8-0.9 of a single run's steps; "
                             "benchmarks/README.md, HPO section); [] keeps the population whole.")
    keep: float = option(0.5, "Share of the members kept at each of `at` (rounded up).")
    min_size: int = option(1, "Never narrow below this many members. Below the selection's size (a tournament's "
                           "members) selection and mutation stop and the members left train on; 2 keeps evolving "
                           "to the end.")
    evaluate: bool = option(False, "With ranking on held-out fitness (hpo.selection.fitness: last or mean), a "
                            "fraction of `at` reached between two evaluations brings that interval's evaluation forward, "
                            "so the cut falls where `at` says (no extra evaluation); false (default): it waits for "
                            "the next train.evaluation_interval (measured alone: the same final scores on the game and "
                            "the relay, 0.03-0.05 lower on the arithmetic tasks, cut on scores a question or two apart).")

    incumbent: bool = option(False, "The default founder's lineage is the incumbent: at a cut, other members stay only "
                             "when they score strictly above it (and are among the best kept); the rest are released, "
                             "so the population may narrow faster than `keep` (never below `min_size`). With `evaluate: true`: "
                             "for starting values known to be good (measured: level with a single run at them on "
                             "the game, where the defaults lose 0.05; 0.03-0.04 lower where the default lr is far "
                             "off; the single run's score on SmolLM2, whose better rates show late).")

    revive: bool = option(True, "Keep the best member each cut releases as a reserve (parked: memory, no compute); when "
                          "the member training alone stalls (`patience` evaluations without a new best, at least "
                          "`no_signal` of its steps without a learning signal: every GRPO group's rewards equal), the reserve trains on "
                          "in its place, once per run, and the better of the two by held-out fitness is returned "
                          "(measured on SmolLM2, where a lone member can collapse onto a plateau: benchmarks/README.md).")
    revive_rate: str = option("between", "The learning rates the reserve trains on after a stall swap: `between` (the "
                              "geometric mean of its own and the stalled member's: between a rate that stalled and one "
                              "that lost the cut, for the half to two thirds of the budget left) or `own` (its founder's). "
                              "Measured on SmolLM2: +0.073 against the reserve at its own rate, 10 seeds "
                              "(benchmarks/README.md, HPO section).",
                              choices=("between", "own"))
    patience: int = option(3, "Evaluations without a new best fitness before a member whose steps carry no learning "
                           "signal counts as stalled (with `revive`).")
    no_signal: float = option(0.5, "Share of the member's steps over those `patience` evaluations that had no learning "
                              "signal (learn_path no_gradient) for a stall (with `revive`); 1.0: only a member none "
                              "of whose steps had one. For the stall a step whose samples all got the run's best reward "
                              "does not count (the member solves those prompts); for the anneal's rule every step "
                              "without signal counts.")
    rollback: bool = option(True, "When the member training alone falls away from the run's best evaluated state since the "
                            "last cut or stall swap (the mean of its last `patience` evaluations after it more than `decline` "
                            "below it), a copy of that state "
                            "(adapters, optimizer state, hyperparameters) trains on in its place with `rollback_lr` times the "
                            "lower of its and the fallen member's learning rates, at most `max_rollbacks` times; the best state is kept as with "
                            "train.keep_best. Only from a best state above the run's starting level by `decline_se` of its "
                            "standard errors: a fall from the start is the dip of learning (a score that first falls as the "
                            "warm start's answers give way, then climbs), nothing learnt to go back to. Why: the first cuts "
                            "favour the rate whose play improves fastest, often one that then falls back alone "
                            "(benchmarks/README.md, HPO section).")
    anneal: bool = option(True, "When the member training alone has `patience` evaluations without a new best since "
                          "it was last chosen or changed, its learning rates are multiplied by `anneal_lr` (not below "
                          "`anneal_floor`; only once its best is above the run's first evaluation, and not while at "
                          "least `no_signal` of its steps since had no learning signal: the stall swap's case), at most "
                          "`max_anneals` times: a learning rate reduced on a plateau, for the fast-rising rates the "
                          "first cuts keep. Measured against the library without it: the relay +0.011 (then level "
                          "with a single run), chain_calc +0.019, REINFORCE +0.015, tiny GRPO +0.011, the game +0.004; "
                          "on SmolLM2 it no longer fires where it cost 0.25-0.29 before the signal rule "
                          "(benchmarks/README.md, HPO section).")
    anneal_lr: float = option(0.5, "Factor on the learning rates at an anneal.")
    max_anneals: int = option(2, "Anneals per run at most.")
    anneal_share: float = option(0.1, "The share of the budget a plateau must last before an anneal, counted in "
                                 "evaluations at the rate the member training alone has been evaluated since it was chosen (at "
                                 "least `patience`; 0: `patience` alone). "
                                 "Why: with a time budget a faster machine makes more evaluations, and `patience` of "
                                 "them without a new best then come by chance during a slow rise (measured: "
                                 "benchmarks/README.md, HPO section, 2026-11-28 afternoon).")
    anneal_floor: str = option("start", "How low an anneal takes a learning rate: `start` not below the rate the run "
                               "started from (the default founder's), and a member at or below that rate is not "
                               "annealed, so only the faster rates the cuts kept come back toward it; `range` down to "
                               "the search range's lower end (which cost the game 0.044: its greedy score is flat "
                               "between jumps, and the anneal halved the starting rate too).", choices=("range", "start"))
    decline: float = option(0.1, "Fall below the best state's fitness, as a share of it, that triggers a roll-back.")
    decline_se: float = option(1.5, "Standard errors of the best state's evaluation that the fall must also exceed "
                                    "(0: the share `decline` alone), beyond the best state's luck (the expected "
                                    "maximum of as many normal draws as there were evaluations since the last cut).")
    rollback_lr: float = option(0.5, "Factor on the learning rates of a roll-back's copy (not below their search range).")
    max_rollbacks: int = option(2, "Roll-backs per run at most (0: none).")
    on_tie: str = option("cut", "When several fractions of `at` are due at one ranking and the deepest cut would fall "
                         "between equal scores: `cut` acts on all of them (the tie-break chooses); `one_rung` acts "
                         "on one (8 -> 4, not 8 -> 1) and leaves the rest for the next ranking, so the members the "
                         "tie-break kept are measured again first.", choices=("cut", "one_rung"))
    tie_se: float = option(0.0, "With `on_tie: one_rung`, scores closer than this many standard errors of their "
                           "difference count as tied too (0: equal scores only). For small validation sets, where the "
                           "first ranking's scores are mostly within noise of each other.")
    tiebreak: str = option("default_first", "What orders equal scores at a cut: `default_first` (the default "
                           "founder's lineage, then the mean training reward of the last 10 steps) or `reward` "
                           "(the training rewards alone).", choices=("default_first", "reward"))
    wait_se: float = option(0.0, "A cut waits until some member's held-out score is this many of its standard errors "
                            "above the run's starting level (the median of the first evaluation), or until `wait_until` "
                            "of the budget; every member trains on meanwhile, without selection (0: cuts act when due). "
                            "For evaluations that come before any member has learnt, whose ranking is noise. Measured "
                            "with 2 (benchmarks/README.md, HPO section): level overall, so off by default.")
    wait_until: float | None = option(None, "With `wait_se`: the fraction of the budget after which a due cut acts "
                                      "anyway (default: the last fraction of `at`).")
    pair_cut: bool = option(True, "A selection among the last two members, where the schedule goes on to one, is "
                            "that last cut: the loser is released and the winner trains alone from there, instead of "
                            "racing a mutated clone of itself to the next fraction of `at` (a ranking mostly within "
                            "noise, which halves the lineage's steps until then). On by default since 2026-12-07: with "
                            "the decay for actor-critic members, chain_calc's loss with it is gone, and over six tasks "
                            "where it acts it is level or ahead (benchmarks/README.md, \"The last pair again\"). "
                            "false: the race to the last cut.")
    slow_se: float = option(2.0, "At a cut, a member whose learning rate is below the run's starting one (the default "
                            "founder's) ranks below every faster member unless it scores above the best of them by "
                            "this many standard errors of their difference (paired over the same test items): the "
                            "first rankings, a few steps per member, favour slow rates that keep the warm start's "
                            "answers (0: off; measured: benchmarks/README.md, \"Slow rates keep their place only "
                            "on evidence\").")
    faster_se: float = option(2.0, "At a cut that leaves one member: when the best member it releases with a faster "
                              "learning rate than the member kept scored within this many standard errors of their "
                              "difference of it (paired over the same test items), the ranking could not tell the two "
                              "apart, and the member kept trains on at the rate between them (their geometric mean). "
                              "Only upward: early rankings favour slow rates already (short-horizon bias). On by default "
                              "since 2026-12-07 (at 2, beside the library without it: REINFORCE arithmetic +0.039, level "
                              "or ahead on eight other tasks; benchmarks/README.md, \"A faster member within noise, at 2 "
                              "standard errors\"). 0: off.")

    decay: str = option("auto", "`cosine`: after the last cut the members left (the lone member) train at their "
                        "learning rates times a factor that falls along a half cosine, over the budget left, to the rate "
                        "the run started from (the default founder's; a member at or below it keeps its rate): the rate "
                        "the cuts found, then the starting one, as a schedule instead of a step. Scales the optimizer's "
                        "groups (a PPO critic's too), like train.lr_cooldown, and combines with it; replaces `anneal`, which "
                        "does not act while it is on. Without a default founder (algorithm.default_founder, or starting values "
                        "outside the search range) it falls to the range's lower end. `auto` (default): `cosine` for "
                        "members that learn a critic (LLMPPO, IPPO teams), `none` for the others (GRPO, REINFORCE): "
                        "side by side with the anneal, the decay lifted every actor-critic task measured and cost the "
                        "arithmetic tasks (benchmarks/README.md, \"The decay for actor-critic members\"). `none` keeps "
                        "the rates as they are (the anneal acts).",
                        choices=("auto", "none", "cosine"))
    lift: float = option(1.0, "A lone member the cuts left at or below the run's starting learning rate (the search "
                         "found nothing faster to keep) trains from the last cut at `lift` times its rates, falling "
                         "along a half cosine to its own rates at the end of the budget: a fast start that ends at the "
                         "rate the search kept. Scales the optimizer's groups like `decay`. 1 (default): off. Measured with 3: "
                         "the game with REINFORCE +0.029 +- 0.012 over the library (36 seeds), the task it came from, so "
                         "not yet a default (benchmarks/README.md, \"A lift for a lone member left at your starting rate\").")

    def build(self):
        """The :class:`~evollm.hpo.narrowing.Narrowing`, or ``None`` when ``at`` is empty."""
        if not self.at:
            return None
        from evollm.hpo.narrowing import Narrowing
        try:
            return Narrowing(at=self.at, keep=self.keep, min_size=self.min_size, evaluate=self.evaluate,
                             incumbent=self.incumbent, revive=self.revive, revive_rate=self.revive_rate,
                             patience=self.patience,
                             no_signal=self.no_signal, rollback=self.rollback, decline=self.decline,
                             rollback_lr=self.rollback_lr, max_rollbacks=self.max_rollbacks, decline_se=self.decline_se,
                             on_tie=self.on_tie, tiebreak=self.tiebreak, tie_se=self.tie_se, anneal=self.anneal,
                             anneal_lr=self.anneal_lr, max_anneals=self.max_anneals, anneal_share=self.anneal_share,
                             anneal_floor=self.anneal_floor, wait_se=self.wait_se, wait_until=self.wait_until, pair_cut=self.pair_cut,
                             decay=self.decay, slow_se=self.slow_se, faster_se=self.faster_se,
                             lift=self.lift)
        except ValueError as e:
            raise ConfigError(f"hpo.narrowing: {e}") from e

    def finalize(self) -> None:
        self.build()


@dataclass
class HPOSection(Section):
    """Evolutionary hyperparameter optimisation (used when train.evo_steps is set)."""

    hp_config: dict[str, ParamSection] = option({}, "Evolvable hyperparameters by name (any of the algorithm's "
                                                "mutable hyperparameters, or lora_rank); a name with no min/max "
                                                "({}) takes its default range. Not given and population_size > 1: "
                                                "the policy's learning rate (PPO: lr_actor; the critic keeps its "
                                                "default), log-uniform 1e-5..1e-3 (LoRA's range; "
                                                "evollm.hpo.defaults), unless set in algorithm.hyperparameters.")
    mutation: MutationSection = option(default_factory=MutationSection, help="Mutation settings.",
                                       when={"train.evo_steps": _evolving})
    selection: SelectionSection = option(default_factory=SelectionSection, help="Selection settings.",
                                         when={"train.evo_steps": _evolving})
    narrowing: NarrowingSection = option(default_factory=NarrowingSection, help="Narrowing of the population as "
                                         "the budget is spent (successive halving into PBT).")

    def parameters(self) -> dict:
        """``{name: RLParameter}`` of hp_config (default ranges filled in)."""
        return {name: spec.parameter(name) for name, spec in self.hp_config.items()}

    def search_space(self, population_size: int, evolvable, fixed):
        """hp_config (default ranges filled in), or, with several members and no hp_config given, the
        default space (:func:`evollm.hpo.defaults.default_hp_config` over ``evolvable()``, less the names
        in ``fixed``: values the user set); ``None`` when nothing evolves."""
        from evollm.hpo import HyperparameterConfig
        from evollm.hpo.defaults import default_hp_config

        params = self.parameters()
        if params:
            return HyperparameterConfig(**params)
        if self.given("hp_config") or population_size < 2:
            return None
        return default_hp_config(evolvable(), fixed=fixed)


def check_ranges(space, agent_config) -> None:
    """Every bound (or choice) of an evolvable hyperparameter of ``space`` (a HyperparameterConfig or
    ``None``) must be a valid value of it for ``agent_config``."""
    for name, spec in (space or {}).items():
        bounds = {"choices": spec.choices} if spec.is_categorical else {"min": [spec.min], "max": [spec.max]}
        for key, values in bounds.items():
            for value in values:
                value = int(value) if spec.dtype_name == "int" else value
                if name == "lora_rank":
                    ok, why = isinstance(value, (int, float)) and value >= 1, "a rank must be >= 1"
                else:
                    trial = dataclasses.replace(agent_config)
                    setattr(trial, name, value)
                    try:
                        trial.validate()
                        ok, why = True, ""
                    except (TypeError, ValueError) as e:
                        ok, why = False, str(e)
                if not ok:
                    raise ConfigError(f"hpo.hp_config.{name}.{key}={value!r} is not a valid {name}: {why}")
