"""What every population member is, whatever it learns with.

:class:`Member` is the one base of :class:`~evollm.algorithms.base.LLMAgent` (one member = its adapters +
optimizer + config) and :class:`~evollm.algorithms.ippo.IPPOTeam` (one member = a team of agents). It
holds what the population engine and the loop need from a member (the
:class:`~evollm.hpo.protocol.EvolvableAgent` protocol), written once:

* identity: ``index``, unique on the shared base and never reused, taken from the base's ``ID_SPACE``;
* history: ``fitness`` (recorded only through :meth:`record_fitness`), ``scores`` (training rewards),
  ``steps``, ``parent_index``, ``last_mutation``;
* mutation hooks (inherited by clones), clone bookkeeping (:meth:`_start_clone`), :meth:`release`;
* the quarantine flag: :meth:`quarantine` sets it when the member's loss or parameters turn
  non-finite; a quarantined member no longer samples, learns or is evaluated, and clones never
  inherit the flag;
* founders: :meth:`population` builds ``size`` members with their first hyperparameters (drawn from
  ``hp_config`` or given).

Subclasses implement the member's own parts: ``__init__`` (calling :meth:`_init_member`), ``clone``
(copying their tensors, then :meth:`_start_clone`), ``_free`` (what :meth:`release` gives back),
``trainable_parameters``, the hyperparameter get/set and checkpoints.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch


class MutationHookError(ValueError):
    """A user's mutation hook raised (the message names the hook and the member)."""


