"""A population that earns its compute, in the loop: narrowing as the budget is spent (released members,
exact resume, the record), ranking on training rewards, the selection's signal-to-noise, model-based explore."""

import math

import pytest
import torch
from conftest import StopAt, make_grpo

from evollm.hpo import HyperparameterConfig, Mutations, Narrowing, RLParameter, TournamentSelection
from evollm.run import list_checkpoints
from evollm.training.loop import finetune_llm_reasoning


def _env(tok, digits=(1, 1)):
    from evollm.envs.reasoning import ReasoningGym
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward

    train, test = arithmetic_dataset(n_train=64, n_test=8, digits=digits, seed=0)
    return ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)


def _run(ckpt=None, resume=False, callbacks=(), n=4, max_steps=6, narrowing=None, fitness="last", mutation=None,
         evaluation_interval=2, evo_steps=2, cache_dir=None, protect_default=0.0, lr_range=(1e-4, 1e-2),
         verbose=False, **options):
    from evollm.recipes.warm_start import load_tiny_model

    torch.manual_seed(0)
    model, tok = load_tiny_model(warm_start=cache_dir is not None, cache_dir=cache_dir, seed=0)
    hp = HyperparameterConfig(lr=RLParameter(min=lr_range[0], max=lr_range[1], log=True))
    pop = make_grpo(model, tok, n=n, hp_config=hp)
    return finetune_llm_reasoning(
        pop, _env(tok, (1, 2) if cache_dir else (1, 1)), max_steps=max_steps, evaluation_interval=evaluation_interval, evo_steps=evo_steps,
        verbose=verbose, seed=0,
        tournament=TournamentSelection(2, True, n, fitness=fitness, rand_seed=0, protect_default=protect_default)
        if evo_steps else None,
        mutation=(mutation or Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0)) if evo_steps else None,
        narrowing=narrowing,
        callbacks=callbacks, checkpoint_dir=ckpt, checkpoint_every=1 if ckpt else None, keep_checkpoints=2,
        resume=resume, **options)


def test_a_narrowing_says_how_informed_its_ranking_was_and_when_its_cut_fell_between_equal_scores(capsys):
    """The log gives the ranking's signal-to-noise. The untrained tiny model answers none of the test
    questions: every member's fitness is 0, the cut is decided by the tie rule (lower ids), and the record
    and the log say so."""
    _, record = _run(narrowing=Narrowing(at=(0.3,), keep=0.5, min_size=2), verbose=True)
    snr = record.selections().query("kind == 'narrowing'").iloc[0]["snr"]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("narrowing at step"))
    assert f"ranking signal-to-noise {snr:.2f}" in line
    assert ("mostly noise" in line) == (snr < 1)
    row = record.selections().query("kind == 'narrowing'").iloc[0]
    scores = {int(k): float(v) for k, v in (kv.split(":") for kv in row["scores"].split())}
    kept, dropped = [int(i) for i in row["kept"].split()], [int(i) for i in row["dropped"].split()]
    assert row["tied"] == (min(scores[k] for k in kept) == max(scores[d] for d in dropped))
    assert row["tied"] and len(set(scores.values())) == 1  # this run: every score alike
    assert kept == sorted(scores)[:2]
    assert "the cut fell between equal scores" in line
    assert record.selections().query("kind == 'selection'")["tied"].isna().all()  # tournaments: not told


