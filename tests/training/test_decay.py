"""``hpo.narrowing.decay``: after the last cut the member left trains at its learning rate times a factor that
falls along a half cosine to the rate the run started from (and ``hpo.narrowing.lift``: from a multiple of its
rate to it, for a member left at the starting rate): the factor by hand, in the loop (reaching the
optimizer, the hyperparameters left alone, combined with ``train.lr_cooldown``), its settings and errors, and
exact resume from a checkpoint inside it."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import StopAt, lone_member_run, make_grpo

from evollm.hpo import Narrowing
from evollm.hpo.lone import decay_factor, decay_floor
from evollm.run import list_checkpoints
from evollm.training.callbacks import Callback


def test_the_factor_by_hand():
    assert decay_factor(0.1, 0.2, 0.25) == 1.0 and decay_factor(0.2, 0.2, 0.25) == 1.0  # before the last cut
    assert decay_factor(0.6, 0.2, 0.25) == pytest.approx(0.625)  # half way: 0.25 + 0.75 / 2
    assert decay_factor(0.4, 0.2, 0.25) == pytest.approx(0.25 + 0.75 * (1 + math.cos(math.pi / 4)) / 2)
    assert decay_factor(1.0, 0.2, 0.25) == pytest.approx(0.25) and decay_factor(1.3, 0.2, 0.25) == pytest.approx(0.25)
    assert decay_factor(1.0, 1.0, 0.25) == 1.0 and decay_factor(1.1, 1.0, 0.25) == 0.25  # no budget left to fall over
    assert decay_floor(4e-4, 1e-4) == pytest.approx(0.25)
    assert decay_floor(1e-4, 1e-4) == 1.0 and decay_floor(5e-5, 1e-4) == 1.0  # at or below the start: kept


def test_settings_and_state():
    assert Narrowing().decay == "auto"  # actor-critic members decay, the others anneal
    with pytest.raises(ValueError, match=r"decay must be one of \['auto', 'none', 'cosine'\], got 'linear'"):
        Narrowing(decay="linear")
    n = Narrowing(decay="cosine")
    n.lone_since = 0.21
    again = Narrowing(decay="cosine")
    again.load_state_dict(json.loads(json.dumps(n.state_dict())))
    assert again.lone_since == 0.21
    again.load_state_dict({"passed": 3})  # a checkpoint written before the option: no decay started
    assert again.lone_since is None


def test_config_builds_it_and_names_what_is_valid():
    from evollm.config import ConfigError, RunConfig

    base = {"model": {"source": "tiny"}, "algorithm": {"name": "GRPO", "population_size": 4},
            "train": {"evo_steps": 10, "evaluation_interval": 10}}
    cfg = RunConfig.from_dict({**base, "hpo": {"narrowing": {"decay": "cosine"}}})
    assert cfg.hpo.narrowing.build().decay == "cosine"
    with pytest.raises(ConfigError, match="hpo.narrowing.decay"):
        RunConfig.from_dict({**base, "hpo": {"narrowing": {"decay": "step"}}})


def _reward(completion, answer, question=""):
    return 1.0 + float(len(completion) % 3)


class _Fast(Callback):
    """At the cut (the first selection), the survivor's lr is set to ``lr`` (a rate above the starting one, as the
    cuts keep); after every step, the survivor's lr hyperparameter, actor group rate and factor."""

    def __init__(self, lr):
        self.lr, self.seen = lr, []

    def on_selection(self, state, result):
        state.agents[0].set_hyperparameter("lr", self.lr)

    def on_step_complete(self, state):
        a = state.agents[0]
        group = next(g for g in a.optimizer.param_groups if g.get("name") == "actor")
        self.seen.append((state.step, len(state.agents), a.get_hyperparameter("lr"), group["lr"], a.lr_factor))


