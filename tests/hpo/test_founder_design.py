"""Founders spread over the search space: the centred Latin hypercube ("lhs") and the quantile map."""
from __future__ import annotations

import math

import numpy as np
import pytest

from evollm.hpo import HyperparameterConfig, RLParameter
from evollm.hpo.founders import founder_hyperparameters
from evollm.hpo.optuna_utils import initial_population_hyperparameters, latin_hypercube

LR = RLParameter(min=1e-5, max=1e-3, log=True)


def test_quantiles_by_hand():
    assert math.isclose(LR.from_unit(0.5), 1e-4)                       # the middle of two decades
    assert math.isclose(LR.from_unit(0.25), 10 ** -4.5)
    assert LR.from_unit(0.0) == 1e-5 and LR.from_unit(1.0) <= 1e-3
    assert RLParameter(min=0.0, max=2.0).from_unit(0.75) == 1.5
    ints = RLParameter(min=2, max=5, dtype=int)                        # 4 values, a quarter each
    assert [ints.from_unit(u) for u in (0.0, 0.24, 0.25, 0.74, 0.99, 1.0)] == [2, 2, 3, 4, 5, 5]
    ranks = RLParameter(min=4, max=15, dtype=int, log=True)            # log-uniform over [4, 16), floored
    assert [ranks.from_unit(u) for u in (0.0, 0.5, 0.999)] == [4, 8, 15]
    algo = RLParameter(choices=["grpo", "gspo", "cispo"])
    assert [algo.from_unit(u) for u in (0.0, 0.34, 0.67, 1.0)] == ["grpo", "gspo", "cispo", "cispo"]


def test_from_unit_of_a_uniform_is_a_draw_like_sample():
    """The quantile map is the distribution sample() draws from: the same bins, the same frequencies."""
    rng = np.random.default_rng(0)
    via_unit = np.log10([LR.from_unit(u) for u in rng.uniform(size=4000)])
    direct = np.log10([LR.sample(rng) for _ in range(4000)])
    for values in (via_unit, direct):                                  # log-uniform: a quarter per half decade
        counts = np.histogram(values, bins=[-5, -4.5, -4, -3.5, -3])[0] / len(values)
        assert np.all(np.abs(counts - 0.25) < 0.03), counts


def test_latin_hypercube_takes_every_stratum_once():
    points = latin_hypercube(4, 3, seed=1)
    assert points.shape == (4, 3)
    for column in points.T:                                            # the middles of 4 strata, each once
        assert sorted(column) == pytest.approx([0.125, 0.375, 0.625, 0.875])
    assert latin_hypercube(0, 2).shape == (0, 2)
    assert np.array_equal(latin_hypercube(5, 2, seed=3), latin_hypercube(5, 2, seed=3))


def test_three_lhs_founders_span_two_decades():
    """One founder in each third of log10 [1e-5, 1e-3], whatever the seed (QMC's first three may cluster)."""
    space = HyperparameterConfig(lr=LR)
    for seed in range(5):
        lrs = sorted(d["lr"] for d in initial_population_hyperparameters(space, 3, sampler="lhs", seed=seed))
        assert lrs == pytest.approx([10 ** (-5 + 2 / 6), 1e-4, 10 ** (-5 + 10 / 6)])


def test_lhs_founders_with_the_default_first_and_a_fixed_value():
    space = HyperparameterConfig(lr=LR, beta=RLParameter(min=0.0, max=0.4))
    founders = founder_hyperparameters(5, space, init_sampler="lhs", fixed={"beta": 0.1}, seed=0)
    assert founders[0] == {}                                           # the default founder is not drawn
    assert all(set(d) == {"lr"} for d in founders[1:])                 # the user's beta is kept for all
    lrs = sorted(math.log10(d["lr"]) for d in founders[1:])
    assert lrs == pytest.approx([-5 + 2 * (2 * i + 1) / 8 for i in range(4)])


def test_the_config_takes_lhs_and_names_the_valid_samplers():
    from evollm.config import RunConfig
    from evollm.config.schema import ConfigError
    space = {"hpo": {"hp_config": {"lr": {"min": 1e-5, "max": 1e-3, "log": True}}}, "train": {"evo_steps": 10}}
    cfg = RunConfig.from_dict({"algorithm": {"name": "GRPO", "population_size": 4, "init_sampler": "lhs"}, **space})
    assert cfg.algorithm.init_sampler == "lhs"
    with pytest.raises(ConfigError, match="'lhs', 'qmc', 'random', 'tpe'"):
        RunConfig.from_dict({"algorithm": {"name": "GRPO", "population_size": 4, "init_sampler": "halton"}, **space})