def test_a_tied_ranking_with_one_rung_on_ties_narrows_one_milestone_at_a_time(capsys):
    """Every member of the untrained tiny model scores 0: with on_tie one_rung the three milestones due at the
    first evaluation (step 2 of 6, a third of the budget) narrow 4 -> 2 there, and the log says what waits, and
    2 -> 1 at the next one; with on_tie cut all of them act at once (4 -> 1). pair_cut off: with it the selection
    among the two left at step 2 would be the last cut there."""
    _, record = _run(narrowing=Narrowing(at=(0.1, 0.2, 0.3), keep=0.5, on_tie="one_rung", pair_cut=False), verbose=True)
    rows = record.selections().query("kind == 'narrowing'")
    assert [(int(r.step), int(r.size_before), int(r.size_after)) for r in rows.itertuples()] == [(2, 4, 2), (4, 2, 1)]
    assert rows["tied"].all() and list(rows["deferred"]) == [2, 0]  # what waited, in selections() too
    first = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("narrowing at step 2"))
    assert "2 more milestone(s) wait for the next ranking" in first
    _, record = _run(narrowing=Narrowing(at=(0.1, 0.2, 0.3), keep=0.5, on_tie="one_rung", tie_se=1.0, pair_cut=False),
                     verbose=True)
    rows = record.selections().query("kind == 'narrowing'")  # every score alike: tied whatever the errors
    assert [(int(r.step), int(r.size_before), int(r.size_after)) for r in rows.itertuples()] == [(2, 4, 2), (4, 2, 1)]
    first = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("narrowing at step 2"))
    assert "the cut fell between scores within 1 standard errors" in first
    _, record = _run(narrowing=Narrowing(at=(0.1, 0.2, 0.3), keep=0.5))
    rows = record.selections().query("kind == 'narrowing'")
    assert [(int(r.step), int(r.size_before), int(r.size_after)) for r in rows.itertuples()] == [(2, 4, 1)]
    # with evaluate, the deferred milestone does not bring an evaluation forward (to step 2): it waits for the
    # next regular one, at step 6 (step 1's evaluation, brought forward by the first cut, took step 3's place)
    _, record = _run(narrowing=Narrowing(at=(0.05, 0.1), keep=0.5, on_tie="one_rung", evaluate=True, pair_cut=False), max_steps=9,
                     evaluation_interval=3, evo_steps=3)
    rows = record.selections().query("kind == 'narrowing'")
    assert [(int(r.step), int(r.size_before), int(r.size_after)) for r in rows.itertuples()] == [(1, 4, 2), (6, 2, 1)]
    assert sorted(set(record.report()["step"])) == [1, 6, 9]


def test_with_pair_cut_a_selection_among_the_last_two_members_is_the_last_cut(capsys):
    """With pair_cut false the cut to two members at step 2 is followed, on the same ranking, by a selection that
    replaces the loser with a mutated clone of the winner, and the member and its clone race to the cut at 80 %
    of the budget (step 8). With pair_cut that selection is the last cut: the same winner trains alone from
    step 2, no clone is made, and the log and the record say so."""
    schedule = dict(at=(0.1, 0.8), keep=0.5, revive=False)  # no stall swap: the member kept trains to the end
    _, base = _run(narrowing=Narrowing(**schedule, pair_cut=False), max_steps=10)
    rows = base.selections()
    cuts = rows.query("kind == 'narrowing'")
    assert [(int(r.step), int(r.size_before), int(r.size_after)) for r in cuts.itertuples()] == [(2, 4, 2), (8, 2, 1)]
    first = rows.query("kind == 'selection'").iloc[0]
    assert int(first["step"]) == 2  # the selection among the two on the cut's own ranking
    assert base.lineage()["parent"].notna().any()  # its clones
    agents, record = _run(narrowing=Narrowing(**schedule), max_steps=10, verbose=True)  # the default: pair_cut
    rows = record.selections()
    cuts = rows.query("kind == 'narrowing'")
    assert [(int(r.step), int(r.size_before), int(r.size_after)) for r in cuts.itertuples()] == [(2, 4, 2), (2, 2, 1)]
    assert rows.query("kind == 'selection'").empty and record.lineage()["parent"].isna().all()  # no clone made
    assert [int(a.index) for a in agents] == [int(cuts.iloc[1]["best"])] == [int(first["best"])]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("narrowing at step 2") and "pair_cut" in x)
    assert "a selection among the last two members was due, so it is the last cut" in line
    assert Narrowing(**schedule).cuts_pair(2) and not Narrowing(**schedule, pair_cut=False).cuts_pair(2)
    assert not Narrowing(**schedule, min_size=2).cuts_pair(2)  # the schedule never goes to one


