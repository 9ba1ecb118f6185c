"""Narrowing schedule, fitness from training rewards, selection signal-to-noise, model-based explore and
the default search ranges, on stand-in agents (no model)."""

import math

import numpy as np
import pytest
import torch

from evollm.hpo import (DEFAULT_RANGES, HyperparameterConfig, Mutations, Narrowing, RLParameter,
                        TournamentSelection, default_hp_config, selection_signal)
from evollm.hpo.narrowing import budget_fraction, narrowed_size
from evollm.rollout.population import mean_stderr


class Stub:
    """The parts of a member the engine reads and writes."""

    def __init__(self, index, fitness=(), scores=(), hp_config=None, parent_index=None, **hps):
        self.index, self.fitness, self.scores = index, list(fitness), list(scores)
        self.hp_config, self.parent_index, self.hps = hp_config, parent_index, dict(hps)
        self.lora_rank, self.last_mutation, self.released = 8, None, False

    def get_hyperparameter(self, name):
        return self.hps[name]

    def set_hyperparameter(self, name, value):
        self.hps[name] = value

    def mutable_hyperparameters(self):
        return tuple(self.hps)

    def clone(self, index=None):
        return Stub(index, hp_config=self.hp_config, parent_index=self.index, **self.hps)

    def run_mutation_hooks(self):
        pass


# ----------------------------------------------------------------------------- narrowing
def test_narrowed_sizes_halve_down_to_the_minimum():
    assert [narrowed_size(n, 0.5, 2) for n in (8, 5, 4, 3, 2)] == [4, 3, 2, 2, 2]
    assert Narrowing(at=(0.25, 0.5)).sizes(8) == [8, 4, 2]
    assert Narrowing(at=(0.2, 0.4, 0.6), keep=0.5, min_size=1).sizes(8) == [8, 4, 2, 1]


def test_budget_fraction_is_the_larger_of_steps_and_time():
    assert budget_fraction(10, 40) == 0.25
    assert budget_fraction(10, 40, elapsed=30.0, max_time=60.0) == 0.5
    assert budget_fraction(30, 40, elapsed=30.0, max_time=60.0) == 0.75


def test_narrowing_keeps_the_best_in_order_and_counts_milestones():
    n = Narrowing(at=(0.25, 0.5), keep=0.5, min_size=2)
    pop = [Stub(i) for i in range(8)]
    score = {0: 0.1, 1: 0.9, 2: math.nan, 3: 0.5, 4: 0.5, 5: 0.2, 6: 0.8, 7: 0.3}
    assert n.due(0.2) == 0 and n.due(0.25) == 1 and n.due(0.6) == 2
    kept, dropped = n.narrow(pop, lambda a: score[a.index], n.due(0.3))
    # best four: 1 (0.9), 6 (0.8), 3 and 4 (0.5; tie kept by both); kept in population order
    assert [a.index for a in kept] == [1, 3, 4, 6]
    assert [a.index for a in dropped] == [0, 2, 5, 7]
    assert n.passed == 1 and n.due(0.3) == 0 and n.due(0.5) == 1
    kept2, _ = n.narrow(kept, lambda a: score[a.index], 1)
    assert [a.index for a in kept2] == [1, 6]
    state = n.state_dict()
    other = Narrowing(at=(0.25, 0.5))
    other.load_state_dict(state)
    assert other.passed == 2 and other.due(0.99) == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"at": ()}, "at least one"), ({"at": (0.5, 0.25)}, "strictly increasing"), ({"at": (1.0,)}, "in \\(0, 1\\)"),
    ({"keep": 1.0}, "keep must be in"), ({"min_size": 0}, "min_size must be >= 1")])
def test_narrowing_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Narrowing(**kwargs)


