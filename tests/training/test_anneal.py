"""A member training alone whose held-out fitness stops rising trains on at a lower learning rate
(``hpo.narrowing.anneal``): the plateau rule by hand, the anneal in the loop (recorded, bounded, reaching the
optimizer), its settings, and exact resume."""

import pytest
import torch
from conftest import StopAt, lone_member_run

from evollm.hpo import Narrowing
from evollm.hpo.lone import plateau_patience, plateaued, stalled
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
                            ({"max_anneals": -1}, "max_anneals must be >= 0"),
                            ({"anneal_share": 1.0}, r"anneal_share must be a share of the budget in \[0, 1\)"),
                            ({"anneal_share": -0.1}, r"anneal_share must be a share of the budget in \[0, 1\)"),
                            ({"anneal_floor": "zero"}, r"anneal_floor must be one of \['range', 'start'\], got 'zero'")):
        with pytest.raises(ValueError, match=message):
            Narrowing(**kwargs)
    n = Narrowing()
    # on by default since 2026-11-29 (night), floored at the rate the run started from
    assert (n.anneal, n.anneal_lr, n.max_anneals, n.anneal_share, n.anneal_floor) == (True, 0.5, 2, 0.1, "start")


def test_a_plateau_spans_a_share_of_the_budget_by_hand():
    # 30 evaluations in half the budget since the member was chosen: 60 per budget, a tenth is 6
    assert plateau_patience(3, evaluations=30, spent=0.5, share=0.1) == 6
    assert plateau_patience(3, evaluations=10, spent=0.5, share=0.1) == 3  # 20 per budget: 2 < patience
    assert plateau_patience(3, evaluations=30, spent=0.5, share=0.0) == 3  # the share off
    assert plateau_patience(3, evaluations=30, spent=0.0, share=0.1) == 3  # no budget spent: patience
    assert plateau_patience(3, evaluations=30, spent=float("nan"), share=0.1) == 3  # unknown: patience
    assert plateau_patience(2, evaluations=30, spent=1.5, share=0.2) == 6  # past the budget: counted as all of it (not 4)
    assert plateau_patience(2, evaluations=100, spent=1.0, share=0.25) == 25


PHASE = {"scale": 1.0}


def _reward(completion, answer, question=""):
    # the phase's scale, and a small term that keeps a learning signal in the phases scaled to 0
    return PHASE["scale"] * (1.0 + float(len(completion) % 3)) + 0.1 * float(len(completion) % 2)


class _Phases(Callback):
    """The reward's scale by evaluation: ``scales[k]`` from the evaluation of step ``k`` on (the run starts at
    ``scales[0]``; the last one holds after). With :data:`RISE_AND_FALL` the survivor rises above the run's first
    evaluation, stops rising, rises again and stops again."""

    def __init__(self, scales):
        self.scales = scales

    def on_evaluation(self, state, fitness):
        PHASE["scale"] = self.scales[min(state.step, len(self.scales) - 1)]


#: the reward's scale by evaluation: 0.5 at step 1, 1.0 at step 2, 0 at steps 3-4, 1.0 at step 5, 0 after (in the
#: phases at 0 the scores fall to the small term of :func:`_reward`, whose steps still carry a learning signal)
RISE_AND_FALL = (0.5, 1.0, 0.0, 0.0, 1.0, 0.0)


def _flat_reward(completion, answer, question=""):
    return PHASE["scale"]  # the same for every completion of a step: no advantage, no learning signal


def _run(ckpt=None, resume=False, callbacks=(), anneal=True, max_anneals=2, verbose=False, scales=RISE_AND_FALL,
         anneal_share=0.1, anneal_floor="range", default_founder=None, reward=_reward, decay="none"):
    PHASE["scale"] = scales[-1] if resume else scales[0]  # a resumed run starts after step 5
    narrowing = Narrowing(at=(0.1,), keep=0.5, min_size=1, revive=False, rollback=False, patience=2, anneal=anneal,
                          max_anneals=max_anneals, anneal_share=anneal_share, anneal_floor=anneal_floor, decay=decay)
    return lone_member_run(narrowing, reward, ckpt, resume, [_Phases(scales), *callbacks], verbose=verbose,
                           default_founder=default_founder)


