"""``hpo.narrowing.faster_se``: a cut to one member that released a faster member within noise of it trains the member
kept at the rate between the two (their geometric mean); a cut that tells them apart, or a slower runner-up, leaves
the rate alone."""
from types import SimpleNamespace

import pandas as pd
import pytest

from evollm.hpo import Narrowing
from evollm.rollout.population import Fitness
from evollm.run.population import Birth, Population
from evollm.training.cuts import narrow_population

LRS = (5e-5, 2e-4, 1e-5, 1e-3)  # the default founder (0), a faster one (1), a slow one (2), a fast one (3)


def _scene(scores, pair_se=0.01):
    agents = []
    for i, lr in enumerate(LRS):
        hp = {"lr": lr}
        a = SimpleNamespace(index=i, fitness=[scores[i]], quarantined=False, default_founder=i == 0, scores=[0.0],
                            released=False, mutable_hyperparameters=lambda: ["lr"], hp=hp,
                            get_hyperparameter=hp.__getitem__, set_hyperparameter=hp.__setitem__)
        a.release = lambda a=a: setattr(a, "released", True)
        agents.append(a)
    record = Population(agents)
    record.births = [Birth(i, None, 0, 0, hyperparameters={"lr": lr}, default_founder=i == 0) for i, lr in enumerate(LRS)]
    fitness = Fitness(list(scores))
    fitness.pair_se = {(i, j): pair_se for i in range(4) for j in range(4) if i != j}
    record.record_evaluation(10, agents, fitness, extra={a.index: {"fitness_se": 0.03} for a in agents})
    return agents, record


def _cut(scores, faster_se=1.0, slow_se=2.0, keep=0.25):
    agents, record = _scene(scores)
    lines = []
    narrowing = Narrowing(at=(0.05,), keep=keep, revive=False, slow_se=slow_se, faster_se=faster_se)
    kept, _ = narrow_population(agents, narrowing, 10, 100, None, None, record, log=lines.append)
    return kept, record.selections().iloc[-1], lines[0]


def test_a_runner_up_within_noise_moves_the_rate_between_the_two():
    """The default founder (5e-5) at 0.373 keeps its place ahead of 2e-4 at 0.364, 0.9 paired standard errors
    behind: the ranking cannot tell them apart, so the member kept trains on at sqrt(5e-5 * 2e-4) = 1e-4."""
    kept, row, line = _cut((0.373, 0.364, 0.30, 0.20))
    assert [a.index for a in kept] == [0] and kept[0].hp["lr"] == pytest.approx(1e-4)
    assert row["rates"] == "lr 5e-05 -> 0.0001"
    assert "member 1, released, faster, scored within 1 standard errors of member 0" in line and "faster_se" in line


def test_a_runner_up_the_ranking_tells_apart_leaves_the_rate_alone():
    """2e-4 at 0.349 is 2.4 paired standard errors behind: the member kept keeps 5e-5; and with the option off
    (0) nothing moves even within noise."""
    kept, row, line = _cut((0.373, 0.349, 0.30, 0.20))
    assert kept[0].hp["lr"] == 5e-5 and pd.isna(row["rates"])
    assert "faster_se" not in line
    kept, _, _ = _cut((0.373, 0.364, 0.30, 0.20), faster_se=0.0)
    assert kept[0].hp["lr"] == 5e-5


def test_only_a_faster_member_moves_the_rate_and_the_best_faster_one_counts():
    """The member kept (2e-4, 0.373) over the default founder (5e-5, 0.364, within noise but slower) keeps its
    rate: early rankings favour slow rates already. With the runner-up slower (the slow founder 1e-5 at 0.372, not
    demoted with slow_se off), the best released member that is faster (1e-3 at 0.366) is the one compared:
    sqrt(5e-5 * 1e-3)."""
    kept, row, line = _cut((0.364, 0.373, 0.30, 0.20))
    assert [a.index for a in kept] == [1] and kept[0].hp["lr"] == 2e-4 and pd.isna(row["rates"])
    assert "faster_se" not in line
    kept, row, _ = _cut((0.373, 0.30, 0.372, 0.366), slow_se=0.0)
    assert [a.index for a in kept] == [0] and kept[0].hp["lr"] == pytest.approx((5e-5 * 1e-3) ** 0.5)


def test_a_cut_that_leaves_two_members_leaves_their_rates_alone():
    kept, _, _ = _cut((0.373, 0.364, 0.30, 0.20), keep=0.5)
    assert [a.hp["lr"] for a in kept] == [5e-5, 2e-4]


def _zero(completion, answer, question=""):
    return 0.0


def test_in_the_loop_the_rate_between_reaches_the_optimizer_and_the_report():
    """Two real GRPO members at 1e-5 and 1e-3 whose every answer scores 0 (equal scores: within any noise), cut to
    one at the first evaluation (the tie kept the lower id, the slower member): it trains at their log-midpoint,
    1e-4, in its optimizer's groups and in the report's hyperparameters."""
    from conftest import lone_member_run

    agents, record = lone_member_run(Narrowing(at=(0.1,), keep=0.5, min_size=1, revive=False, faster_se=1.0),
                                     _zero, max_steps=3, lrs=(1e-5, 1e-3))
    (member,) = agents
    row = record.selections().query("kind == 'narrowing'").iloc[0]
    assert row["rates"].endswith("-> 0.0001") and member.get_hyperparameter("lr") == pytest.approx(1e-4)
    assert [g["lr"] for g in member.optimizer.param_groups] == pytest.approx([1e-4] * len(member.optimizer.param_groups))
    assert record.report().query(f"member == {member.index}")["hp_lr"].iloc[-1] == pytest.approx(1e-4)


def test_faster_se_must_be_a_number_of_standard_errors_at_least_zero():
    from evollm.config import ConfigError
    from evollm.config.hpo import NarrowingSection as NarrowingConfig

    with pytest.raises(ValueError, match="faster_se must be >= 0"):
        Narrowing(faster_se=-1.0)
    with pytest.raises(ConfigError, match="hpo.narrowing: Narrowing.faster_se must be >= 0"):
        NarrowingConfig(faster_se=-1.0).build()
    assert Narrowing().faster_se == 2.0 and NarrowingConfig().build().faster_se == 2.0


def test_by_default_a_faster_member_two_standard_errors_behind_still_counts():
    """2e-4 at 0.355, 1.8 paired standard errors behind the default founder at 0.373: the default (2) moves the rate
    between the two, 1 does not."""
    agents, record = _scene((0.373, 0.355, 0.30, 0.20))
    kept, _ = narrow_population(agents, Narrowing(at=(0.05,), keep=0.25, revive=False), 10, 100, None, None, record)
    assert [a.index for a in kept] == [0] and kept[0].hp["lr"] == pytest.approx(1e-4)
    kept, _, _ = _cut((0.373, 0.355, 0.30, 0.20), faster_se=1.0)
    assert kept[0].hp["lr"] == 5e-5


def test_starting_values_kept_as_the_incumbent_train_on_as_they_are():
    """With ``incumbent`` the default founder's values are kept unless a member scores above them: a faster member
    within noise does not move them (nor under ``protect_default``: tests/training/test_budget_loop.py)."""
    agents, record = _scene((0.373, 0.364, 0.30, 0.20))
    narrowing = Narrowing(at=(0.05,), keep=0.25, revive=False, incumbent=True)
    kept, _ = narrow_population(agents, narrowing, 10, 100, None, None, record)
    assert [a.index for a in kept] == [0] and kept[0].hp["lr"] == 5e-5
