"""A member training alone that stalls gives its place to the reserve (``hpo.narrowing.revive``): the stall
rule by hand, the swap in the loop (once, recorded, the parked member kept on the base), the member the run
returns, and exact resume with a reserve."""

import math

import pandas as pd
import pytest
import torch
from conftest import StopAt, lone_member_run

from evollm.hpo import Narrowing
from evollm.hpo.lone import rate_between, stalled
from evollm.run import list_checkpoints
from evollm.run.population import Population
from evollm.run.reserve import Reserve


def test_stalled_by_hand():
    flat = [0.10, 0.22, 0.22, 0.21, 0.22]
    assert stalled(flat, [True] * 5, patience=3)
    assert stalled(flat, [True, True, True, False, False, False], patience=3)  # exactly half without signal
    assert not stalled(flat, [True, True, False, False, False, False], patience=3)  # a third: still learning
    assert not stalled(flat[:-1] + [0.2201], [True] * 5, patience=3)  # a new best, however small
    assert stalled(flat, [True] * 5, patience=2) and not stalled(flat, [True] * 5, patience=4)  # 0.22 at 2nd
    assert not stalled(flat[:3], [True] * 5, patience=3)  # needs patience + 1 evaluations
    assert not stalled(flat, [], patience=3)  # no step seen
    assert not stalled(flat[:-1] + [math.nan], [True] * 5, patience=3)  # an unmeasured evaluation: not a stall
    assert stalled(flat, [True] * 9 + [False], share=0.9) and not stalled(flat, [True] * 8 + [False] * 2, share=0.9)


def test_narrowing_rejects_a_patience_below_one():
    with pytest.raises(ValueError, match="patience must be >= 1"):
        Narrowing(patience=0)
    with pytest.raises(ValueError, match=r"no_signal must be a share in \[0, 1\]"):
        Narrowing(no_signal=1.5)
    with pytest.raises(ValueError, match=r"revive_rate must be one of \['own', 'between'\]"):
        Narrowing(revive_rate="mean")
    with pytest.raises(ValueError, match="two positive finite learning rates"):
        rate_between(0.0, 1e-4)


class _Member:
    def __init__(self, index, fitness):
        self.index, self.fitness, self.released = index, list(fitness), False

    def release(self):
        self.released = True


def test_the_run_returns_the_parked_member_only_when_it_measured_strictly_better():
    live, parked, runner_up = _Member(1, [0.3]), _Member(0, [0.2, 0.5]), _Member(2, [0.1])
    record = Population()
    record.members = [live]
    record.reserve = Reserve()
    record.reserve.park(parked)
    assert record.best() is live  # before a swap the reserve is a runner-up, never returned
    record.reserve.member = runner_up
    assert record.reserve.swap(parked, step=7) is runner_up and record.reserve.member is parked
    record.members = [runner_up]
    assert record.best() is parked  # 0.5 > 0.1
    runner_up.fitness.append(0.5)
    assert record.best() is runner_up  # a tie: the member that trained on
    with pytest.raises(RuntimeError):
        record.reserve.swap(runner_up, step=9)  # once per run
    late = _Member(3, [0.9])
    record.reserve.park(late)
    assert late.released and record.reserve.member is parked  # after the swap nothing more is parked


def _zero(completion, answer, question=""):
    return 0.0  # every group's rewards equal: no step carries a learning signal


def _run(ckpt=None, resume=False, callbacks=(), revive=True, max_steps=8, verbose=False, reward=_zero, patience=2,
         revive_rate="own", lrs=(1e-3, 1e-3)):
    return lone_member_run(Narrowing(at=(0.1,), keep=0.5, min_size=1, revive=revive, patience=patience,
                                     revive_rate=revive_rate), reward, ckpt, resume, callbacks, max_steps, verbose, lrs)


def test_a_stalled_member_gives_its_place_to_the_reserve_once(capsys):
    """Two members, cut to one at step 1 (0.1 of 8 steps); rewards are all zero, so from then on the
    survivor's fitness never beats its first and none of its steps has a signal: at the evaluation of
    step 3 (patience 2) it has stalled, is parked, and the runner-up of the cut trains on. That one stalls
    too, and stays: the swap happens once."""
    agents, record = _run(verbose=True)
    sel = record.selections()
    cut = sel[sel["kind"] == "narrowing"].iloc[0]
    survivor, runner_up = int(cut["kept"]), int(cut["dropped"])
    revivals = sel[sel["kind"] == "revival"]
    assert len(revivals) == 1
    row = revivals.iloc[0]
    assert (row["step"], int(row["dropped"]), int(row["kept"])) == (3, survivor, runner_up)
    assert row["no_signal"] == 1.0 and row["reason"] == "stall"
    assert [a.index for a in agents] == [runner_up]
    report = record.report()
    assert set(report[report["step"] > 3]["member"]) == {runner_up}  # it trained on and was evaluated
    assert set(report[report["step"] <= 3].query("step > 1")["member"]) == {survivor}
    metrics = record.metrics()
    assert set(metrics[metrics["step"] > 3]["member"]) == {runner_up}
    assert (metrics.query("step > 1")["learn_path"] == "no_gradient").all()
    reserve = record.reserve
    assert reserve.swapped_step == 3 and reserve.member.index == survivor
    shared = agents[0].shared
    assert shared.has_adapter(shared.member_adapter(survivor))  # parked, not released
    assert record.best() is agents[0]  # equal fitness (0): the member that trained on
    line = next(x for x in capsys.readouterr().out.splitlines() if "stalled at step 3" in x)
    assert f"revived member {runner_up}" in line and "100% of its steps without a learning signal" in line


