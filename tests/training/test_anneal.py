"""A member training alone whose held-out fitness stops rising trains on at a lower learning rate
(``hpo.narrowing.anneal``): the plateau rule by hand, the anneal in the loop (recorded, bounded, reaching the
optimizer), its settings, and exact resume."""

import pytest
import torch
from conftest import StopAt, lone_member_run

from evollm.hpo import Narrowing
from evollm.hpo.narrowing import plateaued, stalled
from evollm.run import list_checkpoints
from evollm.training.callbacks import Callback


def test_plateaued_by_hand():
    assert plateaued([0.69, 0.68, 0.66, 0.68], patience=3)
    assert plateaued([0.69, 0.69, 0.69, 0.69], patience=3)  # level is no new best
    assert not plateaued([0.69, 0.68, 0.66, 0.70], patience=3)
    assert not plateaued([0.60, 0.70, 0.66, 0.68], patience=3)  # 0.70 is among the last three
    assert plateaued([0.60, 0.70, 0.66, 0.68], patience=2)
    assert not plateaued([0.69, 0.68, 0.66], patience=3)  # nothing before the window
    assert not plateaued([0.69, 0.68, float("nan"), 0.5], patience=3)  # an unmeasured evaluation decides nothing
    # the stall rule is the plateau with most steps carrying no signal
    assert stalled([0.2, 0.1, 0.1, 0.1], [True] * 4) and not stalled([0.2, 0.1, 0.1, 0.1], [False] * 4)
    assert not stalled([0.2, 0.1, 0.1, 0.3], [True] * 4)


def test_narrowing_rejects_bad_anneal_settings():
    for kwargs, message in (({"anneal_lr": 0.0}, r"anneal_lr must be a factor in \(0, 1\]"),
                            ({"anneal_lr": 2.0}, r"anneal_lr must be a factor in \(0, 1\]"),
                            ({"max_anneals": -1}, "max_anneals must be >= 0")):
        with pytest.raises(ValueError, match=message):
            Narrowing(**kwargs)
    n = Narrowing()
    assert (n.anneal, n.anneal_lr, n.max_anneals) == (False, 0.5, 2)


PHASE = {"zero": False}


def _reward(completion, answer, question=""):
    return 0.0 if PHASE["zero"] else 1.0 + float(len(completion) % 3)


class _ZeroAfter(Callback):
    """Every reward is zero after the evaluation of step ``step``: the survivor's fitness is 0 from then on, below
    what it scored at ``step``, so it no longer rises."""

    def __init__(self, step):
        self.step = step

    def on_evaluation(self, state, fitness):
        if state.step >= self.step:
            PHASE["zero"] = True


def _run(ckpt=None, resume=False, callbacks=(), anneal=True, max_anneals=2, verbose=False):
    PHASE["zero"] = resume  # a resumed run starts after step 2
    narrowing = Narrowing(at=(0.1,), keep=0.5, min_size=1, revive=False, rollback=False, patience=2, anneal=anneal,
                          max_anneals=max_anneals)
    return lone_member_run(narrowing, _reward, ckpt, resume, [_ZeroAfter(2), *callbacks], verbose=verbose)


def test_a_member_whose_fitness_stops_rising_trains_on_at_half_the_rate(capsys):
    """Two members, cut to one at step 1. After step 2 every reward is zero: the survivor scores 0 at steps 3
    and 4, below its 2nd-step score (patience 2), so at step 4 its rate halves (1e-3 -> 5e-4) in place, and
    again at step 7 (three evaluations after the first anneal: one to stand on, two without a new best); with
    max_anneals 2 it trains on at 2.5e-4 to the end. The same member all along, its optimizer at the new rate."""
    agents, record = _run(verbose=True)
    sel = record.selections()
    survivor = int(sel[sel["kind"] == "narrowing"].iloc[0]["kept"])
    rows = sel[sel["kind"] == "revival"]
    assert list(rows["reason"]) == ["anneal", "anneal"] and list(rows["step"]) == [4, 7]
    assert [int(k) for k in rows["kept"]] == [survivor, survivor] and set(rows["dropped"]) == {""}
    assert [a.index for a in agents] == [survivor]
    assert agents[0].get_hyperparameter("lr") == pytest.approx(2.5e-4)
    group = next(g for g in agents[0].optimizer.param_groups if g.get("name") == "actor")
    assert group["lr"] == pytest.approx(2.5e-4)  # it reaches the optimizer
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "plateaued at step 4" in x)
    assert f"member {survivor} plateaued" in line and "lr 0.001 -> 0.0005" in line


def test_without_anneal_the_rate_stays():
    agents, record = _run(anneal=False)
    assert "revival" not in set(record.selections()["kind"]) and agents[0].get_hyperparameter("lr") == 1e-3
    agents, record = _run(max_anneals=1)
    assert list(record.selections().query("kind == 'revival'")["step"]) == [4]
    assert agents[0].get_hyperparameter("lr") == pytest.approx(5e-4)


def test_resume_across_an_anneal_is_exact(tmp_path):
    agents, record = _run(tmp_path / "a")
    folder = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        _run(folder, callbacks=[StopAt(5)])  # after the first anneal, before the second
    assert list_checkpoints(folder)[-1][0] == 5
    again, record2 = _run(folder, resume=True)
    assert record.selections().equals(record2.selections())
    assert record.report().equals(record2.report())
    assert again[0].get_hyperparameter("lr") == agents[0].get_hyperparameter("lr") == pytest.approx(2.5e-4)
    state, state2 = agents[0].shared.state_dict(agents[0].adapter_name()), again[0].shared.state_dict(
        again[0].adapter_name())
    assert list(state) == list(state2) and all(torch.equal(state[k], state2[k]) for k in state)