# ----------------------------------------------------------------------------- fitness and its noise
def test_train_fitness_ranks_on_the_running_mean_of_recent_training_rewards():
    sel = TournamentSelection(2, population_size=2, fitness="train", window=3, rand_seed=0)
    a = Stub(0, fitness=[0.9], scores=[0.0, 0.1, 0.2, 0.3])   # held-out says a; training rewards say b
    b = Stub(1, fitness=[0.1], scores=[0.9, 0.4, 0.5, 0.6])
    assert sel.score(a) == pytest.approx(0.2) and sel.score(b) == pytest.approx(0.5)
    # standard error of the window's mean: std(ddof=1) / sqrt(3) = 0.1 / sqrt(3)
    assert sel.stderr(a) == pytest.approx(0.1 / math.sqrt(3))
    result = sel.select([a, b])
    assert result.best_index == 1 and result.elite is b
    stale = Stub(2, scores=[0.9, 0.9, math.nan])  # did not train at its last step (quarantined)
    assert sel.score(stale) == -math.inf
    assert TournamentSelection(2, fitness="train").window == 10


def test_stderr_of_evaluation_fitness_follows_the_mode():
    last = TournamentSelection(2, fitness="last")
    mean = TournamentSelection(2, fitness="mean", window=2)
    agent = Stub(0, fitness=[0.4, 0.5, 0.6])
    assert last.stderr(agent, [0.3, 0.04, 0.03]) == pytest.approx(0.03)
    assert mean.stderr(agent, [0.3, 0.04, 0.03]) == pytest.approx(0.05 / 2)  # sqrt(.04^2 + .03^2) / 2
    assert math.isnan(last.stderr(agent, []))


def test_selection_signal_by_hand():
    # scores 0.2, 0.4, 0.6: spread 0.2; standard errors 0.1, 0.1, 0.1 -> snr 2
    out = selection_signal([0.2, 0.4, 0.6, -math.inf], [0.1, 0.1, 0.1, math.nan])
    assert out["spread"] == pytest.approx(0.2) and out["stderr"] == pytest.approx(0.1)
    assert out["snr"] == pytest.approx(2.0)
    assert math.isnan(selection_signal([0.5], [0.1])["snr"])


def test_mean_stderr_matches_numpy():
    x = np.array([1.0, 0.0, 1.0, 1.0, 0.0])
    assert mean_stderr(x.sum(), (x * x).sum(), len(x)) == pytest.approx(x.std(ddof=1) / math.sqrt(len(x)))
    assert math.isnan(mean_stderr(1.0, 1.0, 1))


def test_selection_state_keeps_the_narrowed_size():
    sel = TournamentSelection(2, population_size=8, rand_seed=0)
    sel.resize(4)
    other = TournamentSelection(2, population_size=8, rand_seed=0)
    other.load_state_dict(sel.state_dict())
    assert other.population_size == 4 and sel.min_population == 2


# ----------------------------------------------------------------------------- model-based explore
def _space():
    return HyperparameterConfig(lr=RLParameter(1e-5, 1e-2, log=True), beta=RLParameter(0.0, 0.05))


@pytest.mark.parametrize("sampler", ["gp", "tpe"])
def test_model_explore_proposes_values_in_range_that_reach_the_member(sampler):
    hp = _space()
    mut = Mutations(no_mutation=0.0, rl_hp=1.0, model_prob=1.0, model_sampler=sampler, rand_seed=0)
    rng = np.random.default_rng(1)
    pop = [Stub(i, hp_config=hp, lr=float(lr), beta=0.01) for i, lr in enumerate(np.logspace(-5, -2, 6))]
    mut.observe(pop, {a.index: 0.0 for a in pop})  # baselines only
    assert mut.observations == []
    # improvement peaks at lr = 1e-3
    mut.observe(pop, {a.index: -abs(math.log10(a.hps["lr"]) + 3) + rng.normal(0, 0.01) for a in pop})
    assert len(mut.observations) == 6
    clone = pop[0].clone(index=10)
    before = dict(clone.hps)
    record = mut.mutate_agent(clone)
    assert record.kind == "rl_hp" and record.explored
    for name, param in hp.items():
        assert param.min <= clone.hps[name] <= param.max
    assert clone.hps != before and clone.last_mutation is record
    # a clone's observation is measured against its parent's score at the previous selection
    parent_score = -abs(math.log10(pop[0].hps["lr"]) + 3)  # -2, plus noise
    mut.observe([clone], {10: 0.5})
    assert mut.observations[-1]["member"] == 10
    assert mut.observations[-1]["improvement"] == pytest.approx(0.5 - parent_score, abs=0.05)