def test_a_clock_of_the_callers_own_drives_the_budget_and_the_narrowing(capsys):
    """``max_time_clock`` may be a callable (e.g. a clock charging a cost model): here one second per step.
    With max_time 5 the run stops after step 5 of 100; the cut at 30 % comes at the first step past 1.5
    seconds (step 2), whatever the wall or CPU clock says."""
    from evollm.training.callbacks import Callback

    seconds = [0.0]

    class Tick(Callback):
        def on_step_end(self, state, metrics):
            seconds[0] += 1.0

    def one_second_per_step():
        return seconds[0]

    agents, record = _run(narrowing=Narrowing(at=(0.3,), keep=0.5, min_size=2), max_steps=100, callbacks=[Tick()],
                          max_time=5.0, max_time_clock=one_second_per_step, verbose=True)
    assert int(record.report()["step"].max()) == 5
    row = record.selections().query("kind == 'narrowing'").iloc[0]
    assert (row["step"], row["size_after"]) == (2, 2) and row["budget_fraction"] == pytest.approx(0.4)
    assert "max_time=5s (test_a_clock_of_the_callers_own_drives_the_budget_and_the_narrowing.<locals>." \
        "one_second_per_step clock) reached after 5 steps" in capsys.readouterr().out


def test_narrowing_releases_the_worst_members_and_records_them():
    agents, record = _run(narrowing=Narrowing(at=(0.3,), keep=0.5, min_size=2))
    assert len(agents) == 2
    sel = record.selections()
    narrow = sel[sel["kind"] == "narrowing"]
    assert len(narrow) == 1
    row = narrow.iloc[0]
    # 0.3 of 6 steps is reached at step 2, the first evaluation at or after it
    assert (row["step"], row["size_before"], row["size_after"]) == (2, 4, 2)
    dropped = [int(i) for i in row["dropped"].split()]
    assert len(dropped) == 2 and row["budget_fraction"] == pytest.approx(2 / 6)
    scores = dict(map(lambda kv: (int(kv.split(":")[0]), float(kv.split(":")[1])), row["scores"].split()))
    kept = [int(i) for i in row["kept"].split()]
    assert min(scores[k] for k in kept) >= max(scores[d] for d in dropped)
    shared = agents[0].shared
    for index in dropped:  # released: adapters gone from the shared base
        assert not shared.has_adapter(shared.member_adapter(index))
    report = record.report()
    assert (report[report["step"] > 2].groupby("step").size() == 2).all()  # two members evaluated from then on
    assert set(report[report["step"] > 2]["member"]).isdisjoint(dropped)
    later = sel[(sel["kind"] == "selection") & (sel["step"] > 2)]
    assert (later["size_before"] == 2).all()  # selection goes on over the narrowed population


def test_narrowing_to_one_member_ends_evolution_and_the_survivor_trains_on():
    agents, record = _run(narrowing=Narrowing(at=(0.2, 0.4), keep=0.5, min_size=1), max_steps=8)
    assert len(agents) == 1  # 4 -> 2 -> 1, below the tournament's 2 members
    sel = record.selections()
    narrow = sel[sel["kind"] == "narrowing"]
    assert list(narrow["size_after"]) == [2, 1]
    last_narrowing = int(narrow["step"].max())
    assert not (sel[(sel["kind"] == "selection")]["step"] > last_narrowing).any()  # no selection of one member
    report = record.report()
    survivor = agents[0].index
    steps = sorted(report[report["member"] == survivor]["step"])
    assert steps[-1] == 8 and set(report[report["step"] > last_narrowing]["member"]) == {survivor}


