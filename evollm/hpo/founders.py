"""Founders of a population: whose hyperparameters a new population starts from."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from evollm.hpo.optuna_utils import initial_population_hyperparameters


def founder_hyperparameters(size: int, hp_config=None, init_hyperparameters: Optional[Sequence[dict]] = None,
                            init_sampler: Any = "stratified", fixed: Optional[dict] = None,
                            seed: Optional[int] = 0, default_founder: bool = True,
                            defaults: Optional[dict] = None) -> list[dict[str, Any]]:
    """One dict of hyperparameters per founder (an empty dict: the member keeps its starting values).

    ``init_hyperparameters`` (one dict per founder) is used as given. Otherwise, with an
    ``hp_config`` and a sampler, founders draw each of the config's parameters with
    ``init_sampler`` (``"stratified"`` by default), except the names in ``fixed`` (values the user set
    explicitly: they win and are the same for every founder). With ``default_founder`` (the
    default) the first founder is not drawn: it keeps the starting values (the ones the user set,
    else the algorithm's defaults), so the population always holds the run a user would get
    without a search, and the others cover the space. ``defaults`` (that founder's values of the
    config's parameters) lets the stratified samplers (``"stratified"``, ``"lhs"``) count it as one
    of the strata: the drawn founders fill the others. Without an ``hp_config`` or a sampler,
    founders are identical (empty dicts).
    """
    if init_hyperparameters is not None:
        if len(init_hyperparameters) != size:
            raise ValueError(f"init_hyperparameters has {len(init_hyperparameters)} entries for {size} members")
        return [dict(d) for d in init_hyperparameters]
    if hp_config is None or init_sampler is None or size < 2:
        return [{} for _ in range(size)]
    first = [{}] if default_founder else []
    taken = defaults if default_founder and defaults is not None else None
    draws = initial_population_hyperparameters(hp_config, size - len(first), sampler=init_sampler, seed=seed,
                                               taken=taken)
    fixed = set(fixed or ())
    return first + [{k: v for k, v in d.items() if k not in fixed} for d in draws]