def test_model_explore_is_reproducible_from_its_state():
    hp = _space()
    pop = [Stub(i, hp_config=hp, lr=float(lr), beta=0.02) for i, lr in enumerate((1e-4, 1e-3, 5e-3))]
    a = Mutations(no_mutation=0.0, rl_hp=1.0, model_prob=1.0, rand_seed=3)
    a.observe(pop, {0: 0.1, 1: 0.2, 2: 0.3})
    a.observe(pop, {0: 0.2, 1: 0.5, 2: 0.1})
    b = Mutations(no_mutation=0.0, rl_hp=1.0, model_prob=1.0, rand_seed=99)
    b.load_state_dict(a.state_dict())
    x, y = pop[1].clone(index=7), pop[1].clone(index=8)
    a.mutate_agent(x)
    b.mutate_agent(y)
    assert x.hps == y.hps


def test_without_model_prob_nothing_is_observed_and_draws_are_unchanged():
    hp = _space()
    plain, with_off = Mutations(rand_seed=5), Mutations(rand_seed=5, model_prob=0.0)
    with_off.observe([Stub(0, hp_config=hp, lr=1e-3, beta=0.0)], {0: 1.0})
    assert with_off.observations == []
    x, y = Stub(0, hp_config=hp, lr=1e-3, beta=0.01), Stub(1, hp_config=hp, lr=1e-3, beta=0.01)
    plain.mutate_agent(x)
    with_off.mutate_agent(y)
    assert x.hps == y.hps


@pytest.mark.parametrize("kwargs, message", [({"model_prob": 1.5}, "model_prob"),
                                             ({"model_sampler": "cma"}, "model_sampler"),
                                             ({"model_history": 1}, "model_history")])
def test_model_explore_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Mutations(**kwargs)


# ----------------------------------------------------------------------------- default ranges
def test_default_search_space_is_the_lora_learning_rate():
    from evollm.algorithms.grpo import GRPO
    from evollm.algorithms.ppo import LLMPPO

    hp = default_hp_config(GRPO.MUTABLE)
    assert hp.names() == ("lr",)
    assert (hp["lr"].min, hp["lr"].max, hp["lr"].log) == (1e-5, 1e-3, True)
    assert default_hp_config(LLMPPO.MUTABLE).names() == ("lr_actor",)  # the critic keeps its default rate
    assert default_hp_config(LLMPPO.MUTABLE, fixed={"lr"}) is None  # lr is lr_actor: nothing left to search
    from evollm.algorithms.ippo import AGENT_MUTABLE
    assert default_hp_config(AGENT_MUTABLE).names() == ("actor_learning_rate",)  # IPPO teams: the same rule
    assert default_hp_config(GRPO.MUTABLE, fixed={"lr"}) is None
    for name, spec in DEFAULT_RANGES.items():
        RLParameter(**spec)  # every default range is a valid parameter


def test_a_cut_between_equal_scores_is_called_tied():
    assert Narrowing.tied_at_cut([0.25, 0.25], [0.25, 0.25])       # every member alike: no information
    assert Narrowing.tied_at_cut([0.44, 0.25], [0.25, 0.20])       # the boundary itself is a tie
    assert not Narrowing.tied_at_cut([0.44, 0.30], [0.25, 0.25])   # ties below the cut do not matter
    assert not Narrowing.tied_at_cut([0.3, float("nan")], [float("nan")])  # quarantined members are not scores
    assert not Narrowing.tied_at_cut([0.3], [])