def _run(ckpt=None, resume=False, callbacks=(), decay="cosine", default_founder=0, lift=1.0):
    narrowing = Narrowing(at=(0.1,), keep=0.5, min_size=1, revive=False, rollback=False, anneal=False, decay=decay,
                          lift=lift)
    return lone_member_run(narrowing, _reward, ckpt, resume, callbacks, default_founder=default_founder)


def test_the_lone_member_falls_from_its_rate_to_the_start_along_a_cosine():
    """Two members at 1e-3 (member 0 the default founder: the run started at 1e-3), cut to one at step 1 of 8,
    whose rate is then 4e-3: from step 1 (an eighth of the budget) its group trains at 4e-3 times a factor falling
    from 1 to 1e-3 / 4e-3 = 0.25 at step 8; the hyperparameter stays 4e-3."""
    fast = _Fast(4e-3)
    agents, record = _run(callbacks=[fast])
    assert [(s, n) for s, n, *_ in fast.seen] == [(s, 1) for s in range(1, 9)]
    for step, _, lr, group_lr, factor in fast.seen:
        want = decay_factor(step / 8, 1 / 8, 0.25)
        assert lr == 4e-3 and factor == pytest.approx(want) and group_lr == pytest.approx(4e-3 * want)
    assert [round(f, 3) for *_, f in fast.seen] == [1.0, 0.963, 0.859, 0.708, 0.542, 0.391, 0.287, 0.25]  # 0.25 + 0.375 (1 + cos(pi (s - 1) / 7))


def test_auto_decays_the_members_with_a_critic_only():
    """``auto`` (the default) follows the member's class: LLMPPO and IPPO teams learn a critic and decay; GRPO and
    REINFORCE members keep their rates (the anneal acts for them); ``cosine`` and ``none`` for every member."""
    from evollm.algorithms import GRPO, LLMPPO, LLMREINFORCE, IPPOAgent, IPPOTeam
    from evollm.hpo.lone import decays

    assert [decays("auto", cls) for cls in (LLMPPO, IPPOAgent, IPPOTeam, GRPO, LLMREINFORCE)] == [True] * 3 + [False] * 2
    assert decays("cosine", GRPO) and not decays("none", LLMPPO)


def test_auto_in_the_loop_follows_the_member(monkeypatch):
    """The loop asks the member: the same GRPO run keeps the lone member's rate under ``auto``, and decays it from
    4e-3 along the cosine once its class says it learns a critic (the dispatch, not a second algorithm's run)."""
    from evollm.algorithms import GRPO

    plain = _Fast(4e-3)
    _run(callbacks=[plain], decay="auto")
    assert all(g == lr == 4e-3 and f == 1.0 for *_, lr, g, f in plain.seen)
    monkeypatch.setattr(GRPO, "HAS_CRITIC", True)
    critic = _Fast(4e-3)
    _run(callbacks=[critic], decay="auto")
    assert [round(f, 3) for *_, f in critic.seen] == [1.0, 0.963, 0.859, 0.708, 0.542, 0.391, 0.287, 0.25]


def test_off_or_at_the_starting_rate_the_rates_stay():
    fast = _Fast(4e-3)
    _run(callbacks=[fast], decay="none")
    assert all(g == lr == 4e-3 and f == 1.0 for *_, lr, g, f in fast.seen)
    start = _Fast(1e-3)  # the survivor at the rate the run started from: nothing to fall to
    _run(callbacks=[start])
    assert all(g == lr == 1e-3 and f == 1.0 for *_, lr, g, f in start.seen)


