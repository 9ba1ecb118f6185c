"""Seeding an initial population's hyperparameters, optionally with Optuna.

A stratified design (one founder in each n-th of every range, the default), a
quasi-random (``QMCSampler``) or a model-based (``TPESampler``) sampler covers
the search space more evenly than independent uniform draws, which matters for
the small populations that fit on one shared base model.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Union

import numpy as np
import optuna
from optuna.distributions import (BaseDistribution, CategoricalDistribution,
                                  FloatDistribution, IntDistribution)
from scipy.stats import qmc

from evollm.hpo.parameters import HyperparameterConfig, RLParameter

_SAMPLERS_BY_NAME = {
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed),
    "qmc": lambda seed: optuna.samplers.QMCSampler(seed=seed, scramble=True),
}


LHS = "lhs"
STRATIFIED = "stratified"
#: every sampler a name gives: the centred and the jittered Latin hypercube, and Optuna's
SAMPLER_NAMES = (LHS, STRATIFIED, *sorted(_SAMPLERS_BY_NAME))


def latin_hypercube(n: int, d: int, seed: Optional[int] = None, centred: bool = True,
                    taken: Optional[Sequence[float]] = None) -> np.ndarray:
    """``n`` points of a Latin hypercube in ``[0, 1)^d``: each coordinate falls once in each of the n
    equal strata ``[i/n, (i+1)/n)``, paired across coordinates at random. Centred (the default), each
    takes the stratum's middle; else (jittered) a uniform place inside it.

    ``taken`` (a point of ``d`` coordinates that is already in the design, e.g. the founder that keeps
    the default values): the strata are then ``n + 1`` per coordinate, and the ``n`` points fill all
    of them but the one ``taken`` lies in, so together they still hold one point per stratum.

    With a few founders this is what spreads them over a range: one in each n-th of it, none two in
    a row (a scrambled Sobol sequence's first 3 points in 1-D can fall in one fifth of the range, as
    7.4e-5, 8.2e-5 and 1.0e-4 in 1e-5..1e-3 do for one seed). Centred, the founders of a 1-D space are
    the same for every seed; jittered, each seed draws its own, still one per stratum.

    >>> latin_hypercube(3, 1, taken=[0.3]).ravel().tolist()   # 4 strata, the second one taken
    [0.125, 0.625, 0.875]
    """
    if n == 0:
        return np.zeros((0, d))
    if taken is None:
        return qmc.LatinHypercube(d=d, scramble=not centred, rng=np.random.default_rng(seed)).random(n)
    if len(taken) != d:
        raise ValueError(f"taken has {len(taken)} coordinates for {d} dimensions")
    rng, strata = np.random.default_rng(seed), n + 1
    columns = []
    for u in taken:
        free = np.array([i for i in range(strata) if i != min(int(u * strata), n)])
        offset = np.full(n, 0.5) if centred else rng.uniform(size=n)
        columns.append((free + offset) / strata)
    order = [np.arange(n)] + [rng.permutation(n) for _ in range(d - 1)]  # pair the columns at random
    return np.stack([col[idx] for col, idx in zip(columns, order)], axis=1)


def _sampler_by_name(name: str, seed: Optional[int]) -> optuna.samplers.BaseSampler:
    """Build a sampler from its short name (experimental-API warnings silenced)."""
    try:
        factory = _SAMPLERS_BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(f"unknown sampler {name!r}; "
                         f"use one of {list(SAMPLER_NAMES)} or a sampler instance"
                         ) from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return factory(seed)


def parameter_to_distribution(param: RLParameter) -> BaseDistribution:
    """Optuna distribution matching one :class:`RLParameter`."""
    if param.is_categorical:
        return CategoricalDistribution(list(param.choices))
    if param.dtype is int:
        return IntDistribution(int(param.min), int(param.max), log=param.log)
    return FloatDistribution(float(param.min), float(param.max), log=param.log)


def hp_config_to_distributions(hp_config: HyperparameterConfig) -> dict[str, BaseDistribution]:
    """One Optuna distribution per parameter of ``hp_config`` (same order)."""
    return {name: parameter_to_distribution(p) for name, p in hp_config.items()}


def _to_python(value: Any) -> Any:
    """Turn numpy scalars into plain Python values."""
    return value.item() if isinstance(value, np.generic) else value


def initial_population_hyperparameters(
    hp_config: HyperparameterConfig,
    n: int,
    sampler: Union[optuna.samplers.BaseSampler, str, None] = None,
    seed: Optional[int] = None,
    taken: Optional[dict[str, Any]] = None,
) -> list[dict[str, Any]]:
    """Draw hyperparameters for ``n`` initial agents.

    Args:
        hp_config: the evolvable parameters.
        n: number of agents.
        sampler: ``None`` draws each value independently with
            :meth:`RLParameter.sample`; an Optuna sampler instance (e.g.
            ``QMCSampler(seed=0)``) draws the ``n`` points through an in-memory
            study; the names ``"random"``, ``"tpe"`` and ``"qmc"`` (scrambled
            Sobol) build that sampler with ``seed``; ``"stratified"`` takes the
            points of the jittered :func:`latin_hypercube` (one at a random place
            in each n-th of every range; the default of a population's founders),
            ``"lhs"`` those of the centred one (the strata's middles).
        seed: seed for ``sampler=None`` or a sampler given by name; a sampler
            instance carries its own seed.
        taken: values (one per parameter) of an agent that is not drawn, e.g. the
            founder that keeps the defaults: ``"lhs"`` and ``"stratified"`` then
            place the ``n`` draws in the strata it leaves free (see
            :func:`latin_hypercube`); the other samplers ignore it.

    Returns:
        ``n`` dicts name -> value (ints are ``int``, floats ``float``,
        categorical values taken from ``choices``), all within bounds.

    Trials are completed with a constant objective value, since no fitness is
    known yet; quasi-random samplers are unaffected by it and TPE then behaves
    like a random sampler. With ``QMCSampler`` the first point is drawn at
    random (Optuna infers the search space from it) and the following ones
    follow the low-discrepancy sequence; an unscrambled sequence starts at the
    lower corner of the space, hence ``scramble=True`` for ``"qmc"``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if sampler is None:
        rng = np.random.default_rng(seed)
        return [hp_config.sample(rng) for _ in range(n)]
    if isinstance(sampler, str) and sampler.lower() in (LHS, STRATIFIED):
        points = latin_hypercube(n, len(hp_config), seed, centred=sampler.lower() == LHS,
                                 taken=None if taken is None else hp_config.to_unit(taken))
        return [hp_config.from_unit(point) for point in points]
    if isinstance(sampler, str):
        sampler = _sampler_by_name(sampler, seed)
    distributions = hp_config_to_distributions(hp_config)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        study = optuna.create_study(sampler=sampler, direction="maximize")
        draws = []
        for _ in range(n):
            trial = study.ask(distributions)
            params = {name: _to_python(trial.params[name]) for name in distributions}
            study.tell(trial, 0.0)
            draws.append(params)
    finally:
        optuna.logging.set_verbosity(verbosity)
    return [{name: hp_config[name].clamp(value) for name, value in d.items()} for d in draws]


def population_to_study(lineage, report, hp_config: HyperparameterConfig, study_name: str,
                        storage: Optional[str] = None, direction: str = "maximize") -> optuna.Study:
    """One completed trial per member lineage segment (a member's life with one set of
    hyperparameters): its ``hp_config`` values as params, its best fitness as the value.

    Values outside a parameter's bounds (e.g. a founder's hand-set value) are clamped into them so
    the distributions stay valid; the raw value is kept as a user attribute.
    """
    distributions = hp_config_to_distributions(hp_config)
    study = optuna.create_study(study_name=study_name, storage=storage, direction=direction,
                                load_if_exists=False)
    for birth in lineage.to_dict("records"):
        rows = report[report["member"] == birth["member"]]
        if rows.empty:
            continue
        params, raw = {}, {}
        for name, param in hp_config.items():
            value = birth.get(f"hp_{name}")
            if value is None or (isinstance(value, float) and value != value):
                break
            raw[name] = _to_python(value)
            params[name] = param.clamp(int(round(value)) if param.dtype is int and not param.is_categorical
                                       else _to_python(value))
        else:
            trial = optuna.trial.create_trial(
                params=params, distributions=distributions, value=float(rows["fitness"].max()),
                user_attrs={"member": int(birth["member"]), "generation": int(birth["generation"]),
                            "parent": None if birth["parent"] is None or birth["parent"] != birth["parent"]
                            else int(birth["parent"]),
                            "mutation": birth["mutation"], "raw_params": raw,
                            "evaluations": int(len(rows)), "last_fitness": float(rows["fitness"].iloc[-1])})
            study.add_trial(trial)
    return study
