"""Tests of the evolutionary HPO engine with a stand-in agent."""
from __future__ import annotations

import copy
import json
import math
import warnings

import numpy as np
import optuna
import pytest

from evollm.hpo import (EvolvableAgent, HyperparameterConfig, MutationRecord, Mutations,
                        RLParameter, SelectionResult, TournamentSelection, TruncationSelection,
                        hp_config_to_distributions, initial_population_hyperparameters)


class FakeAgent:
    """Minimal implementation of the EvolvableAgent protocol."""

    MUTABLE = ("lr", "beta", "batch_size", "algo")

    def __init__(self, index, hp_config=None, hps=None, lora_rank=8, fitness=None):
        self.index = index
        self.hp_config = hp_config
        self.hps = dict(hps or {"lr": 1e-4, "beta": 0.1, "batch_size": 4, "algo": "grpo"})
        self.lora_rank = lora_rank
        self.fitness = list(fitness or [])
        self.hook_calls = 0
        self.rank_calls = []
        self.last_mutation = None

    def get_hyperparameter(self, name):
        return self.hps[name]

    def set_hyperparameter(self, name, value):
        if name not in self.MUTABLE:
            raise ValueError(f"cannot evolve {name}")
        self.hps[name] = value

    def mutable_hyperparameters(self):
        return self.MUTABLE

    def set_lora_rank(self, r):
        self.rank_calls.append(r)
        self.lora_rank = r

    def clone(self, index=None):
        c = FakeAgent(self.index if index is None else index, self.hp_config,
                      copy.deepcopy(self.hps), self.lora_rank, self.fitness)
        return c

    def run_mutation_hooks(self):
        self.hook_calls += 1


def full_config(**extra):
    return HyperparameterConfig(
        lr=RLParameter(1e-6, 1e-3, log=True),
        beta=RLParameter(0.0, 1.0),
        batch_size=RLParameter(1, 64, dtype=int),
        algo=RLParameter(choices=["grpo", "gspo", "cispo"]),
        **extra,
    )


def population(fitnesses, config=None):
    return [FakeAgent(i, config, fitness=f) for i, f in enumerate(fitnesses)]


# --- RLParameter ---------------------------------------------------------------------------

def test_protocol_is_satisfied_by_fake_agent():
    assert isinstance(FakeAgent(0), EvolvableAgent)


def test_float_grow_shrink_and_clamp():
    p = RLParameter(0.0, 1.0, grow_factor=1.5, shrink_factor=0.5)
    rng = np.random.default_rng(0)
    seen = {p.mutate(0.4, rng)[0] for _ in range(50)}
    assert sorted(seen) == pytest.approx([0.2, 0.6])
    assert all(isinstance(v, float) for v in seen)
    for _ in range(30):
        new, explored = p.mutate(0.9, rng)
        assert new in (pytest.approx(0.65), pytest.approx(0.45)) and not explored  # 1.35 reflects to 0.65


def test_log_sampling_within_bounds():
    p = RLParameter(1e-6, 1e-2, log=True)
    rng = np.random.default_rng(1)
    xs = np.array([p.sample(rng) for _ in range(2000)])
    assert xs.min() >= 1e-6 and xs.max() <= 1e-2
    # log-uniform: about half the mass below the geometric midpoint 1e-4
    assert 0.4 < np.mean(xs < 1e-4) < 0.6
    pi = RLParameter(2, 64, dtype=int, log=True)
    ints = [pi.sample(rng) for _ in range(500)]
    assert all(isinstance(v, int) and 2 <= v <= 64 for v in ints)


def test_int_rounding_and_always_moves():
    p = RLParameter(1, 100, dtype=int)  # grow 1.2, shrink 0.8
    rng = np.random.default_rng(0)
    assert {p.mutate(4, rng)[0] for _ in range(50)} == {5, 3}
    for v in (1, 2, 3, 50, 99):
        for _ in range(20):
            new, _ = p.mutate(v, rng)
            assert isinstance(new, int) and 1 <= new <= 100
            assert new != v
    # at a bound a step outwards is reflected back inside: the value always moves
    assert {p.mutate(100, rng)[0] for _ in range(50)} == {80}
    assert {p.mutate(1, rng)[0] for _ in range(50)} == {2}


def test_categorical_perturb_changes_and_explore():
    p = RLParameter(choices=["grpo", "gspo", "cispo"])
    rng = np.random.default_rng(0)
    for _ in range(50):
        new, explored = p.mutate("gspo", rng)
        assert new in p.choices and new != "gspo" and not explored
    assert {p.mutate("gspo", rng, explore_prob=1.0)[0] for _ in range(60)} == {"grpo", "cispo"}
    assert p.dtype_name == "categorical"


