"""Model-based explore (PB2-style): propose a clone's hyperparameters from a model of the population's
own history instead of a random perturbation.

Every selection, each member contributes one observation: the hyperparameters it trained with since
the previous selection, and how much its ranking score improved over that interval (a clone's
baseline is its parent's score when it was cloned). :func:`propose` fits an Optuna sampler (a Gaussian
process, ``"gp"``, as PB2 does; or ``"tpe"``) on the most recent observations (a window of
``history`` keeps the model local in time, as PB2's time-varying kernel does) and asks it for the
clone's new values, all within the ``hp_config`` ranges. With fewer than ``startup`` observations the
sampler draws at random (over the whole range).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import numpy as np
import optuna

from evollm.hpo.optuna_utils import parameter_to_distribution

MODEL_SAMPLERS: tuple[str, ...] = ("gp", "tpe")


def _sampler(kind: str, seed: int, startup: int) -> optuna.samplers.BaseSampler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if kind == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup, deterministic_objective=False)
        if kind == "tpe":
            return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)
    raise ValueError(f"model sampler must be one of {list(MODEL_SAMPLERS)}, got {kind!r}")


def propose(hp_config, names: Sequence[str], observations: Sequence[dict], rng: np.random.Generator,
            kind: str = "gp", startup: int = 4) -> dict[str, Any]:
    """New values of ``names`` (each within its ``hp_config`` range) from a sampler fitted on
    ``observations`` (dicts ``{"params": {name: value}, "improvement": float}``; observations that
    lack one of ``names`` or have a non-finite improvement are left out; values out of range are
    clamped into it). The sampler's seed comes from ``rng``, so the proposal is reproducible."""
    distributions = {n: parameter_to_distribution(hp_config[n]) for n in names}
    seed = int(rng.integers(2**31 - 1))
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        study = optuna.create_study(sampler=_sampler(kind, seed, startup), direction="maximize")
        for obs in observations:
            params = obs.get("params", {})
            value = obs.get("improvement")
            if value is None or not math.isfinite(value) or any(n not in params for n in names):
                continue
            clamped = {n: hp_config[n].clamp(params[n]) for n in names}
            if any(not distributions[n]._contains(distributions[n].to_internal_repr(v)) for n, v in clamped.items()):
                continue
            study.add_trial(optuna.trial.create_trial(params=clamped, distributions=distributions,
                                                      value=float(value)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial = study.ask(distributions)
        return {n: hp_config[n].clamp(_plain(trial.params[n])) for n in names}
    finally:
        optuna.logging.set_verbosity(verbosity)


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value
