"""Founders spread over the search space: the centred and jittered Latin hypercubes ("lhs", "stratified"),
the strata left free by the default founder, and the quantile map and its inverse."""
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
    with pytest.raises(ConfigError, match="'lhs', 'stratified', 'qmc', 'random', 'tpe'"):
        RunConfig.from_dict({"algorithm": {"name": "GRPO", "population_size": 4, "init_sampler": "halton"}, **space})


@pytest.mark.parametrize("param", [LR, RLParameter(min=0.0, max=2.0), RLParameter(min=2, max=5, dtype=int),
                                   RLParameter(min=4, max=15, dtype=int, log=True),
                                   RLParameter(choices=["grpo", "gspo", "cispo"])])
def test_to_unit_inverts_from_unit(param):
    for u in np.linspace(0.0, 0.999, 37):
        value = param.from_unit(u)
        assert 0.0 <= param.to_unit(value) < 1.0
        back = param.from_unit(param.to_unit(value))
        assert back == value or math.isclose(back, value, rel_tol=1e-12)


def test_to_unit_by_hand():
    assert math.isclose(LR.to_unit(1e-4), 0.5) and LR.to_unit(1e-5) == 0.0
    assert math.isclose(LR.to_unit(5e-5), (math.log10(5e-5) + 5) / 2)
    assert RLParameter(min=2, max=5, dtype=int).to_unit(3) == 0.375      # the middle of the second quarter
    assert RLParameter(choices=["a", "b"]).to_unit("b") == 0.75


def test_jittered_strata_differ_by_seed_but_keep_one_per_stratum():
    columns = [latin_hypercube(5, 2, seed=s, centred=False) for s in range(4)]
    for points in columns:
        for column in points.T:
            assert sorted(int(u * 5) for u in column) == [0, 1, 2, 3, 4]
    assert not np.allclose(columns[0], columns[1])


def test_strata_left_free_by_a_taken_point():
    points = latin_hypercube(3, 1, taken=[0.3])                        # 4 strata; 0.3 lies in the second
    assert points.ravel().tolist() == [0.125, 0.625, 0.875]
    for seed in range(5):
        points = latin_hypercube(4, 2, seed=seed, centred=False, taken=[0.1, 0.99])
        assert sorted(int(u * 5) for u in points[:, 0]) == [1, 2, 3, 4]
        assert sorted(int(u * 5) for u in points[:, 1]) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="taken has 1 coordinates for 2"):
        latin_hypercube(2, 2, taken=[0.5])


def test_stratified_founders_fill_the_strata_the_default_founder_leaves():
    """4 founders over two decades: the default lr 5e-5 holds the second half-decade, and the three drawn
    founders fill the other three, whatever the seed: one always in [3.2e-4, 1e-3)."""
    space = HyperparameterConfig(lr=LR)
    seen = set()
    for seed in range(6):
        founders = founder_hyperparameters(4, space, init_sampler="stratified", seed=seed, defaults={"lr": 5e-5})
        assert founders[0] == {}
        strata = sorted(int((math.log10(d["lr"]) + 5) / 0.5) for d in founders[1:])
        assert strata == [0, 2, 3]
        seen.add(round(founders[1]["lr"], 9))
    assert len(seen) == 6                                                  # jittered: each seed its own
    # without the defaults (or without a default founder) the drawn founders fill n strata of their own
    plain = founder_hyperparameters(4, space, init_sampler="stratified", seed=0, default_founder=False)
    assert sorted(int((math.log10(d["lr"]) + 5) / 0.5) for d in plain) == [0, 1, 2, 3]


def test_a_population_counts_its_default_founder_as_a_stratum(tiny):
    """GRPO.population: the first member keeps lr 5e-5 and the three drawn founders fill the other strata;
    a range that leaves the default out draws all four in their own strata."""
    from conftest import make_grpo
    model, tok = tiny
    space = HyperparameterConfig(lr=LR)
    members = make_grpo(model, tok, n=4, hp_config=space, init_sampler="stratified", seed=3)
    lrs = [m.get_hyperparameter("lr") for m in members]
    assert lrs[0] == 5e-5 and members[0].default_founder
    assert sorted(int((math.log10(lr) + 5) / 0.5) for lr in lrs) == [0, 1, 2, 3]
    high = HyperparameterConfig(lr=RLParameter(min=1e-4, max=1e-2, log=True))
    members = make_grpo(model, tok, n=4, hp_config=high, init_sampler="stratified", seed=3)
    assert sorted(int((math.log10(m.get_hyperparameter("lr")) + 4) / 0.5) for m in members) == [0, 1, 2, 3]
