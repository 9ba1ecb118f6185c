"""A member training alone that falls away from the run's best state gives its place to a copy of that state at
a lower learning rate (``hpo.narrowing.rollback``): the decline rule by hand, the learning rates it scales, the
roll-back in the loop (recorded, bounded, the copy's weights, optimizer and rate), and exact resume."""

import math

import pytest
import torch
from conftest import StopAt, lone_member_run, make_grpo

from evollm.hpo import HyperparameterConfig, Narrowing, RLParameter
from evollm.hpo.lone import declined
from evollm.run import list_checkpoints
from evollm.training.callbacks import Callback
from evollm.training.revival import scaled_learning_rates


def test_declined_by_hand():
    assert declined([0.70, 0.59, 0.56, 0.61], best=0.70, patience=3)  # mean 0.5867 < 0.63
    assert not declined([0.70, 0.66, 0.55, 0.70], best=0.70, patience=3)  # mean 0.6367 >= 0.63
    assert declined([0.70, 0.66, 0.55, 0.70], best=0.70, patience=2, drop=0.05)  # mean 0.625 < 0.665
    assert not declined([0.62, 0.62], best=0.70, patience=3)  # fewer than patience evaluations
    assert declined([0.62, 0.62, 0.62], best=0.70, patience=3)
    assert not declined([0.63, 0.63, 0.63], best=0.70, patience=3)  # exactly 10 % below: not more
    assert declined([-1.2, -1.2], best=-1.0, patience=2)  # negative fitness: the drop is of |best|
    assert not declined([-1.05, -1.05], best=-1.0, patience=2)
    assert not declined([0.1, math.nan], best=0.7, patience=2)  # an unmeasured evaluation: no decision
    assert not declined([0.1, 0.1], best=-math.inf, patience=2)  # nothing kept yet
    # beyond the noise too: 0.03 below a best of 0.22 is more than 10 % of it, but not 1.5 standard errors of 0.03
    assert not declined([0.19, 0.19, 0.19], best=0.22, best_se=0.03)
    assert declined([0.19, 0.19, 0.19], best=0.22, best_se=0.03, z=0.9)  # 0.027 < 0.03
    assert declined([0.19, 0.19, 0.19], best=0.22, best_se=0.019)  # 1.5 se = 0.0285 < 0.03
    assert not declined([0.19, 0.19, 0.19], best=0.22, best_se=0.021)  # 0.0315 > 0.03
    assert declined([0.62, 0.62, 0.62], best=0.70, best_se=math.nan)  # no standard error recorded: the share alone
    assert not declined([0.62, 0.62, 0.62], best=0.70, best_se=0.06)  # 0.08 below, 1.5 se = 0.09
    # the best of several evaluations is a lucky one: the fall must also exceed that luck (E max of n normals)
    assert declined([0.55, 0.55, 0.55], best=0.70, best_se=0.05, chosen_from=1)  # 0.15 > 1.5 se = 0.075
    assert declined([0.55, 0.55, 0.55], best=0.70, best_se=0.05, chosen_from=5)  # (1.5 + 1.163) se = 0.133
    assert not declined([0.55, 0.55, 0.55], best=0.70, best_se=0.05, chosen_from=10)  # (1.5 + 1.539) se = 0.152
    assert declined([0.30, 0.30, 0.30], best=0.70, best_se=0.05, chosen_from=100)  # a collapse: (1.5 + 2.508) se = 0.2
    assert declined([0.62, 0.62, 0.62], best=0.70, best_se=math.nan, chosen_from=30)  # no standard error: the share alone


def test_narrowing_rejects_bad_rollback_settings():
    for kwargs, message in (({"decline": 0.0}, r"decline must be a share in \(0, 1\)"),
                            ({"rollback_lr": 1.5}, r"rollback_lr must be a factor in \(0, 1\]"),
                            ({"max_rollbacks": -1}, "max_rollbacks must be >= 0"),
                            ({"decline_se": -1.0}, "decline_se must be >= 0 standard errors")):
        with pytest.raises(ValueError, match=message):
            Narrowing(**kwargs)