def test_a_milestone_between_evaluations_brings_the_evaluation_forward():
    """With held-out ranking a cut due between two evaluations brings the next one forward, so it falls at its
    fraction of the budget (step 3 of 12 for 0.25), not at the next regular evaluation (step 4); that interval's
    evaluation is not repeated at step 4, so the run evaluates as often as with evaluate=False, which waits.
    The selection due at step 4 ranks on the evaluation of step 3."""
    for evaluate, cut_at in ((True, 3), (False, 4)):
        agents, record = _run(narrowing=Narrowing(at=(0.25,), keep=0.5, min_size=2, evaluate=evaluate), n=4,
                              max_steps=12, evaluation_interval=4, evo_steps=4)
        narrow = record.selections().query("kind == 'narrowing'")
        assert list(narrow["step"]) == [cut_at] and list(narrow["size_after"]) == [2]
        report = record.report()
        assert sorted(set(report["step"])) == [cut_at, 8, 12]  # three evaluations either way, then the rhythm
        assert (report[report["step"] == cut_at].groupby("step").size() == 4).all()  # every member, before the cut
        assert list(record.selections().query("kind == 'selection'")["step"]) == [4, 8]
        assert len(agents) == 2


def test_a_protected_default_founder_survives_narrowing_on_noise_and_is_the_member_returned(cache_dir):
    kw = dict(n=4, fitness="train", evaluation_interval=4, evo_steps=3, max_steps=8, cache_dir=cache_dir,
              narrowing=None, lr_range=(1e-5, 1e-2))  # GRPO's default lr 5e-5 inside: a default founder
    agents, record = _run(**{**kw, "narrowing": Narrowing(at=(0.25, 0.5), keep=0.5, min_size=1)},
                          protect_default=1e6)  # no difference in 8 steps can be beyond this much noise
    assert [a.index for a in agents] == [0] and agents[0].default_founder  # kept at every milestone
    assert agents[0].lr == 5e-5  # GRPO's default: never mutated (the elite of every selection)
    narrow = record.selections()
    narrow = narrow[narrow["kind"] == "narrowing"]
    assert list(narrow["size_after"]) == [2, 1] and (narrow["best"] == 0).all()
    assert (narrow["protected"] == "0").all()  # selections.csv says who had the benefit of the doubt
    assert (narrow["stderr"] > 0).all()  # rewards vary: the benefit of the doubt was finite and applied
    free, _ = _run(**{**kw, "narrowing": Narrowing(at=(0.25, 0.5), keep=0.5, min_size=1)})
    assert [a.index for a in free] != [0]  # unprotected, the noisier ranking lets it go


@pytest.mark.parametrize("at, evaluate", [((0.3, 0.6), False), ((0.15, 0.5), True)])  # cuts that evaluate: steps 1, 3
def test_resume_of_a_narrowing_run_is_exact(tmp_path, at, evaluate):
    narrowing = lambda: Narrowing(at=at, keep=0.5, min_size=2, evaluate=evaluate)  # noqa: E731
    agents, record = _run(narrowing=narrowing(), n=4, ckpt=tmp_path / "a")
    for stop in (1, 3):  # before and after the narrowing
        folder = tmp_path / f"b{stop}"
        with pytest.raises(KeyboardInterrupt):
            _run(folder, narrowing=narrowing(), callbacks=[StopAt(stop)])
        assert list_checkpoints(folder)[-1][0] == stop
        again, record2 = _run(folder, resume=True, narrowing=narrowing())
        assert [a.index for a in agents] == [a.index for a in again]
        assert record.report().equals(record2.report())
        assert record.lineage().equals(record2.lineage())
        assert record.selections().equals(record2.selections())
        for a, b in zip(agents, again):
            for (k, v), (k2, v2) in zip(a.shared.state_dict(a.adapter_name()).items(),
                                        b.shared.state_dict(b.adapter_name()).items()):
                assert k == k2 and torch.equal(v, v2)