def test_equal_held_out_scores_keep_the_default_founder_then_the_best_recent_training_rewards():
    """A cut between equal held-out scores (greedy play unchanged, every member at the base model's
    fitness) keeps the default founder's lineage, then the members whose sampled rewards rose, not the
    lower ids; NaN rewards rank last, and the ids decide only where the rewards tie as well."""
    from evollm.hpo.narrowing import recent_reward, tie_rank

    pop = [Stub(0, scores=[0.2] * 12), Stub(1, scores=[0.2, 0.3]), Stub(2, scores=[0.9] * 10 + [0.1] * 10),
           Stub(3, scores=[0.5, math.nan, 0.7]), Stub(4), Stub(5, scores=[0.6]), Stub(6, scores=[0.0])]
    pop[6].default_founder = True  # the founder with the starting values: no reward can outrank it
    assert recent_reward(pop[0]) == pytest.approx(0.2)
    assert recent_reward(pop[2]) == pytest.approx(0.1)  # the last 10 steps only
    assert recent_reward(pop[3]) == pytest.approx(0.6)  # a quarantined step's NaN is left out
    assert math.isnan(recent_reward(pop[4])) and tie_rank(pop[6]) == math.inf
    held_out = {0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25, 5: 0.5, 6: 0.25}
    kept, dropped = Narrowing(at=(0.5,)).narrow(pop, lambda a: held_out[a.index], 1, tiebreak=tie_rank)
    # 5 on its score; 6 (the default founder), then 3 (0.6) and 1 (0.25) on the tie-break
    assert [a.index for a in kept] == [1, 3, 5, 6]
    assert Narrowing.tied_at_cut([0.25, 0.5], [0.25])
    held_out[6] = 0.2  # a worse held-out score is evidence: the founder goes
    kept, _ = Narrowing(at=(0.5,)).narrow(pop, lambda a: held_out[a.index], 1, tiebreak=tie_rank)
    assert [a.index for a in kept] == [0, 1, 3, 5]
    # without a tie-break (or with equal ones) the lower id wins, as before
    kept, _ = Narrowing(at=(0.5,)).narrow(pop, lambda a: held_out[a.index], 1)
    assert [a.index for a in kept] == [0, 1, 2, 5]
    kept, _ = Narrowing(at=(0.5,)).narrow(pop, lambda a: held_out[a.index], 1, tiebreak=lambda a: 0.0)
    assert [a.index for a in kept] == [0, 1, 2, 5]


def test_one_rung_on_a_tie_cuts_a_step_at_a_time_until_the_scores_differ():
    """on_tie="one_rung": three milestones due at a ranking whose scores are all equal act on one (8 -> 4),
    the other two stay due; a ranking that separates the members acts on every milestone due."""
    pop = [Stub(i, scores=[0.1 * i]) for i in range(8)]
    pop[0].default_founder = True
    n = Narrowing(on_tie="one_rung")
    kept, dropped = n.narrow(pop, lambda a: 0.25, n.due(0.3), tiebreak=n.tie_key())
    assert [a.index for a in kept] == [0, 5, 6, 7] and n.passed == 1 and n.due(0.3) == 2
    assert n.deferred and n.state_dict()["deferred"]  # saved: a resumed run waits as the original would
    resumed = Narrowing(on_tie="one_rung")
    resumed.load_state_dict(n.state_dict())
    assert resumed.deferred and resumed.passed == 1
    assert Narrowing.tied_at_cut([0.25] * 4, [0.25] * 4)
    scores = {0: 0.25, 5: 0.31, 6: 0.25, 7: 0.28}  # measured again: 5 is ahead of everyone
    kept2, _ = n.narrow(kept, lambda a: scores[a.index], n.due(0.4), tiebreak=n.tie_key())
    assert [a.index for a in kept2] == [5] and n.finished  # no tie at the deepest cut: both milestones
    assert not n.deferred
    plain = Narrowing()  # on_tie="cut": every milestone at once, the tie-break choosing
    kept, _ = plain.narrow(pop, lambda a: 0.25, plain.due(0.3), tiebreak=plain.tie_key())
    assert [a.index for a in kept] == [0] and plain.finished
    one = Narrowing(at=(0.05,), on_tie="one_rung")  # a single milestone due: cut as usual
    kept, _ = one.narrow(pop, lambda a: 0.25, 1, tiebreak=one.tie_key())
    assert len(kept) == 4 and one.finished
    two = Narrowing(on_tie="one_rung")  # two members, two milestones due: one rung goes as deep (2 -> 1)
    two.passed = 1
    kept, _ = two.narrow(pop[:2], lambda a: 0.25, 2, tiebreak=two.tie_key())
    assert len(kept) == 1 and two.finished and not two.deferred
    # a tie below the deepest cut does not matter: 7 alone is ahead
    n = Narrowing(on_tie="one_rung")
    kept, _ = n.narrow(pop, lambda a: 0.5 if a.index == 7 else 0.25, 3, tiebreak=n.tie_key())
    assert [a.index for a in kept] == [7] and n.finished