def test_the_learning_rates_a_rollback_scales(tiny):
    model, tok = tiny
    searched = make_grpo(model, tok, n=1, lr=1e-3,
                         hp_config=HyperparameterConfig(lr=RLParameter(min=6e-4, max=1e-2, log=True)))[0]
    assert scaled_learning_rates(searched, 0.5) == {"lr": (1e-3, 6e-4)}  # not below the range's lower end
    group = next(g for g in searched.optimizer.param_groups if g.get("name") == "actor")
    assert group["lr"] == 6e-4 and searched.get_hyperparameter("lr") == 6e-4  # it reaches the optimizer
    assert scaled_learning_rates(searched, 0.5) == {}  # at the floor: nothing moves
    plain = make_grpo(model, tok, n=1, lr=1e-3)[0]  # no search space: the policy's rate
    assert scaled_learning_rates(plain, 0.5) == {"lr": (1e-3, 5e-4)}
    fallen = make_grpo(model, tok, n=1, lr=2e-4)[0]
    assert scaled_learning_rates(plain, 0.5, fell=fallen) == {"lr": (5e-4, 1e-4)}  # the lower of the two, halved
    assert scaled_learning_rates(fallen, 0.5, fell=plain) == {"lr": (2e-4, 5e-5)}


@pytest.fixture
def tiny():
    from evollm.recipes.warm_start import load_tiny_model

    torch.manual_seed(0)
    return load_tiny_model(warm_start=False, seed=0)


#: the reward's scale: rewards 1-3 by length (every step learns; every answer scores) at half scale for the first
#: evaluation (the run's starting level), then in full (the best state has learnt: it is above the start), then zero
PHASE = {"scale": 0.5}


def _reward(completion, answer, question=""):
    return PHASE["scale"] * (1.0 + float(len(completion) % 3))


class _ZeroAfter(Callback):
    """Sets the reward in full after the first evaluation and to zero after the evaluation of step ``step``: the
    survivor's held-out fitness rises above the start, then falls to 0 and, every group's rewards then being
    equal, no later step changes its weights."""

    def __init__(self, step):
        self.step = step

    def on_evaluation(self, state, fitness):
        PHASE["scale"] = 0.0 if state.step >= self.step else 1.0


def _run(ckpt=None, resume=False, callbacks=(), rollback=True, max_rollbacks=2, verbose=False, decline_se=1.5):
    PHASE["scale"] = 0.0 if resume else 0.5  # a resumed run starts after step 2
    narrowing = Narrowing(at=(0.1,), keep=0.5, min_size=1, revive=False, patience=2, rollback=rollback,
                          max_rollbacks=max_rollbacks, decline_se=decline_se)
    return lone_member_run(narrowing, _reward, ckpt, resume, [_ZeroAfter(2), *callbacks], verbose=verbose)


def _adapter(agent):
    return agent.shared.state_dict(agent.adapter_name())


class _AtRollback(Callback):
    """Copies, at the end of step ``step``, the live member's adapter and optimizer moments and the kept
    state's."""

    def __init__(self, step):
        self.step, self.seen = step, {}

    def on_step_complete(self, state):
        if state.step == self.step:
            for key, agent in (("live", state.agents[0]), ("kept", state.record.kept.member)):
                moments = [v["exp_avg"].clone() for v in agent.optimizer.state_dict()["state"].values()]
                self.seen[key] = ({k: v.clone() for k, v in _adapter(agent).items()}, moments, agent.index)