def test_ranking_on_training_rewards_needs_no_fresh_evaluation_and_reports_its_noise(cache_dir):
    agents, record = _run(n=3, fitness="train", evaluation_interval=5, evo_steps=3, max_steps=7,
                          cache_dir=cache_dir)  # warm-started: rewards vary
    sel = record.selections()
    assert list(sel["step"]) == [3, 6] and (sel["source"] == "train").all()
    assert (sel["stderr"] > 0).all() and sel["spread"].notna().all()
    assert sel["snr"].equals(sel["spread"] / sel["stderr"])
    report = record.report()
    assert "fitness_se" in report.columns and (report["fitness_se"] >= 0).all()


def test_evaluation_fitness_carries_its_standard_error(cache_dir):
    agents, record = _run(n=2, max_steps=2, evo_steps=None, cache_dir=cache_dir)
    report = record.report()
    for _, row in report.iterrows():  # binary rewards on 8 prompts: sqrt(p (1 - p) / 7 * 8 / 8)
        p = row["fitness"]
        assert row["fitness_se"] == pytest.approx(math.sqrt(p * (1 - p) * 8 / 7 / 8), abs=1e-6)


def test_model_based_explore_reaches_the_members():
    mut = Mutations(no_mutation=0.0, rl_hp=1.0, model_prob=1.0, model_sampler="tpe", rand_seed=0)
    agents, record = _run(n=3, mutation=mut, max_steps=6)
    assert len(mut.observations) >= 3  # one per member from the second selection on
    lineage = record.lineage()
    clones = lineage[lineage["parent"].notna()]
    assert (clones["mutation"] == "lr").all() and len(clones) == 4
    assert ((clones["new_value"] >= 1e-4) & (clones["new_value"] <= 1e-2)).all()
    for agent in agents:
        assert agent.optimizer.param_groups[0]["lr"] == agent.config.lr


def test_a_cut_waits_for_a_member_to_learn_then_acts_at_wait_until(capsys):
    """wait_se: the untrained tiny model answers none of the test questions, so no member is above the start
    (0) at the cut due at step 2 (20 % of 10 steps): it waits at steps 2 and 4 (logged once) and acts at step 6,
    the first ranking at or past wait_until (60 %), recording the two rankings it waited; the tournament (every 2
    steps) waits with it. Where wait_until falls between evaluations, one is brought forward to it. A resumed run
    waits as the original would (the count is saved with the schedule). Off,
    it acts at step 2."""
    n = Narrowing(at=(0.2,), keep=0.5, wait_se=2.0, wait_until=0.6)
    _, record = _run(narrowing=n, max_steps=10, verbose=True)
    rows = record.selections().query("kind == 'narrowing'")
    assert [(int(r.step), int(r.size_before), int(r.size_after), int(r.waited)) for r in rows.itertuples()] == \
        [(6, 4, 2, 2)]
    assert n.waited == 0  # the cut acted: nothing waits now
    selections = record.selections().query("kind == 'selection'")
    assert not set(selections["step"]) & {2, 4} and 8 in set(selections["step"])  # no tournament while it waits
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("narrowing at step")]
    assert [x.split(" (")[0] for x in lines] == ["narrowing at step 2", "narrowing at step 6"]  # the wait, once
    assert "waits: no member scores 2 standard errors above the start (0.000)" in lines[0] and "60%" in lines[0]
    assert "it waited 2 ranking(s) for a member to learn" in lines[1]
    _, record = _run(narrowing=Narrowing(at=(0.2,), keep=0.5), max_steps=10)
    rows = record.selections().query("kind == 'narrowing'")
    assert [(int(r.step), int(r.waited)) for r in rows.itertuples()] == [(2, 0)]
    # evaluations every 4 steps: the wait from step 4 ends at wait_until (step 6), which brings an evaluation
    # forward to cut there (that interval's step-8 evaluation is not repeated): the search costs no more than 60 %
    _, record = _run(narrowing=Narrowing(at=(0.2,), keep=0.5, wait_se=2.0, wait_until=0.6), max_steps=10,
                     evaluation_interval=4, evo_steps=4)
    rows = record.selections().query("kind == 'narrowing'")
    assert [(int(r.step), int(r.waited)) for r in rows.itertuples()] == [(6, 1)]
    assert sorted(set(record.report()["step"])) == [4, 6, 10]
    waiting = Narrowing(at=(0.2,), wait_se=2.0)
    waiting.waited = 1
    resumed = Narrowing(at=(0.2,), wait_se=2.0)
    resumed.load_state_dict(waiting.state_dict())
    assert resumed.waited == 1 and resumed.wait_until == 0.2  # default: the last fraction of `at`


