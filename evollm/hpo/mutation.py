"""Mutation of a population's hyperparameters and adapter ranks.

:class:`Mutations` draws one mutation kind per agent: ``"none"``, ``"rl_hp"``
(one hyperparameter from the agent's ``hp_config``, other than ``lora_rank``,
is perturbed or resampled) or ``"lora_rank"`` (the adapters are resized).
All random decisions come from one ``numpy.random.Generator`` seeded with
``rand_seed``, so the same seed gives the same sequence of mutations.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

from evollm.hpo.compat import (NETWORK_MUTATIONS, agilerl_positional, check_agilerl_mutation_options,
                               check_agilerl_values, network_mutation)
from evollm.hpo.model_explore import MODEL_SAMPLERS, propose
from evollm.hpo.parameters import LORA_RANK
from evollm.hpo.protocol import MutationRecord

KINDS: tuple[str, ...] = ("none", "rl_hp", "lora_rank")


class Mutations:
    """Applies random mutations to agents in place.

    Args:
        no_mutation: relative probability of leaving an agent unchanged.
        rl_hp: relative probability of mutating one RL hyperparameter.
        lora_rank: relative probability of resizing the adapters; only applies
            to agents whose ``hp_config`` contains ``lora_rank``.
        explore_prob: probability that a mutation resamples the value from its
            prior (uniform or log-uniform over its whole range) instead of
            perturbing it (PBT's "resample probability").
        rand_seed: seed of the generator behind every random decision.
        perturb: ``"one"`` (default) mutates one randomly chosen RL
            hyperparameter per ``rl_hp`` mutation; ``"all"`` perturbs every RL
            hyperparameter of the agent's ``hp_config`` at once (PBT's explore
            step).
        resample_prob: PBT name of ``explore_prob``; when given it wins.
        mutate_elite: also mutate the elite kept by selection (off by default:
            the elite stays exactly the evaluated member it was).
        model_prob: probability that an ``rl_hp`` mutation takes ALL the agent's
            RL hyperparameters from a model fitted on the population's own
            history (PB2-style, :mod:`evollm.hpo.model_explore`) instead of
            perturbing or resampling them. The training loop feeds the history
            through :meth:`observe` at every selection.
        model_sampler: ``"gp"`` (Optuna's GPSampler, as PB2) or ``"tpe"``.
        model_history: most recent observations the model is fitted on.
        **agilerl_options: AgileRL's ``architecture``, ``new_layer_prob``, ``parameters``,
            ``activation`` (must be 0: networks do not mutate here), ``mutation_sd``, ``device``,
            ``accelerator`` (no effect); see :mod:`evollm.hpo.compat`.

    Every recorded mutation changes a value: :meth:`RLParameter.mutate` always
    moves an in-range value, and a mutation that cannot (a range with a single
    value) is recorded as ``"none"``.

    Probabilities are normalised. For each agent, the mass of a kind that
    cannot apply (``lora_rank`` not in its config, no RL hyperparameter in
    its config, no config at all) is dropped and the rest renormalised; when
    nothing is left the agent is not mutated.
    """

    def __init__(self, no_mutation: float = 0.4, rl_hp: float = 0.6, *agilerl_args: Any,
                 lora_rank: float = 0.0, explore_prob: float = 0.0,
                 rand_seed: Optional[int] = None, perturb: str = "one",
                 resample_prob: Optional[float] = None, mutate_elite: bool = False,
                 model_prob: float = 0.0, model_sampler: str = "gp", model_history: int = 64,
                 **agilerl_options: Any) -> None:
        if agilerl_args:  # AgileRL's positional order: (no_mutation, architecture, new_layer_prob, ...)
            given = agilerl_positional((no_mutation, rl_hp) + agilerl_args)
            no_mutation, rl_hp = given.pop("no_mutation"), given.pop("rl_hp", 0.0)
            rand_seed = given.pop("rand_seed", rand_seed)
            mutate_elite = given.pop("mutate_elite", mutate_elite)
            agilerl_options = {**given, **agilerl_options}
        check_agilerl_values({"no_mutation": no_mutation, "rl_hp": rl_hp, **agilerl_options})
        network = check_agilerl_mutation_options(agilerl_options)
        self._agilerl_names(no_mutation, rl_hp, mutate_elite, agilerl_options)
        if resample_prob is not None:
            explore_prob = resample_prob
        if perturb not in ("one", "all"):
            raise ValueError(f"Mutations.perturb must be 'one' or 'all', got {perturb!r}")
        probs = {"no_mutation": no_mutation, "rl_hp": rl_hp, "lora_rank": lora_rank}
        for name, p in probs.items():
            if not np.isfinite(p) or p < 0:
                raise ValueError(f"Mutations.{name} must be a finite probability >= 0, got {p!r}")
        total = sum(probs.values()) + sum(network.values())
        if total <= 0:
            raise ValueError("Mutations: no_mutation, rl_hp and lora_rank are all zero; "
                             "at least one must be > 0")
        if not 0.0 <= explore_prob <= 1.0:
            raise ValueError(f"Mutations.explore_prob must be in [0, 1], got {explore_prob!r}")
        if not 0.0 <= model_prob <= 1.0:
            raise ValueError(f"Mutations.model_prob must be in [0, 1], got {model_prob!r}")
        if model_sampler not in MODEL_SAMPLERS:
            raise ValueError(f"Mutations.model_sampler must be one of {list(MODEL_SAMPLERS)}, got {model_sampler!r}")
        if int(model_history) < 2:
            raise ValueError(f"Mutations.model_history must be >= 2, got {model_history!r}")
        self.model_prob = float(model_prob)
        self.model_sampler = model_sampler
        self.model_history = int(model_history)
        self.observations: list[dict] = []  # {"params", "improvement", "member"}: the model's data
        self._baselines: dict[int, float] = {}  # member id -> its score at the last observation
        self.no_mutation = no_mutation / total
        self.rl_hp = rl_hp / total
        self.lora_rank = lora_rank / total
        self.network = {k: v / total for k, v in network.items()}
        self.explore_prob = float(explore_prob)
        self.perturb = perturb
        self.mutate_elite = bool(mutate_elite)
        self.rand_seed = rand_seed
        self.rng = np.random.default_rng(rand_seed)

    def _agilerl_names(self, no_mutation, rl_hp, mutate_elite, options: dict) -> None:
        """AgileRL's attribute names, holding the values as given."""
        self.no_mut, self.rl_hp_mut, self.mutation_sd = no_mutation, rl_hp, options.get("mutation_sd", 0.1)
        self.architecture_mut, self.new_layer_prob = options.get("architecture", 0), options.get("new_layer_prob", 0)
        self.parameters_mut, self.activation_mut = options.get("parameters", 0), options.get("activation", 0)
        self.activation_selection = options.get("activation_selection")
        self.device, self.accelerator = options.get("device", "cpu"), options.get("accelerator")

    def activation_mutation(self, agent: Any) -> Any:
        """AgileRL's activation mutation: not for LLM members (a warning; the member is left unchanged)."""
        agent.last_mutation = network_mutation("activation")
        return agent

    def probabilities_for(self, agent: Any, pre_training_mut: bool = False) -> dict[str, float]:
        """Normalised probability of each kind (``"none"``, ``"rl_hp"``,
        ``"lora_rank"``) for ``agent``, after dropping kinds that cannot apply.

        With ``pre_training_mut`` the ``"none"`` mass is dropped too, so every
        agent that has something to evolve is mutated (useful to diversify a
        freshly created population).
        """
        config = getattr(agent, "hp_config", None)
        weights = {"none": self.no_mutation, "rl_hp": self.rl_hp, "lora_rank": self.lora_rank}
        if config is None or not config.rl_hp_names():
            weights["rl_hp"] = 0.0
        if config is None or LORA_RANK not in config:
            weights["lora_rank"] = 0.0
        if pre_training_mut and weights["rl_hp"] + weights["lora_rank"] > 0:
            weights["none"] = 0.0
        total = sum(weights.values())
        if total <= 0:
            return {"none": 1.0, "rl_hp": 0.0, "lora_rank": 0.0}
        return {k: v / total for k, v in weights.items()}

    def mutation(self, population: Sequence[Any], pre_training_mut: bool = False) -> list:
        """Mutate every agent of ``population`` in place and return it as a list.

        Each agent gets ``agent.last_mutation`` (a :class:`MutationRecord`);
        ``agent.run_mutation_hooks()`` is called for each agent that was
        mutated (kind other than ``"none"``).
        """
        population = list(population)
        for agent in population:
            self.mutate_agent(agent, pre_training_mut=pre_training_mut)
        return population

    def mutate_agent(self, agent: Any, pre_training_mut: bool = False) -> MutationRecord:
        """Mutate one agent in place; returns (and sets) ``agent.last_mutation``."""
        config = getattr(agent, "hp_config", None)
        if config is not None:
            config.validate_for(agent)
        probs = self.probabilities_for(agent, pre_training_mut=pre_training_mut)
        net = sum(self.network.values())
        if net > 0:  # AgileRL's network kinds (see evollm.hpo.compat.network_mutation)
            kinds = KINDS + NETWORK_MUTATIONS
            p = [probs[k] * (1.0 - net) for k in KINDS] + [self.network[k] for k in NETWORK_MUTATIONS]
            kind = kinds[int(self.rng.choice(len(kinds), p=np.asarray(p) / sum(p)))]
        else:
            kind = KINDS[int(self.rng.choice(len(KINDS), p=[probs[k] for k in KINDS]))]
        if kind in NETWORK_MUTATIONS:
            record = network_mutation(kind)
        elif kind == "rl_hp":
            record = self._mutate_rl_hp(agent)
        elif kind == "lora_rank":
            record = self._mutate_lora_rank(agent)
        else:
            record = MutationRecord(kind="none")
        agent.last_mutation = record
        if record.kind != "none":
            agent.run_mutation_hooks()
        return record

    @property
    def resample_prob(self) -> float:
        """PBT name of :attr:`explore_prob`."""
        return self.explore_prob

    def observe(self, agents: Sequence[Any], scores: dict[int, float]) -> None:
        """Feed the model-based explore: for every agent with a finite ``scores[agent.index]`` (its
        ranking score at this selection), one observation of its current RL hyperparameters and the
        improvement of its score since the last observation (a clone's baseline is its parent's score
        at that time). Call it before mutating. Without ``model_prob`` nothing is kept."""
        if self.model_prob <= 0.0:
            return
        baselines = {}
        for agent in agents:
            score = scores.get(int(agent.index))
            if score is None or not math.isfinite(score):
                continue
            baselines[int(agent.index)] = float(score)
            base = self._baselines.get(int(agent.index))
            if base is None:
                base = self._baselines.get(getattr(agent, "parent_index", None))
            config = getattr(agent, "hp_config", None)
            if base is None or config is None or not config.rl_hp_names():
                continue
            params = {n: _plain(agent.get_hyperparameter(n)) for n in config.rl_hp_names()}
            self.observations.append({"params": params, "improvement": float(score) - base,
                                      "member": int(agent.index)})
        self._baselines = baselines
        self.observations = self.observations[-self.model_history:]

    def _mutate_from_model(self, agent: Any) -> MutationRecord:
        names = agent.hp_config.rl_hp_names()
        proposal = propose(agent.hp_config, names, self.observations, self.rng, self.model_sampler)
        old, new = {}, {}
        for name, value in proposal.items():
            before = agent.get_hyperparameter(name)
            if value == before:
                continue
            agent.set_hyperparameter(name, value)
            old[name], new[name] = before, value
        if not new:  # the model proposed the current values: perturb instead, so the clone moves
            return self._mutate_rl_hp(agent, model=False)
        if len(new) == 1:
            (name, value), = new.items()
            return MutationRecord(kind="rl_hp", name=name, old=old[name], new=value, explored=True)
        return MutationRecord(kind="rl_hp", name=",".join(new), old=old, new=new, explored=True)

    def _mutate_rl_hp(self, agent: Any, model: bool = True) -> MutationRecord:
        if model and self.model_prob > 0.0 and self.rng.random() < self.model_prob:
            return self._mutate_from_model(agent)
        names = agent.hp_config.rl_hp_names()
        if self.perturb == "one":
            names = (names[int(self.rng.integers(len(names)))],)
        old, new, explored = {}, {}, False
        for name in names:
            before = agent.get_hyperparameter(name)
            after, resampled = agent.hp_config[name].mutate(before, self.rng, self.explore_prob)
            if after == before:  # a single-value range: nothing can move
                continue
            agent.set_hyperparameter(name, after)
            old[name], new[name], explored = before, after, explored or resampled
        if not new:
            return MutationRecord(kind="none")
        if len(new) == 1:
            (name, value), = new.items()
            return MutationRecord(kind="rl_hp", name=name, old=old[name], new=value, explored=explored)
        return MutationRecord(kind="rl_hp", name=",".join(new), old=old, new=new, explored=explored)

    def _mutate_lora_rank(self, agent: Any) -> MutationRecord:
        param = agent.hp_config[LORA_RANK]
        old = int(agent.lora_rank)
        new, explored = param.mutate(old, self.rng, self.explore_prob)
        new = int(new)
        if new == old:  # a single-value range
            return MutationRecord(kind="none")
        agent.set_lora_rank(new)
        return MutationRecord(kind="lora_rank", name=LORA_RANK, old=old, new=new,
                              explored=explored)

    def state_dict(self) -> dict:
        """The generator's state (JSON), so a resumed run draws the same mutations."""
        return {"rng": self.rng.bit_generator.state, "observations": self.observations,
                "baselines": {str(k): v for k, v in self._baselines.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.observations = [dict(o) for o in state.get("observations", [])]
        self._baselines = {int(k): float(v) for k, v in state.get("baselines", {}).items()}

    def __repr__(self) -> str:
        return (f"Mutations(no_mutation={self.no_mutation:.3g}, rl_hp={self.rl_hp:.3g}, "
                f"lora_rank={self.lora_rank:.3g}, explore_prob={self.explore_prob}, "
                f"perturb={self.perturb!r}, mutate_elite={self.mutate_elite}, model_prob={self.model_prob}, "
                f"rand_seed={self.rand_seed})")


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return list(value) if isinstance(value, tuple) else value