def test_without_a_default_founder_the_rate_falls_to_its_range_or_stays():
    """No founder held the starting values (they lay outside the search range): a searched rate falls to its
    range's lower end; a rate nobody searched (no search space) keeps its value."""
    from evollm.hpo import HyperparameterConfig, RLParameter
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.run.population import Population
    from evollm.training.schedule import lone_factors

    fast = _Fast(4e-3)
    _run(callbacks=[fast], default_founder=None)  # lone_member_run's members have no search space
    assert all(g == lr == 4e-3 and f == 1.0 for *_, lr, g, f in fast.seen)
    model, tok = load_tiny_model(warm_start=False, seed=0)
    space = HyperparameterConfig(lr=RLParameter(min=5e-4, max=3e-3, log=True))
    agent = make_grpo(model, tok, lr=2e-3, hp_config=space)[0]
    narrowing = Narrowing(decay="cosine", lift=3.0)  # no starting rate known: the lift cannot tell, the decay acts
    narrowing.lone_since = 0.2
    assert lone_factors([agent], Population(), 1.0, narrowing) == [pytest.approx(0.25)]  # 5e-4 / 2e-3
    assert lone_factors([agent], Population(), 0.6, narrowing) == [pytest.approx(0.625)]


def test_the_lift_raises_a_lone_member_left_at_the_starting_rate_and_falls_back_to_it():
    """``lift=3``: the survivor at the rate the run started from (1e-3) trains at 3e-3 from the cut (step 1 of 8),
    falling along a half cosine to 1e-3 at step 8; its hyperparameter stays 1e-3. A survivor the cuts moved above
    the start (4e-3) is not lifted: it decays with ``cosine`` and keeps its rate with ``none``; below the start
    (5e-4) it is lifted from its own rate."""
    start = _Fast(1e-3)
    _run(callbacks=[start], decay="none", lift=3.0)
    assert [(s, n) for s, n, *_ in start.seen] == [(s, 1) for s in range(1, 9)]
    for step, _, lr, group_lr, factor in start.seen:
        want = 1.0 + 2.0 * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / 7))  # 3 at the cut, 1 at the end
        assert lr == 1e-3 and factor == pytest.approx(want) and group_lr == pytest.approx(1e-3 * want)
    assert [round(f, 3) for *_, f in start.seen] == [3.0, 2.901, 2.623, 2.223, 1.777, 1.377, 1.099, 1.0]
    slow = _Fast(5e-4)
    _run(callbacks=[slow], decay="none", lift=3.0)
    assert [round(g / 5e-4, 3) for *_, g, _ in slow.seen] == [3.0, 2.901, 2.623, 2.223, 1.777, 1.377, 1.099, 1.0]
    fast = _Fast(4e-3)
    _run(callbacks=[fast], decay="none", lift=3.0)
    assert all(g == lr == 4e-3 and f == 1.0 for *_, lr, g, f in fast.seen)
    decaying = _Fast(4e-3)
    _run(callbacks=[decaying], decay="cosine", lift=3.0)
    assert [round(f, 3) for *_, f in decaying.seen] == [1.0, 0.963, 0.859, 0.708, 0.542, 0.391, 0.287, 0.25]


def test_the_run_says_where_the_lift_or_the_decay_starts(capsys):
    """A verbose run logs one line when the lone member's schedule starts: which option, from which factor to which."""
    for rate, decay, lift, want in [(1e-3, "none", 3.0, "x3, falling along a half cosine to x1 at the end "
                                     "(hpo.narrowing.lift)"),
                                    (4e-3, "cosine", 1.0, "x1, falling along a half cosine to x0.25 at the end "
                                     "(hpo.narrowing.decay)")]:
        narrowing = Narrowing(at=(0.1,), keep=0.5, min_size=1, revive=False, rollback=False, anneal=False,
                              decay=decay, lift=lift)
        lone_member_run(narrowing, _reward, callbacks=[_Fast(rate)], verbose=True, default_founder=0)
        lines = [x for x in capsys.readouterr().out.splitlines() if "trains alone" in x]
        assert lines == [f"member 0 trains alone from 12% of the budget: its learning rates {want}"], lines
    lone_member_run(Narrowing(at=(0.1,), keep=0.5, min_size=1, revive=False, rollback=False, anneal=False,
                              decay="none"), _reward, callbacks=[_Fast(1e-3)], verbose=True, default_founder=0)
    assert "trains alone" not in capsys.readouterr().out  # neither option on: nothing to say


