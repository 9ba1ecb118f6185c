"""``hpo.narrowing.slow_se``: at a cut, members slower than the run's starting learning rate rank below the faster
ones unless they beat the best of them beyond the noise (short-horizon bias: evollm/hpo/horizon.py)."""
from types import SimpleNamespace

import pytest

from evollm.hpo import Narrowing
from evollm.rollout.population import Fitness
from evollm.run.population import Birth, Population
from evollm.training.cuts import narrow_population

LRS = (1e-4, 2e-5, 3e-5, 4e-4)  # the default founder (0), two slow founders (1, 2), a fast one (3)
SCORES = (0.51, 0.525, 0.56, 0.50)


def _scene(pair_se=None):
    agents = []
    for i, lr in enumerate(LRS):
        a = SimpleNamespace(index=i, fitness=[SCORES[i]], quarantined=False, default_founder=i == 0, scores=[0.0],
                            released=False, mutable_hyperparameters=lambda: ["lr"],
                            get_hyperparameter=lambda name, lr=lr: lr)
        a.release = lambda a=a: setattr(a, "released", True)
        agents.append(a)
    record = Population(agents)
    record.births = [Birth(i, None, 0, 0, hyperparameters={"lr": lr}, default_founder=i == 0) for i, lr in enumerate(LRS)]
    fitness = Fitness(SCORES)
    if pair_se is not None:
        fitness.pair_se = {(i, j): pair_se for i in range(4) for j in range(4) if i != j}
    record.record_evaluation(10, agents, fitness, extra={a.index: {"fitness_se": 0.035} for a in agents})
    return agents, record


def _cut(slow_se, pair_se=None):
    agents, record = _scene(pair_se)
    lines = []
    kept, result = narrow_population(agents, Narrowing(at=(0.05,), keep=0.5, revive=False, slow_se=slow_se), 10,
                                     100, None, None, record, log=lines.append)
    return [a.index for a in kept], record.selections().iloc[-1], lines[0]


def test_slow_members_keep_their_place_only_on_evidence_paired_over_the_same_items():
    """Scores 0.51 (default), 0.525 and 0.56 (slow), 0.50 (fast), paired standard errors 0.01: with slow_se 2 the
    slow member 0.015 above the best faster one (the default founder) is ranked last, the one 0.05 above keeps its
    place. Off (0), the two slow members are kept on the scores as measured."""
    assert _cut(0.0, pair_se=0.01)[0] == [1, 2]
    kept, row, line = _cut(2.0, pair_se=0.01)
    assert kept == [0, 2] and row["demoted"] == "1" and row["dropped"] == "1 3"
    assert "member(s) [1], slower than the starting learning rate, ranked last" in line and "slow_se" in line
    scores = {int(k): float(v) for k, v in (kv.split(":") for kv in row["scores"].split())}
    assert scores[1] == pytest.approx(0.525)  # the record keeps the scores as measured


def test_without_paired_errors_the_members_own_standard_errors_set_the_bar():
    """No paired errors: the bar is 2 x hypot(0.035, 0.035) = 0.099 above 0.51, which neither slow member
    clears, so the two faster members are kept."""
    kept, row, _ = _cut(2.0)
    assert kept == [0, 3] and row["demoted"] == "1 2"


def test_no_starting_rate_or_no_faster_member_leaves_the_ranking_alone():
    agents, record = _scene(0.01)
    record.births = [Birth(i, None, 0, 0, hyperparameters={"lr": lr}) for i, lr in enumerate(LRS)]  # no default founder
    kept, _ = narrow_population(agents, Narrowing(at=(0.05,), keep=0.5, revive=False, slow_se=2.0), 10, 100, None,
                                None, record)
    assert [a.index for a in kept] == [1, 2]


def test_slow_se_must_be_a_number_of_standard_errors_at_least_zero():
    from evollm.config import ConfigError
    from evollm.config.hpo import NarrowingSection as NarrowingConfig

    with pytest.raises(ValueError, match="slow_se must be >= 0"):
        Narrowing(slow_se=-1.0)
    with pytest.raises(ConfigError, match="hpo.narrowing: Narrowing.slow_se must be >= 0"):
        NarrowingConfig(slow_se=-1.0).build()
    assert NarrowingConfig().build().slow_se == 2.0