def test_a_cut_within_tie_se_standard_errors_is_tied_and_cuts_one_rung():
    """tie_se: scores closer than tie_se standard errors of their difference count as tied. SmolLM2's first
    ranking of one seed (40 questions): 0.15 kept against 0.10 dropped, standard errors 0.057 and 0.048, is
    0.05 apart, within one standard error of the difference (0.075), so with tie_se=1 the three milestones
    due cut one rung (4 -> 2) and the default founder stays on the tie-break; a gap beyond it cuts them all."""
    assert Narrowing.tied_at_cut([0.15], [0.10], [0.057], [0.048], z=1.0)
    assert not Narrowing.tied_at_cut([0.15], [0.10], [0.057], [0.048], z=0.5)   # 0.05 > 0.037
    assert not Narrowing.tied_at_cut([0.15], [0.10], [0.057], [0.048])          # z=0: equal scores only
    assert not Narrowing.tied_at_cut([0.15], [0.10], [math.nan], [0.048], z=1.0)  # unknown error: equal only
    assert Narrowing.tied_at_cut([0.15], [0.15], [math.nan], [math.nan], z=1.0)
    # the worst kept and the best dropped are compared, whatever the order they come in
    assert Narrowing.tied_at_cut([0.30, 0.15], [0.05, 0.12], [0.01, 0.05], [0.01, 0.05], z=1.0)
    assert not Narrowing.tied_at_cut([0.30, 0.25], [0.05, 0.12], [0.01, 0.05], [0.01, 0.05], z=1.0)
    with pytest.raises(ValueError, match="tie_se must be >= 0"):
        Narrowing(tie_se=-1)

    pop = [Stub(i, scores=[0.0]) for i in range(4)]
    pop[0].default_founder = True
    fitness = {0: 0.10, 1: 0.05, 2: 0.075, 3: 0.15}
    se = {0: 0.048, 1: 0.035, 2: 0.042, 3: 0.057}
    n = Narrowing(on_tie="one_rung", tie_se=1.0)
    kept, dropped = n.narrow(pop, lambda a: fitness[a.index], 3, tiebreak=n.tie_key(), stderr=lambda a: se[a.index])
    assert [a.index for a in kept] == [0, 3] and n.passed == 1 and n.deferred == 2
    assert n.is_tied(kept, dropped, lambda a: fitness[a.index], lambda a: se[a.index])
    plain = Narrowing(on_tie="one_rung")  # tie_se 0: unequal scores are not a tie, all three rungs at once
    kept, _ = plain.narrow(pop, lambda a: fitness[a.index], 3, tiebreak=plain.tie_key(), stderr=lambda a: se[a.index])
    assert [a.index for a in kept] == [3] and plain.finished
    wide = Narrowing(on_tie="one_rung", tie_se=1.0)  # a gap of several standard errors: every rung due
    fitness[3] = 0.45
    kept, _ = wide.narrow(pop, lambda a: fitness[a.index], 3, tiebreak=wide.tie_key(), stderr=lambda a: se[a.index])
    assert [a.index for a in kept] == [3] and wide.finished and not wide.deferred
    no_errors = Narrowing(on_tie="one_rung", tie_se=1.0)  # without standard errors: equal scores only
    fitness[3] = 0.15
    kept, _ = no_errors.narrow(pop, lambda a: fitness[a.index], 3, tiebreak=no_errors.tie_key())
    assert [a.index for a in kept] == [3]