def test_a_member_whose_samples_all_succeed_is_not_stalled():
    """The scene of the test above, but the reward is 0 for the first samples and 1 from then on: after the cut
    every group's samples all score 1, the best reward of the run, so no step has a learning signal and the
    fitness is flat, as above, yet the member is solving its prompts, not stuck on them: no stall swap."""
    calls = iter(range(10**6))

    def _late_success(completion, answer, question=""):
        return 0.0 if next(calls) < 8 else 1.0

    agents, record = _run(reward=_late_success)
    metrics = record.metrics()
    late = metrics.query("step > 1")
    assert (late["learn_path"] == "no_gradient").all() and (late["mean_reward"] == 1.0).all()
    assert metrics["mean_reward"].min() < 1.0  # a lower reward was seen: 1.0 is the run's best
    assert "revival" not in set(record.selections()["kind"])
    assert len(agents) == 1 and record.reserve.member is not None and not record.reserve.swapped


def test_stall_inputs_leave_out_solved_steps_only_for_the_swap():
    """``stall_inputs``: every step without signal counts (the anneal's ``starved``); with ``count_solved=False`` (the
    stall swap) the ones whose mean reward is the run's best do not."""
    from types import SimpleNamespace as NS

    from evollm.training.revival import stall_inputs

    rewards = {11: 0.2, 12: 1.0, 13: 1.0, 14: 0.0, 15: 1.0, 16: 0.5}
    record = NS(rows=[{"member": 1, "step": s, "fitness": 0.4} for s in (10, 13, 16)],
                metric_rows=[{"member": 1, "step": s, "mean_reward": r, "learn_path": "full" if s == 16 else "no_gradient"}
                             for s, r in rewards.items()])
    assert stall_inputs(record, 1, 2)[1] == [True, True, True, True, True, False]
    assert stall_inputs(record, 1, 2, count_solved=False)[1] == [True, False, False, True, False, False]


@pytest.mark.parametrize("revive_rate", ["own", "between"])
def test_the_reserve_trains_at_its_own_rate_or_between_the_two(revive_rate, capsys):
    """Members at lr 1e-3 and 1e-5: with ``revive_rate="between"`` the reserve trains on at their log-midpoint,
    1e-4 (what the optimizer uses and the record shows); with ``"own"`` at its founder's rate."""
    assert Narrowing().revive_rate == "between"  # the default (docs/evolution.md)
    lrs = (1e-3, 1e-5)
    agents, record = _run(revive_rate=revive_rate, lrs=lrs, verbose=True)
    row = record.selections().query("kind == 'revival'").iloc[0]
    stalled_lr, reserve_lr = lrs[int(row["dropped"])], lrs[int(row["kept"])]
    (revived,) = agents
    expected = math.sqrt(stalled_lr * reserve_lr) if revive_rate == "between" else reserve_lr
    assert revived.index == int(row["kept"]) and revived.get_hyperparameter("lr") == pytest.approx(expected)
    assert [g["lr"] for g in revived.optimizer.param_groups] == pytest.approx([expected] * len(revived.optimizer.param_groups))
    assert record.report().query(f"member == {revived.index}")["hp_lr"].iloc[-1] == pytest.approx(expected)
    line = next(x for x in capsys.readouterr().out.splitlines() if "stalled at step 3" in x)
    if revive_rate == "between":
        assert row["rates"] == f"lr {reserve_lr:.3g} -> {expected:.3g}" and f"at lr {reserve_lr:.3g} -> 0.0001" in line
    else:
        assert pd.isna(row["rates"])


def test_without_revive_the_runner_up_is_released_and_the_survivor_trains_on():
    agents, record = _run(revive=False)
    sel = record.selections()
    assert "revival" not in set(sel["kind"])
    runner_up = int(sel[sel["kind"] == "narrowing"].iloc[0]["dropped"])
    shared = agents[0].shared
    assert not shared.has_adapter(shared.member_adapter(runner_up))
    assert int(sel[sel["kind"] == "narrowing"].iloc[0]["kept"]) == agents[0].index