def test_a_member_whose_fitness_stops_rising_trains_on_at_half_the_rate(capsys):
    """Two members, cut to one at step 1 (both score 0.5 there). The survivor scores 1.0 at step 2, then 0 at steps
    3 and 4 (patience 2): at step 4 its rate halves (1e-3 -> 5e-4) in place. It scores 1.0 again at step 5 and 0
    at steps 6 and 7: at step 7 it halves again; with max_anneals 2 it trains on at 2.5e-4 to the end. The same
    member all along, its optimizer at the new rate."""
    agents, record = _run(verbose=True)
    sel = record.selections()
    survivor = int(sel[sel["kind"] == "narrowing"].iloc[0]["kept"])
    rows = sel[sel["kind"] == "revival"]
    assert list(rows["reason"]) == ["anneal", "anneal"] and list(rows["step"]) == [4, 7]
    assert [int(k) for k in rows["kept"]] == [survivor, survivor] and set(rows["dropped"]) == {""}
    assert list(rows["rates"]) == ["lr 0.001 -> 0.0005", "lr 0.0005 -> 0.00025"]
    assert record.revival_events() == {"anneals": [{"step": 4, "member": survivor, "rates": "lr 0.001 -> 0.0005"},
                                                   {"step": 7, "member": survivor, "rates": "lr 0.0005 -> 0.00025"}]}
    assert [a.index for a in agents] == [survivor]
    assert agents[0].get_hyperparameter("lr") == pytest.approx(2.5e-4)
    group = next(g for g in agents[0].optimizer.param_groups if g.get("name") == "actor")
    assert group["lr"] == pytest.approx(2.5e-4)  # it reaches the optimizer
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "plateaued at step 4" in x)
    assert f"member {survivor} plateaued" in line and "lr 0.001 -> 0.0005" in line


def test_a_plateau_must_last_a_share_of_the_budget():
    """The same run (8 steps, an evaluation each; the cut at step 1) with anneal_share 0.5: at step 4 the
    survivor has had 3 evaluations in 3/8 of the budget since its cut, 8 per budget, so a plateau must last
    ceil(0.5 * 8) = 4 evaluations, not patience's 2: its scores since the cut (1.0, 0, 0) are not one before four.
    At step 5 it scores 1.0 (no new best, but four evaluations need one before them); at step 6 the last four
    (0, 0, 1.0, 0) are no higher than the 1.0 before them: it anneals then, and once only (two steps left)."""
    agents, record = _run(anneal_share=0.5)
    rows = record.selections().query("kind == 'revival'")
    assert list(rows["reason"]) == ["anneal"] and list(rows["step"]) == [6]
    assert agents[0].get_hyperparameter("lr") == pytest.approx(5e-4)


def test_a_plateau_without_learning_signal_is_not_annealed():
    """The same scores as the first run's (so the same plateaus at steps 4 and 7), but every completion of a step
    earns the same reward: no step has a learning signal, the plateau is a want of signal that a lower rate cannot
    mend (the stall swap's case), and the survivor keeps its rate."""
    agents, record = _run(reward=_flat_reward)
    assert set(record.metrics()["learn_path"]) == {"no_gradient"}
    assert "revival" not in set(record.selections()["kind"]) and agents[0].get_hyperparameter("lr") == 1e-3


def test_a_member_that_has_not_risen_above_the_start_is_not_annealed():
    """A fall to zero after step 2, but the survivor's score before it (step 2) is no higher than the run's first
    evaluation (step 1): it never rose, so it is not on a plateau (a game's greedy play that has not changed yet
    scores the base model's fitness evaluation after evaluation)."""
    agents, record = _run(scales=(1.0, 1.0, 0.0))
    assert "revival" not in set(record.selections()["kind"]) and agents[0].get_hyperparameter("lr") == 1e-3
    from evollm.training.revival import starting_fitness
    assert starting_fitness(record) == pytest.approx(record.report().query("step == 1")["fitness"].median())