def test_the_lift_is_a_setting_with_a_clear_error():
    from evollm.config import ConfigError, RunConfig

    assert Narrowing().lift == 1.0  # off by default
    with pytest.raises(ValueError, match=r"lift must be a factor >= 1 \(1: off\), got 0.5"):
        Narrowing(lift=0.5)
    base = {"model": {"source": "tiny"}, "algorithm": {"name": "GRPO", "population_size": 4}}
    assert RunConfig.from_dict({**base, "hpo": {"narrowing": {"lift": 3}}}).hpo.narrowing.build().lift == 3.0
    with pytest.raises(ConfigError, match="hpo.narrowing: Narrowing.lift"):
        RunConfig.from_dict({**base, "hpo": {"narrowing": {"lift": 0}}})


@pytest.mark.parametrize("rate, decay, lift, at_5, at_end", [
    (4e-3, "cosine", 1.0, decay_factor(5 / 8, 1 / 8, 0.25), 0.25),  # the decay: 4e-3 falling to 1e-3
    (1e-3, "none", 3.0, decay_factor(5 / 8, 1 / 8, 1.0, peak=3.0), 1.0),  # the lift: 3e-3 falling to 1e-3
], ids=["decay", "lift"])
def test_resume_inside_the_decay_or_lift_is_exact(tmp_path, rate, decay, lift, at_5, at_end):
    agents, record = _run(tmp_path / "a", callbacks=[_Fast(rate)], decay=decay, lift=lift)
    folder = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        _run(folder, callbacks=[_Fast(rate), StopAt(5)], decay=decay, lift=lift)
    step, path = list_checkpoints(folder)[-1]
    assert step == 5
    meta = json.loads(next(path.rglob("optimizer.json")).read_text())
    assert meta["lr_factor"] == pytest.approx(at_5)  # the saved rates are the scaled ones (above 1 for the lift)
    again, record2 = _run(folder, resume=True, decay=decay, lift=lift)  # no callback: the rate is the checkpoint's
    assert record.report().equals(record2.report())
    state, state2 = (a.shared.state_dict(a.adapter_name()) for a in (agents[0], again[0]))
    assert list(state) == list(state2) and all(torch.equal(state[k], state2[k]) for k in state)
    assert again[0].lr_factor == agents[0].lr_factor == pytest.approx(at_end)


def test_it_combines_with_the_cool_down():
    """Both on: the groups train at the member's rate times the cool-down's factor times the decay's."""
    from evollm.recipes.warm_start import load_tiny_model
    from evollm.run.population import Birth, Population
    from evollm.training.schedule import cool_down, cooldown_factor

    model, tok = load_tiny_model(warm_start=False, seed=0)
    agent = make_grpo(model, tok, lr=4e-4)[0]
    record = Population()
    record.births = [Birth(0, None, 0, 0, hyperparameters={"lr": 1e-4}, default_founder=True)]
    narrowing = Narrowing(at=(0.1,), decay="cosine")
    settings = SimpleNamespace(narrowing=narrowing, lr_cooldown=0.2, lr_cooldown_floor=0.1, max_steps=100,
                               max_time=None)
    cool_down([agent], settings, 10, 0.0, record)  # the schedule not finished: neither factor yet
    assert agent.lr_factor == 1.0 and narrowing.lone_since is None
    narrowing.passed = 1  # the last cut acted on at step 20
    cool_down([agent], settings, 20, 0.0, record)
    assert narrowing.lone_since == pytest.approx(0.2) and agent.lr_factor == 1.0
    cool_down([agent], settings, 90, 0.0, record)
    want = cooldown_factor(0.9, 0.2, 0.1) * decay_factor(0.9, 0.2, 0.25)
    group = next(g for g in agent.optimizer.param_groups if g.get("name") == "actor")
    assert agent.lr_factor == pytest.approx(want) and group["lr"] == pytest.approx(4e-4 * want)
    assert agent.get_hyperparameter("lr") == 4e-4