def test_a_member_that_falls_away_rolls_back_to_the_best_state_at_half_the_rate(capsys):
    """Two members, cut to one at step 1. After step 2 every reward is zero: the survivor's fitness falls from
    its best (kept at step 2) to 0 at steps 3 and 4 (patience 2), so at step 4 a copy of that state takes its
    place at lr 5e-4; the copy scores 0 at steps 5 and 6 and is rolled back again at 2.5e-4; with
    max_rollbacks 2 the second copy trains to the end. Right after the first roll-back the live member's
    adapter and optimizer moments are exactly the kept state's; the run returns the kept state (its fitness
    is above 0)."""
    snapshot = _AtRollback(4)
    agents, record = _run(verbose=True, callbacks=[snapshot])
    kept = record.kept
    assert kept is not None and kept.fitness > 0 and kept.step == 2
    sel = record.selections()
    survivor = int(sel[sel["kind"] == "narrowing"].iloc[0]["kept"])
    rows = sel[sel["kind"] == "revival"]
    assert list(rows["reason"]) == ["rollback", "rollback"] and list(rows["step"]) == [4, 6]
    first, second = int(rows.iloc[0]["kept"]), int(rows.iloc[1]["kept"])
    assert int(rows.iloc[0]["dropped"]) == survivor and int(rows.iloc[1]["dropped"]) == first
    assert [a.index for a in agents] == [second]
    assert agents[0].get_hyperparameter("lr") == pytest.approx(2.5e-4)
    # the copy of the kept state (lr 1e-3) at half the lower of its rate and the fallen member's
    assert list(rows["rates"]) == ["lr 0.001 -> 0.0005", "lr 0.001 -> 0.00025"]  # summary.json lists them
    assert record.revival_events()["rollbacks"] == [{"step": 4, "fell": survivor, "copy": first,
                                                     "rates": "lr 0.001 -> 0.0005"},
                                                    {"step": 6, "fell": first, "copy": second,
                                                     "rates": "lr 0.001 -> 0.00025"}]
    group = next(g for g in agents[0].optimizer.param_groups if g.get("name") == "actor")
    assert group["lr"] == pytest.approx(2.5e-4)
    (live, live_moments, live_id), (best, best_moments, _) = snapshot.seen["live"], snapshot.seen["kept"]
    assert live_id == first and list(live) == list(best)  # right after the roll-back: the kept state exactly
    assert all(torch.equal(live[k], best[k]) for k in live)
    assert len(live_moments) == len(best_moments) > 0  # and its optimizer state (Adam's moments)
    assert all(torch.equal(a, b) for a, b in zip(live_moments, best_moments))
    shared = agents[0].shared
    assert not shared.has_adapter(shared.member_adapter(survivor))  # released
    assert not shared.has_adapter(shared.member_adapter(first))
    lineage = record.lineage()
    births = lineage[lineage["mutation_kind"] == "rollback"]
    assert list(births["member"]) == [first, second] and set(births["parent"]) == {kept.source}
    assert list(births["new_value"]) == pytest.approx([5e-4, 2.5e-4])
    report = record.report()
    assert set(report[report["step"] > 6]["member"]) == {second}
    assert record.best() is kept.member  # 0 on the last evaluation, the kept state above it
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "fell away at step 4" in x)
    assert f"member {survivor} fell away" in line and "lr 0.001 -> 0.0005" in line


def test_without_rollback_the_survivor_trains_on_and_nothing_is_kept():
    agents, record = _run(rollback=False)
    assert record.kept is None and "revival" not in set(record.selections()["kind"])
    assert agents[0].get_hyperparameter("lr") == 1e-3
    agents, record = _run(max_rollbacks=0)  # kept, never rolled back
    assert record.kept is not None and "revival" not in set(record.selections()["kind"])


def test_a_fall_within_the_noise_of_the_best_state_does_not_roll_back(monkeypatch):
    """The loop reads the best state's standard error: the same fall to 0, read against an evaluation
    whose standard error is 1.0 (1.5 standard errors above every fitness here), is noise."""
    import evollm.training.revival as revival

    asked = []
    monkeypatch.setattr(revival, "evaluation_stderr", lambda record, index, step: asked.append((index, step)) or 1.0)
    agents, record = _run()
    assert record.kept is not None and "revival" not in set(record.selections()["kind"])
    assert (record.kept.source, record.kept.step) in asked
    _, record = _run(decline_se=0.0)  # the share alone: it rolls back as before
    assert "rollback" in set(record.selections()["reason"].dropna())