def test_an_anneal_floored_at_the_start_by_hand():
    """``anneal_floor: start``: a rate comes down toward the starting one and stops there; a rate at or below it
    is left as it is (never raised)."""
    from conftest import make_grpo

    from evollm.recipes.warm_start import load_tiny_model
    from evollm.training.revival import scaled_learning_rates

    model, tok = load_tiny_model(warm_start=False, seed=0)
    agent = make_grpo(model, tok, lr=1e-3)[0]
    assert scaled_learning_rates(agent, 0.5, floor={"lr": 4e-4}) == {"lr": (1e-3, 5e-4)}
    assert scaled_learning_rates(agent, 0.5, floor={"lr": 4e-4}) == {"lr": (5e-4, 4e-4)}
    assert scaled_learning_rates(agent, 0.5, floor={"lr": 4e-4}) == {}  # at its floor
    agent.set_hyperparameter("lr", 2e-4)
    assert scaled_learning_rates(agent, 0.5, floor={"lr": 4e-4}) == {}  # below it: not raised
    assert scaled_learning_rates(agent, 0.5, floor={}) == {"lr": (2e-4, 1e-4)}  # no floor for it: halved
    group = next(g for g in agent.optimizer.param_groups if g.get("name") == "actor")
    assert group["lr"] == pytest.approx(1e-4)


def test_the_starting_rate_is_not_annealed_with_anneal_floor_start():
    """The run of the first test with member 0 as the default founder (the tie at the cut keeps it): with
    ``anneal_floor: range`` its rate halves twice on the plateaus, with ``start`` it trains on at the rate the run
    started from, as a single run would, and no anneal is recorded."""
    agents, record = _run(default_founder=0)
    assert [a.index for a in agents] == [0]
    assert list(record.selections().query("kind == 'revival'")["reason"]) == ["anneal", "anneal"]
    assert agents[0].get_hyperparameter("lr") == pytest.approx(2.5e-4)
    agents, record = _run(default_founder=0, anneal_floor="start")
    assert [a.index for a in agents] == [0]
    assert "revival" not in set(record.selections()["kind"]) and agents[0].get_hyperparameter("lr") == 1e-3
    from evollm.training.revival import starting_rates
    assert starting_rates(record) == {"lr": 1e-3}


def test_without_anneal_the_rate_stays():
    agents, record = _run(anneal=False)
    assert "revival" not in set(record.selections()["kind"]) and agents[0].get_hyperparameter("lr") == 1e-3
    agents, record = _run(max_anneals=1)
    assert list(record.selections().query("kind == 'revival'")["step"]) == [4]
    assert agents[0].get_hyperparameter("lr") == pytest.approx(5e-4)


def test_the_decay_replaces_the_anneal():
    """The plateaus of the first run, with ``decay: cosine``: no anneal; the rate falls on its schedule instead
    (member 0, the default founder, started the run at 1e-3 like the survivor, so the factor stays 1)."""
    agents, record = _run(decay="cosine", default_founder=0)
    assert "revival" not in set(record.selections()["kind"]) and agents[0].get_hyperparameter("lr") == 1e-3


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


def test_the_budget_spent_since_the_last_change_is_read_from_the_record():
    from evollm.run.population import Population
    from evollm.training.revival import changed_at

    record = Population()
    assert changed_at(record) == 0.0  # nothing changed yet: the run's start
    record.selection_rows += [{"step": 2, "budget_fraction": 0.1}, {"step": 5, "budget_fraction": float("nan")},
                              {"step": 5, "budget_fraction": 0.3}]
    assert changed_at(record) == 0.3  # the last step's recorded fraction (a tournament row records none)
    record.selection_rows.append({"step": 7, "budget_fraction": float("nan")})
    nan = changed_at(record)
    assert nan != nan  # unknown: plateau_patience then falls back to patience