def test_the_reward_tiebreak_ranks_equal_scores_on_training_rewards_alone():
    pop = [Stub(i, scores=[0.1 * i]) for i in range(4)]
    pop[0].default_founder = True
    n = Narrowing(at=(0.5,), tiebreak="reward")
    kept, _ = n.narrow(pop, lambda a: 0.25, 1, tiebreak=n.tie_key())
    assert [a.index for a in kept] == [2, 3]  # the default founder's 0.0 is the lowest reward
    d = Narrowing(at=(0.5,))
    kept, _ = d.narrow(pop, lambda a: 0.25, 1, tiebreak=d.tie_key())
    assert [a.index for a in kept] == [0, 3]
    for kwargs, message in [({"on_tie": "wait"}, "on_tie must be one of"), ({"tiebreak": "id"}, "tiebreak must be one of")]:
        with pytest.raises(ValueError, match=message):
            Narrowing(**kwargs)


def test_with_the_default_founder_as_incumbent_only_members_that_beat_it_keep_drawing_compute():
    """incumbent=True: of the best half, members outside the default founder's lineage stay only when they
    score strictly above it; with every score equal the population goes straight to that lineage."""
    from evollm.hpo.narrowing import tie_rank

    def population(held_out):
        pop = [Stub(i) for i in range(len(held_out))]
        pop[0].default_founder = True
        return pop, (lambda a: held_out[a.index])

    pop, score = population([0.25] * 8)  # a game's first evaluation: greedy play unchanged everywhere
    kept, dropped = Narrowing(at=(0.5,), incumbent=True).narrow(pop, score, 1, tiebreak=tie_rank)
    assert [a.index for a in kept] == [0] and len(dropped) == 7
    kept, _ = Narrowing(at=(0.5,)).narrow(pop, score, 1, tiebreak=tie_rank)  # the plain schedule keeps 4
    assert len(kept) == 4 and kept[0].index == 0
    pop, score = population([0.40, 0.41, 0.45, 0.40, 0.39, 0.42, 0.30, 0.44])
    kept, _ = Narrowing(at=(0.5,), incumbent=True).narrow(pop, score, 1, tiebreak=tie_rank)
    assert [a.index for a in kept] == [1, 2, 5, 7]  # the best four, all above the founder (0.40, fifth)
    pop, score = population([0.50, 0.41, 0.45, 0.60, 0.39, 0.42, 0.30, 0.44])
    kept, _ = Narrowing(at=(0.5,), incumbent=True).narrow(pop, score, 1, tiebreak=tie_rank)
    assert [a.index for a in kept] == [0, 3]  # 3 beats it; 2, 7 are among the best four but below it
    kept, _ = Narrowing(at=(0.5,), incumbent=True, min_size=3).narrow(pop, score, 1, tiebreak=tie_rank)
    assert [a.index for a in kept] == [0, 2, 3]  # never below min_size: filled in rank order
    pop, score = population([0.5] * 4)
    for a in pop:
        a.default_founder = False  # no default lineage (left, or never): the plain schedule
    kept, _ = Narrowing(at=(0.5,), incumbent=True).narrow(pop, score, 1, tiebreak=tie_rank)
    assert len(kept) == 2


def test_paired_noise_by_hand():
    """Members that agree on most items: the paired standard error of their difference is far below the
    unpaired one. x = 1 1 1 1 0 0 0 0 and y = 1 1 1 1 0 0 0 1 (n = 8) differ on one item: d = 0 .. 0 -1,
    mean -1/8, sd sqrt((1 - 8/64) / 7) = 0.3536, se 0.125; each mean's own se is 0.189 and 0.183."""
    from evollm.rollout.population import Fitness, item_products

    x = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 1]], dtype=torch.float64)
    f = Fitness((x.mean(1)).tolist(), None, None, item_products(x).tolist(), 8)
    assert f.pair_stderrs()[0][1] == pytest.approx(0.125) == f.pair_stderrs()[1][0]
    assert mean_stderr(4.0, 4.0, 8) == pytest.approx(0.189, abs=1e-3)
    out = selection_signal(list(f), [0.189, 0.183], [f.pair_stderrs()[0][1]])
    assert out["paired_stderr"] == pytest.approx(0.125 / math.sqrt(2))
    assert out["paired_snr"] == pytest.approx(out["spread"] / out["paired_stderr"])
    assert out["paired_snr"] > out["snr"]
    assert math.isnan(selection_signal([0.2, 0.4], [0.1, 0.1])["paired_snr"])  # no pairs given: unknown
