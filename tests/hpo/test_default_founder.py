"""The default founder: the first member keeps the starting hyperparameters, and with
``protect_default`` selection and narrowing replace it only when another member beats it by more
than the noise of the training rewards (hand-computed values, fake members, the config)."""

import copy
import math

import pytest

from evollm.config import RunConfig
from evollm.config.schema import ConfigError
from evollm.hpo import TournamentSelection, TruncationSelection
from evollm.hpo.selection import beats, protected_scores


def test_beating_the_default_is_a_paired_test_by_hand():
    inc = [0.40, 0.50, 0.45, 0.55]
    # differences +0.10 +0.02 +0.03 -0.01: mean 0.035, sd 0.04655, se 0.02327
    assert not beats([0.50, 0.52, 0.48, 0.54], inc, 2.0) and beats([0.50, 0.52, 0.48, 0.54], inc, 1.5)
    assert beats([0.42, 0.52, 0.47, 0.57], inc, 2.0)  # +0.02 at every step: no noise in the difference
    assert not beats([0.39, 0.49, 0.44, 0.54], inc, 0.0)  # behind
    assert beats([0.0, 0.52, 0.47, 0.57], [0.50, 0.45, 0.55], 2.0)  # the last common steps only (a younger one)
    assert not beats([0.6, 0.7], inc, 2.0) and not beats([0.6, 0.7, 0.8], [0.1, 0.1], 2.0)  # < 3 common steps
    assert not beats([0.5, math.nan, 0.6, 0.6], [0.4, 0.4, math.nan, 0.4], 2.0)  # two finite differences left


def test_protected_scores_by_hand():
    rewards = {0: [0.40, 0.50, 0.45, 0.55], 1: [0.50, 0.52, 0.48, 0.54], 2: [0.70, 0.72, 0.68, 0.74],
               3: [0.1, 0.1, 0.2, 0.2]}
    scores = {0: 0.475, 1: 0.51, 2: 0.71, 3: 0.15}
    out = protected_scores(scores, rewards, [0], 2.0)
    # 1 has not beaten it (above): the default ranks just above 1; 2 has (+0.235, se 0.023); 3 is below
    assert 0.51 < out[0] < 0.5100001 and {k: out[k] for k in (1, 2, 3)} == {1: 0.51, 2: 0.71, 3: 0.15}
    assert protected_scores(scores, rewards, [0], 0.0) == scores  # off
    assert protected_scores({**scores, 0: -math.inf}, rewards, [0], 2.0)[0] == -math.inf  # quarantined: last
    alone = protected_scores({0: 0.5, 1: 0.6}, {0: [0.5], 1: [0.6]}, [0], 2.0)  # one step: no evidence yet
    assert alone[0] > 0.6


class Member:
    """A member with training rewards (``scores``) and a learning rate."""

    def __init__(self, index, rewards, lr, default=False):
        self.index, self.scores, self.fitness = index, list(rewards), []
        self.hp_config = {"lr": None}
        self.lr, self.default_founder = lr, default

    def get_hyperparameter(self, name):
        return self.lr

    def clone(self, index=None):
        new = copy.copy(self)
        new.index, new.default_founder = index, False
        return new

    def run_mutation_hooks(self):
        pass


def _population(default_rewards, other_rewards):
    return [Member(0, default_rewards, 5e-5, default=True), Member(1, other_rewards, 3e-4),
            Member(2, [0.1, 0.12, 0.08, 0.1], 1e-5)]


def _elite(protect, default_rewards, other_rewards, tournament_size=2):
    sel = TournamentSelection(tournament_size, True, 3, fitness="train", rand_seed=0, protect_default=protect)
    pop = _population(default_rewards, other_rewards)
    sel.adopt_default(pop)
    return sel.select(pop)


def test_the_default_founder_is_replaced_on_evidence_not_on_noise():
    noisy = [0.40, 0.50, 0.45, 0.55]  # mean 0.475, se 0.0323: protected score 0.475 + 2.83 * 0.0323 = 0.566
    assert _elite(2.0, noisy, [0.50, 0.52, 0.48, 0.54]).elite.index == 0  # 0.51: within the noise
    assert _elite(0.0, noisy, [0.50, 0.52, 0.48, 0.54]).elite.index == 1  # unprotected: the higher mean
    assert _elite(2.0, noisy, [0.70, 0.72, 0.68, 0.74]).elite.index == 1  # 0.71: better beyond the noise
    result = _elite(2.0, noisy, [0.50, 0.52, 0.48, 0.54])
    assert result.scores[0] == pytest.approx(0.475) and result.protected == [0]  # the record: raw score, who
    # kept as the elite, but the parents of clones are picked on the scores as measured: every tournament
    # of all three members is won by member 1, not by the protected default
    result = _elite(2.0, noisy, [0.50, 0.52, 0.48, 0.54], tournament_size=3)
    assert result.elite.index == 0 and set(result.parents.values()) == {1}


def test_the_default_founder_is_known_by_its_hyperparameters():
    sel = TruncationSelection(3, quantile=0.34, fitness="train", protect_default=2.0)
    pop = _population([0.4, 0.5, 0.45, 0.55], [0.50, 0.52, 0.48, 0.54])
    assert not sel.is_incumbent(pop[0])  # nothing adopted yet
    sel.adopt_default(pop)
    assert sel.incumbent == {"lr": 5e-5}
    clone = pop[0].clone(7)
    assert sel.is_incumbent(pop[0]) and sel.is_incumbent(clone)  # an unmutated clone is the same run
    clone.lr = 6e-5
    assert not sel.is_incumbent(clone) and not sel.is_incumbent(pop[1])
    assert sel.select(pop).dropped[0].index == 2  # truncation ranks the same way
    again = TruncationSelection(3, quantile=0.34, fitness="train", protect_default=2.0)
    again.load_state_dict(sel.state_dict())  # a resumed run protects the same member
    assert again.incumbent == {"lr": 5e-5}
    off = TournamentSelection(2, True, 3, fitness="train")
    off.adopt_default(pop)
    assert off.incumbent is None  # protection off (the API's default): nothing to remember


def test_protect_default_needs_training_reward_ranking():
    with pytest.raises(ValueError, match="protect_default"):
        TournamentSelection(2, True, 3, fitness="last", protect_default=2.0)
    base = {"algorithm": {"name": "GRPO", "population_size": 4}, "train": {"evo_steps": 10},
            "task": {"name": "arithmetic"}}
    assert RunConfig.from_dict(base).hpo.selection.build(4, 0).protect_default == 0.0  # off by default
    on = {**base, "hpo": {"selection": {"fitness": "train", "protect_default": 2.0}}}
    assert RunConfig.from_dict(on).hpo.selection.build(4, 0).protect_default == 2.0
    with pytest.raises(ConfigError, match="hpo.selection: protect_default .* needs fitness='train'"):
        RunConfig.from_dict({**base, "hpo": {"selection": {"protect_default": 1.0}}})  # the default ranking: last


def test_a_parameter_knows_what_it_contains():
    from evollm.hpo import RLParameter
    lr = RLParameter(1e-5, 1e-3, log=True)
    assert lr.contains(1e-5) and lr.contains(1e-3) and lr.contains(5e-5)
    assert not lr.contains(5e-6) and not lr.contains(2e-3) and not lr.contains("x")
    kind = RLParameter(choices=["grpo", "dapo"])
    assert kind.contains("dapo") and not kind.contains("gspo")