def test_the_loop_counts_the_evaluations_the_best_state_was_the_best_of(monkeypatch):
    """The loop hands :func:`declined` how many evaluations the kept state was chosen from: those from the last
    cut to the state's step: the best at step 2 (two: the cut's own evaluation at step 1, and step 2's). The
    cut's evaluation as the kept state is never judged: it is the run's starting level, nothing learnt to fall
    from."""
    import evollm.training.revival as revival

    seen = []
    real = revival.declined
    monkeypatch.setattr(revival, "declined", lambda *a, **k: seen.append(k["chosen_from"]) or real(*a, **k))
    _, record = _run(max_rollbacks=1)
    assert seen and set(seen) == {revival.evaluations_between(record, 1, 2)} == {2}
    assert "rollback" in set(record.selections()["reason"].dropna())  # a fall to 0 still rolls back


def test_resume_across_a_rollback_is_exact(tmp_path):
    agents, record = _run(tmp_path / "a")
    folder = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        _run(folder, callbacks=[StopAt(5)])  # after the first roll-back, before the second
    assert list_checkpoints(folder)[-1][0] == 5
    again, record2 = _run(folder, resume=True)
    assert [a.index for a in again] == [a.index for a in agents]
    assert record.selections().equals(record2.selections())
    assert record.report().equals(record2.report())
    assert record.lineage().equals(record2.lineage())
    assert again[0].get_hyperparameter("lr") == agents[0].get_hyperparameter("lr")
    for (k, v), (k2, v2) in zip(_adapter(agents[0]).items(), _adapter(again[0]).items()):
        assert k == k2 and torch.equal(v, v2)


def test_a_fall_is_measured_after_the_best_state_and_since_the_last_change():
    """The evaluations a roll-back judges: only those after the best state's step and after the population last
    changed (a cut, a swap, a roll-back); the last cut or swap is the one a best state must be measured at or after."""
    from evollm.run.population import Population
    from evollm.training.revival import evaluation_stderr, evaluations_between, fitness_since_change, last_cut

    record = Population()
    record.rows = [{"step": s, "member": m, "fitness": f}
                   for s, m, f in ((10, 1, 0.2), (10, 2, 0.8), (20, 1, 0.3), (30, 1, 0.6), (40, 1, 0.5), (50, 1, 0.4))]
    assert last_cut(record) == 0 and fitness_since_change(record, 1) == [0.2, 0.3, 0.6, 0.5, 0.4]
    record.selection_rows = [{"step": 10, "kind": "narrowing"}]
    assert last_cut(record) == 10 and fitness_since_change(record, 1) == [0.3, 0.6, 0.5, 0.4]
    assert fitness_since_change(record, 1, after=30) == [0.5, 0.4]  # a rise to the best is no fall
    assert not declined(fitness_since_change(record, 1, after=30), best=0.6, patience=3)  # two after it: too few
    assert declined(fitness_since_change(record, 1, after=30), best=0.6, patience=2)  # mean 0.45 < 0.54
    record.selection_rows.append({"step": 40, "kind": "revival", "reason": "rollback"})
    assert last_cut(record) == 10 and fitness_since_change(record, 1, after=30) == [0.4]  # since the roll-back
    record.selection_rows.append({"step": 45, "kind": "revival", "reason": "stall"})
    assert last_cut(record) == 45  # the reserve swapped in: the best state at step 30 is not its own to fall from
    record.selection_rows[-1]["reason"] = "quarantine"
    assert last_cut(record) == 45
    record.rows[3]["fitness_se"] = 0.05
    assert evaluation_stderr(record, 1, 30) == 0.05  # the best state's, by its member and step
    # the evaluations a best state at step 30 was the best of, since the cut at step 10: steps 10, 20 and 30
    assert evaluations_between(record, 10, 30) == 3 and evaluations_between(record, 30, 30) == 1
    assert evaluations_between(record, 60, 70) == 1  # none recorded: at least its own
    assert math.isnan(evaluation_stderr(record, 1, 40)) and math.isnan(evaluation_stderr(record, None, None))


def test_releasing_the_run_frees_every_member_it_holds():
    """``Population.release``: the live member, the kept best state and the members the run replaced leave the
    shared base (its history stays readable), so another run on the same model starts on a bare base."""
    agents, record = _run()
    shared = agents[0].shared
    assert record.kept.member is not None and [a for a in shared.adapters() if shared.is_live(a)]
    record.release()
    assert [a for a in shared.adapters() if shared.is_live(a)] == []
    assert len(record.report()) > 0 and record.best() is record.kept.member  # the history is still there
    record.release()  # idempotent