def test_a_parked_reserve_that_is_never_swapped_in_changes_nothing():
    """Parking costs no compute and touches nothing the survivor trains with: without a stall (patience
    longer than the run) the run is the same, step for step, with the reserve and without it."""
    from evollm.tasks import exact_match_reward

    runs = [_run(revive=revive, reward=exact_match_reward, patience=50) for revive in (True, False)]
    (a, rec_a), (b, rec_b) = runs
    assert rec_a.reserve.member is not None and not rec_a.reserve.swapped  # parked, never used
    assert rec_b.reserve is None
    assert [x.index for x in a] == [x.index for x in b]
    assert rec_a.report().equals(rec_b.report())
    cols = ["step", "member", "loss", "mean_reward", "grad_norm"]
    assert rec_a.metrics()[cols].equals(rec_b.metrics()[cols])
    for (k, v), (k2, v2) in zip(a[0].shared.state_dict(a[0].adapter_name()).items(),
                                b[0].shared.state_dict(b[0].adapter_name()).items()):
        assert k == k2 and torch.equal(v, v2)


def test_resume_with_a_reserve_is_exact(tmp_path):
    agents, record = _run(ckpt=tmp_path / "a")
    for stop in (2, 5):  # the reserve parked, not yet swapped; then after the swap
        folder = tmp_path / f"b{stop}"
        with pytest.raises(KeyboardInterrupt):
            _run(folder, callbacks=[StopAt(stop)])
        assert list_checkpoints(folder)[-1][0] == stop
        assert (list_checkpoints(folder)[-1][1] / "reserve" / "reserve.json").is_file()
        again, record2 = _run(folder, resume=True)
        assert [a.index for a in agents] == [a.index for a in again]
        assert record.selections().equals(record2.selections())
        assert record.report().equals(record2.report())
        assert record2.reserve.member.index == record.reserve.member.index
        assert record2.reserve.swapped_step == record.reserve.swapped_step
        for a, b in ((agents[0], again[0]), (record.reserve.member, record2.reserve.member)):
            for (k, v), (k2, v2) in zip(a.shared.state_dict(a.adapter_name()).items(),
                                        b.shared.state_dict(b.adapter_name()).items()):
                assert k == k2 and torch.equal(v, v2)


def _by_length(completion, answer, question=""):
    return float(len(completion) % 3)  # rewards differ within groups: every step updates


class _BlowUp:
    """Sets every live member's learning rate to 1e6 once step ``step`` is complete: the next update
    blows its adapter up and the member is quarantined."""

    def __init__(self, step):
        self.step = step

    def __getattr__(self, name):  # the other callback hooks do nothing
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_step_complete(self, state):
        if state.step == self.step:
            for agent in state.agents:
                agent.set_hyperparameter("lr", 1e6)


def test_a_quarantined_lone_member_gives_its_place_to_the_reserve(capsys):
    """The survivor of the cut (step 1) is blown up at step 3: instead of stopping (PopulationDiverged),
    the parked runner-up trains on to the end; the quarantined member is released, the reserve is used up."""
    agents, record = _run(reward=_by_length, patience=50, callbacks=[_BlowUp(2)], verbose=True)
    sel = record.selections()
    cut = sel[sel["kind"] == "narrowing"].iloc[0]
    survivor, runner_up = int(cut["kept"]), int(cut["dropped"])
    row = sel[sel["kind"] == "revival"]
    assert len(row) == 1
    row = row.iloc[0]
    assert (row["step"], row["reason"], int(row["dropped"]), int(row["kept"])) == (3, "quarantine", survivor, runner_up)
    assert [a.index for a in agents] == [runner_up] and not agents[0].quarantined
    metrics = record.metrics()
    assert set(metrics[metrics["step"] > 3]["member"]) == {runner_up}
    assert metrics["step"].max() == 8  # the run went to its end
    assert not agents[0].shared.has_adapter(agents[0].shared.member_adapter(survivor))  # released
    reserve = record.reserve
    assert reserve.used_up and reserve.member is None and (reserve.rescued_step, reserve.rescued) == (3, runner_up)
    assert record.best() is agents[0]
    out = capsys.readouterr().out
    assert f"every member was quarantined at step 3 (member {survivor}: step 3:" in out
    assert f"member {runner_up}, parked on the shared base" in out


def test_without_a_reserve_a_quarantined_lone_member_stops_the_run():
    from evollm.training import PopulationDiverged

    with pytest.raises(PopulationDiverged, match="diverged by step 3"):
        _run(reward=_by_length, patience=50, callbacks=[_BlowUp(2)], revive=False)


def test_resume_after_a_rescue_is_exact(tmp_path):
    agents, record = _run(tmp_path / "a", reward=_by_length, patience=50, callbacks=[_BlowUp(2)])
    folder = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        _run(folder, reward=_by_length, patience=50, callbacks=[_BlowUp(2), StopAt(5)])
    info = list_checkpoints(folder)[-1][1] / "reserve" / "reserve.json"
    assert list_checkpoints(folder)[-1][0] == 5 and info.is_file()
    again, record2 = _run(folder, resume=True, reward=_by_length, patience=50)
    assert record2.reserve.used_up and record2.reserve.member is None
    assert [a.index for a in again] == [a.index for a in agents]
    assert record.selections().equals(record2.selections())
    assert record.report().equals(record2.report())
    for (k, v), (k2, v2) in zip(agents[0].shared.state_dict(agents[0].adapter_name()).items(),
                                again[0].shared.state_dict(again[0].adapter_name()).items()):
        assert k == k2 and torch.equal(v, v2)