class Member:
    """Base of every population member (see the module docstring)."""

    #: the id space of the shared base this kind of member takes its ``index`` from
    ID_SPACE: ClassVar[str] = "member"
    #: whether the member learns a critic (a value function) beside its policy: actor-critic members (LLMPPO,
    #: IPPO teams) get ``hpo.narrowing.decay: auto``'s schedule
    HAS_CRITIC: ClassVar[bool] = False

    index: int
    hp_config: Any
    #: fitness after every evaluation (higher is better); appended only by :meth:`record_fitness`
    fitness: list[float]
    #: mean training reward of every step
    scores: list[float]
    #: the member this one was cloned from (``None``: a founder)
    parent_index: int | None = None
    steps: int = 0
    last_mutation: Any = None
    released: bool = False
    #: set by :meth:`quarantine` (a non-finite loss or parameter); never inherited by a clone
    quarantined: bool = False
    #: why and when the member was quarantined
    quarantine_reason: str | None = None

    # ------------------------------------------------------------------ construction
    def _init_member(self, hp_config) -> None:
        """The member's population state; called by a subclass ``__init__`` once ``index`` is known."""
        self.hp_config = hp_config
        if hp_config is not None and hasattr(hp_config, "validate_for"):
            hp_config.validate_for(self)
        self.fitness, self.scores = [], []
        self.parent_index = None
        self.steps = 0
        self.mutation_hooks: list[Callable] = []
        self.last_mutation = None
        self.released = False
        self.default_founder = False  # the founder that kept the starting values (see population)
        self.lr_factor = 1.0  # the factor on its rates in the optimizer's groups (train.lr_cooldown)
        self.quarantined, self.quarantine_reason = False, None

    @classmethod
    def population(cls, size: int, actor_network: torch.nn.Module | None = None, hp_config=None,
                   init_hyperparameters=None, init_sampler: str | None = "stratified", fixed: dict | None = None,
                   default_founder: bool = True, **kwargs) -> list:
        """``size`` members on ONE shared base (``cls(actor_network, hp_config=hp_config, **kwargs)`` each).

        With an ``hp_config`` the founders' hyperparameters are drawn from it with ``init_sampler``
        (``"stratified"``, the default: one founder at a random place in each n-th of every range, the
        default founder counting as one; ``"qmc"``: scrambled Sobol; ``"lhs"``, ``"random"``, ``"tpe"``,
        an Optuna sampler, or
        ``None`` for identical founders), seeded with ``seed``; a value the caller passes as a keyword
        (e.g. ``lr=1e-3``), or names in ``fixed``, is kept for every founder. With ``default_founder``
        (the default) the first member keeps the starting values instead of a draw when they lie inside
        ``hp_config``'s ranges: the population then holds the run you would get without a search.
        ``init_hyperparameters``: an explicit list of per-member dicts instead (e.g. from
        :func:`evollm.hpo.initial_population_hyperparameters`)."""
        from ..hpo.founders import founder_hyperparameters

        actor_network = cls._founders_base(actor_network, kwargs)
        if size < 1:
            raise ValueError(f"population size must be >= 1, got {size}")
        members = [cls(actor_network, hp_config=hp_config, **kwargs)]
        # the starting values found a member only where they lie inside the search space (a range the user
        # wrote that leaves them out says where to search)
        default_founder = bool(default_founder and hp_config is not None and all(
            param.contains(members[0].get_hyperparameter(name)) for name, param in hp_config.items()))
        init = founder_hyperparameters(size, hp_config, init_hyperparameters, init_sampler,
                                       fixed=kwargs if fixed is None else fixed, seed=kwargs.get("seed", 0),
                                       default_founder=default_founder,
                                       defaults=None if hp_config is None else
                                       {n: members[0].get_hyperparameter(n) for n in hp_config})
        members += [cls(actor_network, hp_config=hp_config, **kwargs) for _ in init[1:]]
        for member, hps in zip(members, init):
            for name, value in hps.items():
                member.set_hyperparameter(name, value)
        # the member a selection's protect_default looks after: the first, when the others were drawn
        members[0].default_founder = bool(default_founder and init_hyperparameters is None
                                          and init_sampler is not None and size >= 2)
        return members

    @classmethod
    def _founders_base(cls, actor_network, kwargs: dict):
        """Hook: the base model the founders share (a subclass may load it from a keyword in ``kwargs``)."""
        if actor_network is None:
            raise TypeError(f"{cls.__name__}.population needs the base model (actor_network)")
        return actor_network

    # ------------------------------------------------------------------ history
    def record_fitness(self, value: float) -> None:
        """Append one evaluation's fitness (the only place a member's fitness history grows)."""
        self.fitness.append(float(value))

    def record_score(self, value: float) -> None:
        """Append one step's mean training reward."""
        self.scores.append(float(value))

    def quarantine(self, reason: str) -> None:
        """Stop this member: it no longer samples, learns or is evaluated (its fitness is -inf), and it is
        replaced by a clone of a healthy member at the next selection."""
        self.quarantined, self.quarantine_reason = True, reason

    # ------------------------------------------------------------------ mutation hooks
    def register_mutation_hook(self, hook: Callable) -> None:
        """``hook(member)`` runs after every mutation and clone; hooks are inherited by clones."""
        self.mutation_hooks.append(hook)

    def run_mutation_hooks(self) -> None:
        for hook in self.mutation_hooks:
            try:
                hook(self)
            except Exception as e:  # noqa: BLE001 - re-raised naming the hook and the member
                name = getattr(hook, "__qualname__", None) or type(hook).__name__
                raise MutationHookError(f"mutation hook {name} raised {type(e).__name__}: {e} on member "
                                        f"{self.index}") from e

    # ------------------------------------------------------------------ clones and release
    def _start_clone(self, new: "Member") -> "Member":
        """The population state of a fresh clone ``new`` of this member: an EMPTY fitness and score history
        (it has not been evaluated yet), ``parent_index`` this member's id, the same ``hp_config``, steps and
        hooks, no mutation yet, not released and never quarantined; a clone of the default founder's lineage
        stays in it (``default_founder``: a narrowing's tie-break keeps that lineage first)."""
        new.hp_config = self.hp_config
        new.default_founder = bool(getattr(self, "default_founder", False))
        new.fitness, new.scores, new.parent_index = [], [], self.index
        new.steps = self.steps
        new.mutation_hooks = list(self.mutation_hooks)
        new.last_mutation = None
        new.released = False
        new.quarantined, new.quarantine_reason = False, None
        return new

    def release(self) -> None:
        """Free this member's adapters and optimizer state (the shared base is untouched); idempotent."""
        if self.released:
            return
        self._free()
        self.released = True

    def _free(self) -> None:
        """What :meth:`release` gives back (a subclass's adapters, optimizers, engines)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ hyperparameters
    @classmethod
    def evolvable_names(cls, config=None) -> tuple[str, ...]:
        """Hyperparameter names a member of this class (with ``config``) can evolve."""
        raise NotImplementedError

    # ------------------------------------------------------------------ parameters
    def trainable_parameters(self) -> list[torch.Tensor]:
        """Every tensor the member trains (checked for non-finite values after each learn step)."""
        raise NotImplementedError