def _judged(monkeypatch):
    """:func:`roll_back_declined` on a hand-made record, with ``_roll_back`` replaced by a list of the members it
    would roll back. Returns ``(judge, rolled)``: ``judge(rows, selections, kept, step, live, se)`` takes
    ``(step, member, fitness)`` rows, all with standard error ``se``, the selection rows and the kept state's
    ``(source, step, fitness)``, and judges member ``live`` at ``step``."""
    from types import SimpleNamespace

    import evollm.training.revival as revival
    from evollm.run.population import Population

    rolled = []
    monkeypatch.setattr(revival, "_roll_back", lambda agents, member, *a: rolled.append(member.index) or agents)
    narrowing = SimpleNamespace(rollback=True, finished=True, max_rollbacks=2, patience=3, decline=0.1,
                                decline_se=1.5, elapsed_s=None)

    def judge(rows, selections, kept, step, live, se):
        record = Population()
        record.rows = [{"step": s, "member": m, "fitness": f, "fitness_se": se} for s, m, f in rows]
        record.selection_rows = selections
        source, kept_step, fitness = kept
        record.kept = SimpleNamespace(member=object(), source=source, step=kept_step, fitness=fitness)
        agent = SimpleNamespace(index=live, quarantined=False)
        return revival.roll_back_declined([agent], narrowing, None, record, step, 400, None)

    return judge, rolled


def test_a_reserve_swapped_in_is_not_rolled_back_to_the_plateau_it_replaced(monkeypatch):
    """A stall swap puts the reserve (parked at the cut, behind) in place of a member stuck on a plateau; the
    run's best state is that member's. The reserve's first evaluations are below it, but it did not fall from
    it: rolling back would undo the swap (seen on SmolLM2: a swap at step 150, then a roll-back to the plateau
    at a quarter of the rate). The same evaluations by the member the best state came from do roll back."""
    judge, rolled = _judged(monkeypatch)
    first = [(10, 20, 0.05)]  # the run's starting level, below the best state by more than 1.5 se: it had learnt
    plateau = [(50, 20, 0.2125), (75, 20, 0.225), (100, 20, 0.225), (125, 20, 0.225), (150, 20, 0.2125)]
    after = [(175, 17, 0.075), (200, 17, 0.1), (225, 17, 0.1375)]

    def run(survivor_reason):
        selections = [{"step": 25, "kind": "narrowing"}, {"step": 150, "kind": "revival", "reason": survivor_reason}]
        return judge(first + plateau + after, selections, (20, 75, 0.225), 225, live=17, se=0.056)

    run("stall")
    run("quarantine")
    assert rolled == []
    run("rollback")  # a copy of the best state that fell away again: it rolls back
    assert rolled == [17]


def test_a_fall_from_the_starting_level_does_not_roll_back(monkeypatch):
    """A best state at the run's starting level (the median of its first evaluation) had learnt nothing: a fall
    from it is the dip of learning (a score that first falls as the warm start's answers give way, then climbs;
    seen on two-digit + and - with CISPO), and a copy of it at a lower rate would only start again, slower. The
    same fall from a best state above the start by more than decline_se of its standard errors rolls back."""
    judge, rolled = _judged(monkeypatch)

    def run(start):
        rows = [(10, 1, start), (10, 2, start), (10, 3, start), (20, 1, 0.38), (30, 1, 0.30), (40, 1, 0.29),
                (50, 1, 0.28)]
        return judge(rows, [{"step": 10, "kind": "narrowing"}], (1, 20, 0.38), 50, live=1, se=0.02)

    run(start=0.37)  # 0.01 above the start: half a standard error, nothing learnt
    run(start=0.36)  # 0.02: one standard error, still within 1.5
    assert rolled == []
    run(start=0.30)  # 0.08 above the start: 4 standard errors, learnt; the fall to 0.29 rolls back
    assert rolled == [1]