def test_a_cut_that_waits_acts_once_a_member_scores_above_the_start(monkeypatch):
    """The rule on scripted scores: the first evaluation's median (0.40) is the start; a member at 0.46 with a
    standard error of 0.035 (1.7 se above) does not end the wait with wait_se 2, one at 0.48 (2.3 se) does,
    and the cut then ranks as usual."""
    from types import SimpleNamespace

    from evollm.run.population import Population
    from evollm.training.cuts import narrow_population

    agents = [SimpleNamespace(index=i, fitness=[0.40], quarantined=False, default_founder=i == 0, scores=[0.0],
                              released=False) for i in range(4)]
    for a in agents:
        a.release = lambda a=a: setattr(a, "released", True)
    record = Population(agents)
    record.record_evaluation(2, agents, [0.40, 0.39, 0.41, 0.40], extra={a.index: {"fitness_se": 0.035} for a in agents})
    n = Narrowing(at=(0.2,), keep=0.5, wait_se=2.0, wait_until=0.9, revive=False)
    for step, best in ((4, 0.46), (6, 0.48)):
        for a, f in zip(agents, (0.40, 0.39, 0.41, best)):
            a.fitness.append(f)
        record.record_evaluation(step, agents, [a.fitness[-1] for a in agents],
                                 extra={a.index: {"fitness_se": 0.035} for a in agents})
        kept, result = narrow_population(agents, n, step, 10, None, None, record)
        if step == 4:
            assert result is None and n.waited == 2 - 1 and len(kept) == 4
    assert result is not None and [a.index for a in kept] == [2, 3]
    assert int(record.selections().iloc[-1]["waited"]) == 1 and n.waited == 0


def test_rankings_on_the_last_evaluation_report_their_noise_paired_over_the_same_questions(cache_dir, capsys):
    """Every member answers the same test questions, so a ranking's noise is that of the differences between
    members, question by question: the warm-started members, a few steps from one start, agree on most
    questions, and the paired standard error is below the unpaired one. Rankings on a mean of evaluations
    have no single evaluation to pair on: NaN. Rates of 1e-3 to 3e-2, so that members two steps from one start
    answer some questions differently on any CPU (with 1e-4 to 1e-2 every member gave the same answers on one
    machine, an Intel Xeon, so every ranking's paired error was 0; it had passed on AMD EPYC machines)."""
    _, record = _run(n=4, max_steps=6, evaluation_interval=2, evo_steps=2, cache_dir=cache_dir, verbose=True,
                     narrowing=Narrowing(at=(0.5,), keep=0.5, min_size=2), lr_range=(1e-3, 3e-2))
    sel = record.selections()
    assert (sel["paired_stderr"] >= 0).all() and (sel["paired_stderr"] < sel["stderr"]).all()
    assert (sel["paired_stderr"] > 0).any()  # 0: two members that gave the same answers (a clone and its parent)
    assert sel["paired_snr"].equals((sel["spread"] / sel["paired_stderr"]).where(sel["paired_stderr"] > 0))
    row = sel.query("kind == 'narrowing'").iloc[0]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("narrowing at step"))
    assert f"({row['paired_snr']:.2f} paired over the same items)" in line
    assert ("mostly noise" in line) == (row["paired_snr"] < 1)

    _, record = _run(n=3, max_steps=4, evaluation_interval=2, evo_steps=2, cache_dir=cache_dir, fitness="mean")
    assert record.selections()["paired_snr"].isna().all() and record.selections()["snr"].notna().all()