def test_explore_prob_one_resamples_within_bounds():
    rng = np.random.default_rng(3)
    for p, v in [(RLParameter(0.1, 0.3), 0.2), (RLParameter(2, 64, dtype=int), 8),
                 (RLParameter(1e-6, 1e-3, log=True), 1e-4)]:
        vals = []
        for _ in range(100):
            new, explored = p.mutate(v, rng, explore_prob=1.0)
            assert explored and p.min <= new <= p.max
            vals.append(new)
        assert len(set(vals)) > 10


@pytest.mark.parametrize("kwargs, field", [
    (dict(min=2, max=1), "min"), (dict(min=0, max=1, grow_factor=0), "grow_factor"),
    (dict(min=0, max=1, shrink_factor=-1), "shrink_factor"), (dict(min=0, max=1, dtype=str), "dtype"),
    (dict(choices=[]), "choices"), (dict(min=0, max=1, log=True), "min"),
    (dict(min=1.5, max=3, dtype=int), "min"), (dict(max=3), "min"),
])
def test_parameter_validation(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        RLParameter(**kwargs)
    assert "\n" not in str(err.value)


# --- HyperparameterConfig ------------------------------------------------------------------

def test_config_mapping_validation_and_roundtrip():
    cfg = full_config(lora_rank=RLParameter(min=2, max=64, dtype=int))
    assert cfg.names() == ("lr", "beta", "batch_size", "algo", "lora_rank")
    assert "lr" in cfg and "gamma" not in cfg and len(cfg) == 5
    assert cfg["batch_size"].dtype is int and dict(cfg.items())["lr"].log
    cfg.validate_for(FakeAgent(0))  # lora_rank is routed to set_lora_rank
    bad = HyperparameterConfig(lr=RLParameter(0, 1), gamma=RLParameter(0, 1), tau=RLParameter(0, 1))
    with pytest.raises(ValueError) as err:
        bad.validate_for(FakeAgent(7))
    msg = str(err.value)
    assert "\n" not in msg and "gamma" in msg and "tau" in msg and "7" in msg
    assert all(n in msg for n in FakeAgent.MUTABLE)
    restored = HyperparameterConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert restored == cfg and cfg.to_dict()["algo"]["dtype"] == "categorical"
    assert cfg.to_dict()["batch_size"]["dtype"] == "int"
    s = cfg.sample(np.random.default_rng(0))
    assert set(s) == set(cfg.names()) and isinstance(s["batch_size"], int)


# --- Mutations -----------------------------------------------------------------------------

def test_mutations_validation():
    with pytest.raises(ValueError, match="all zero"):
        Mutations(no_mutation=0, rl_hp=0, lora_rank=0)
    with pytest.raises(ValueError, match="rl_hp"):
        Mutations(rl_hp=-1)


def test_no_mutation_changes_nothing():
    pop = population([[1.0]] * 4, full_config())
    before = [dict(a.hps) for a in pop]
    out = Mutations(no_mutation=1, rl_hp=0, rand_seed=0).mutation(pop)
    assert out == pop and [a.hps for a in pop] == before
    assert all(a.last_mutation == MutationRecord(kind="none") for a in pop)
    assert all(a.hook_calls == 0 for a in pop)


def test_rl_hp_changes_exactly_one_and_runs_hooks():
    cfg = full_config(lora_rank=RLParameter(min=2, max=64, dtype=int))
    pop = population([[1.0]] * 20, cfg)
    before = [dict(a.hps) for a in pop]
    Mutations(no_mutation=0, rl_hp=1, rand_seed=0).mutation(pop)
    names = set()
    for a, b in zip(pop, before):
        changed = [k for k in a.hps if a.hps[k] != b[k]]
        rec = a.last_mutation
        assert rec.kind == "rl_hp" and changed == [rec.name] and rec.name != "lora_rank"
        assert rec.old == b[rec.name] and rec.new == a.hps[rec.name]
        assert a.hook_calls == 1 and a.rank_calls == []
        names.add(rec.name)
    assert len(names) > 1


def test_lora_rank_mutation_calls_set_lora_rank():
    cfg = full_config(lora_rank=RLParameter(min=2, max=64, dtype=int))
    pop = population([[1.0]] * 5, cfg)
    Mutations(no_mutation=0, rl_hp=0, lora_rank=1, rand_seed=0).mutation(pop)
    for a in pop:
        assert a.rank_calls == [a.lora_rank] and a.lora_rank in (10, 6)
        assert a.last_mutation.kind == "lora_rank" and a.last_mutation.old == 8
        assert a.hook_calls == 1


def test_lora_rank_mass_dropped_without_config_entry():
    pop = population([[1.0]] * 5, full_config())
    m = Mutations(no_mutation=0, rl_hp=1, lora_rank=3, rand_seed=0)
    assert m.probabilities_for(pop[0]) == {"none": 0.0, "rl_hp": 1.0, "lora_rank": 0.0}
    m.mutation(pop)
    assert all(a.last_mutation.kind == "rl_hp" and a.rank_calls == [] for a in pop)
    only_rank = Mutations(no_mutation=0, rl_hp=0, lora_rank=1, rand_seed=0)
    assert only_rank.mutate_agent(pop[0]).kind == "none"


def test_pre_training_mutation_mutates_everyone():
    pop = population([[1.0]] * 10, full_config())
    Mutations(no_mutation=0.9, rl_hp=0.1, rand_seed=0).mutation(pop, pre_training_mut=True)
    assert all(a.last_mutation.kind == "rl_hp" for a in pop)


def test_mutation_rejects_unknown_hyperparameter():
    cfg = HyperparameterConfig(gamma=RLParameter(0.9, 0.99))
    with pytest.raises(ValueError, match="gamma"):
        Mutations(no_mutation=0, rl_hp=1).mutate_agent(FakeAgent(0, cfg))


def _mutation_trace(seed):
    cfg = full_config(lora_rank=RLParameter(min=2, max=64, dtype=int))
    pop = population([[1.0]] * 8, cfg)
    m = Mutations(no_mutation=0.2, rl_hp=0.5, lora_rank=0.3, explore_prob=0.3, rand_seed=seed)
    trace = []
    for _ in range(3):
        m.mutation(pop)
        trace.append([a.last_mutation.to_dict() for a in pop])
    return trace


def test_same_seed_same_mutations():
    assert _mutation_trace(5) == _mutation_trace(5)
    assert _mutation_trace(5) != _mutation_trace(6)


# --- TournamentSelection -------------------------------------------------------------------

def test_tournament_elite_clones_and_ids():
    pop = population([[0.1], [0.9], [0.5], [0.3], [0.7]], full_config())
    elite_hps = dict(pop[1].hps)
    sel = TournamentSelection(tournament_size=2, elitism=True, population_size=5, rand_seed=0)
    res = sel.select(pop)
    assert isinstance(res, SelectionResult)
    assert res.elite is pop[1] and res.population[0] is pop[1] and res.elite.hps == elite_hps
    assert res.elite.hook_calls == 0 and res.best_index == 1
    clones = res.population[1:]
    assert [c.index for c in clones] == [5, 6, 7, 8]
    assert res.mutate == clones and all(c not in pop for c in clones)
    assert set(res.parents) == {5, 6, 7, 8}
    by_id = {a.index: a for a in pop}
    for c in clones:
        parent = by_id[res.parents[c.index]]
        assert c.hps == parent.hps and c.fitness == parent.fitness and c.hook_calls == 1
    # a size-2 tournament without replacement never picks the worst agent
    assert 0 not in res.parents.values()
    assert res.dropped == [a for a in pop if a is not pop[1]]
    # second generation: ids continue, never reused
    for i, a in enumerate(res.population):
        a.fitness.append(float(i))
    res2 = sel.select(res.population)
    assert [c.index for c in res2.population[1:]] == [9, 10, 11, 12]
    assert res2.elite is res.population[-1]


def test_tournament_next_index_and_no_elitism():
    pop = population([[0.1], [0.9], [0.5]])
    res = TournamentSelection(3, elitism=False, rand_seed=0, next_index=100).select(pop)
    assert res.elite is None and res.best_index == 1
    assert [a.index for a in res.population] == [100, 101, 102]
    assert set(res.parents.values()) == {1} and res.dropped == pop and res.mutate == res.population


def test_tournament_ties_broken_by_lower_index():
    pop = population([[0.5], [0.9], [0.9]])
    assert TournamentSelection(1, population_size=3, rand_seed=0).select(pop).elite is pop[1]
    pop_nan = population([[float("nan")], [0.1]])
    assert TournamentSelection(2, rand_seed=0).select(pop_nan).elite is pop_nan[1]


def test_tournament_mean_fitness_window():
    # last value favours agent 0; the mean of the last 3 favours agent 1
    pop = population([[0.0, 0.0, 0.0, 1.0], [5.0, 0.8, 0.8, 0.8], [0.0, 0.1, 0.1, 0.1]])
    last = TournamentSelection(3, population_size=3, fitness="last", rand_seed=0).select(pop)
    assert last.elite is pop[0]
    mean = TournamentSelection(3, population_size=3, eval_loop=3, fitness="mean", rand_seed=0)
    res = mean.select(pop)
    assert res.elite is pop[1] and res.scores[1] == pytest.approx(0.8)
    assert set(res.parents.values()) == {1}
    # window overrides eval_loop: the 4-value mean brings agent 1 to 1.85
    win = TournamentSelection(3, fitness="mean", window=4, rand_seed=0).select(pop)
    assert win.scores[1] == pytest.approx(1.85) and win.scores[0] == pytest.approx(0.25)


def test_selection_validation_errors():
    with pytest.raises(ValueError, match="tournament_size"):
        TournamentSelection(0, population_size=4)
    with pytest.raises(ValueError, match="tournament_size"):
        TournamentSelection(5, population_size=4)
    with pytest.raises(ValueError, match="population_size=4"):
        TournamentSelection(2, population_size=4).select(population([[1.0]] * 3))
    pop = population([[1.0], [], [2.0]])
    with pytest.raises(ValueError, match="agent 1 has no fitness"):
        TournamentSelection(2).select(pop)
    with pytest.raises(ValueError, match="fitness"):
        TournamentSelection(2, fitness="median")
    with pytest.raises(ValueError, match="duplicate"):
        TournamentSelection(2).select([FakeAgent(0, fitness=[1]), FakeAgent(0, fitness=[2])])
    with pytest.raises(ValueError, match="quantile"):
        TruncationSelection(4, quantile=0.8)


# --- TruncationSelection -------------------------------------------------------------------

def test_truncation_replaces_bottom_with_top_clones():
    fits = [[0.3], [0.9], [0.1], [0.8], [0.5], [0.2], [0.7], [0.6]]
    pop = population(fits, full_config())
    sel = TruncationSelection(population_size=8, quantile=0.25, rand_seed=0)
    res = sel.select(pop)
    assert res.elite is pop[1]
    # bottom 2 (ids 2 and 5) replaced in place by clones of the top 2 (ids 1 and 3)
    assert {a.index for a in res.dropped} == {2, 5}
    assert [a.index for a in res.population] == [0, 1, 8, 3, 4, 9, 6, 7]
    assert all(res.population[i] is pop[i] for i in (0, 1, 3, 4, 6, 7))
    assert res.mutate == [res.population[2], res.population[5]]
    assert set(res.parents) == {8, 9} and set(res.parents.values()) <= {1, 3}
    assert all(c.hook_calls == 1 for c in res.mutate)
    assert all(a.hook_calls == 0 for a in pop)
    for a in res.population:
        a.fitness.append(1.0)
    assert {a.index for a in sel.select(res.population).mutate} == {10, 11}


# --- Optuna initialisation ------------------------------------------------------------------

def _check_draws(cfg, draws, n):
    assert len(draws) == n
    for d in draws:
        assert set(d) == set(cfg.names())
        for name, value in d.items():
            p = cfg[name]
            if p.is_categorical:
                assert value in p.choices
            elif p.dtype is int:
                assert type(value) is int and p.min <= value <= p.max
            else:
                assert type(value) is float and p.min <= value <= p.max


@pytest.mark.parametrize("make", [
    lambda: optuna.samplers.QMCSampler(seed=0),
    lambda: optuna.samplers.TPESampler(seed=0),
    lambda: "qmc",
    lambda: "lhs",
    lambda: None,
])
def test_initial_population_hyperparameters(make):
    cfg = full_config(lora_rank=RLParameter(min=2, max=64, dtype=int, log=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        a = initial_population_hyperparameters(cfg, 6, sampler=make(), seed=0)
        b = initial_population_hyperparameters(cfg, 6, sampler=make(), seed=0)
    _check_draws(cfg, a, 6)
    assert a == b
    assert len({d["lr"] for d in a}) == 6


def test_hp_config_to_distributions():
    d = hp_config_to_distributions(full_config())
    assert isinstance(d["lr"], optuna.distributions.FloatDistribution) and d["lr"].log
    assert isinstance(d["batch_size"], optuna.distributions.IntDistribution)
    assert isinstance(d["algo"], optuna.distributions.CategoricalDistribution)
    assert d["algo"].choices == ("grpo", "gspo", "cispo")
    assert math.isclose(d["lr"].low, 1e-6)
    with pytest.raises(ValueError, match="unknown sampler"):
        initial_population_hyperparameters(full_config(), 2, sampler="grid")
