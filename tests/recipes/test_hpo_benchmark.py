"""The equal-compute HPO benchmark (benchmarks/hpo) runs end to end on a tiny task: every arm, one seed,
a budget of a fraction of a CPU second. Checks the JSON it writes and its budget accounting (no timings)."""

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
seed: 0
threads: 1
model: {source: tiny, warm_start: false}
task: {name: arithmetic, n_train: 64, n_test: 16, ops: ["+"], digits: [1, 1], reward: exact_match}
env: {type: reasoning, data_batch_size_per_gpu: 4}
algorithm:
  name: GRPO
  lora: {r: 4, lora_alpha: 8}
  hyperparameters: {group_size: 4, batch_size: 16, max_output_tokens: 3}
train: {evaluation_interval: 1}
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from benchmarks.hpo.run import main

    tmp = tmp_path_factory.mktemp("hpo")
    config = tmp / "task.yaml"
    config.write_text(CONFIG)
    out = tmp / "bench"
    rc = main(["--config", str(config), "--seeds", "1", "--budget-cpu-s", "0.6", "--checkpoints", "2",
               "--trial-steps", "2", "--grid-points", "1", "--report-size", "8", "--in-process",
               "--evo-set", "hpo.selection.window=5",  # an ablation of the population arms only
               "--variant", "w3=hpo.selection.window=3",  # evollm with an override of its own, side by side
               "--out", str(out), "--parts-dir", str(tmp / "parts")])
    assert rc == 0
    return json.loads(out.with_suffix(".json").read_text()), out


def test_every_arm_runs_once_per_seed_and_stops_at_its_budget(result):
    doc, out = result
    arms = {r["arm"] for r in doc["runs"]}
    assert {"evollm", "no_mutation", "tpe", "random", "default"} <= arms
    assert any(a.startswith("grid:lr=") for a in arms)
    assert out.with_suffix(".png").stat().st_size > 0 and "evollm" in out.with_suffix(".md").read_text()
    for run in doc["runs"]:
        assert run["seed"] == 0 and run["budget_cpu_s"] == 0.6
        assert run["cpu_s"] >= 0.6  # an arm stops at the first step end past its budget, never before
        fractions = [c["fraction"] for c in run["checkpoints"]]
        assert fractions == [0.5, 1.0]
        for c in run["checkpoints"]:
            assert c["cpu_s"] >= c["fraction"] * 0.6
            assert 0.0 <= c["score"] <= 1.0 and c["se"] >= 0.0  # scored on the 8 report questions
        assert run["report_size"] == 8 and run["validation_size"] == 8
    # the machine's CPU and package versions are recorded: the tiny task's warm start depends on the CPU
    import torch
    machine = doc["machine"]
    assert machine["cpus"] >= 1 and machine["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["versions"]["torch"] == torch.__version__ and "transformers" in machine["versions"]
    # and how fast it was when each run's worker started (the speed of a shared machine drifts)
    assert all(0.0 < run["setup"]["speed_probe_cpu_s"] < 60.0 for run in doc["runs"])


def test_arms_differ_as_documented(result):
    doc, _ = result
    runs = {r["arm"]: r for r in doc["runs"]}
    evo, frozen = runs["evollm"], runs["no_mutation"]
    assert evo["population_size"] == frozen["population_size"] > 1
    assert frozen["mutation"]["no_mutation"] == 1.0 and frozen["mutation"]["rl_hp"] == 0.0
    # selection only changes no hyperparameter: nor does its narrowing (the lone member's anneal, a roll-back's
    # rate, a stall swap's rate between two, the decay of a critic learner's rate, a faster member's pull)
    from evollm.hpo import Narrowing
    library = Narrowing()  # evollm gets the library's own
    assert evo["narrowing"]["anneal"] is library.anneal and evo["narrowing"]["rollback_lr"] == library.rollback_lr
    assert evo["narrowing"]["decay"] == library.decay and evo["narrowing"]["faster_se"] == library.faster_se > 0
    assert frozen["narrowing"]["anneal"] is False and frozen["narrowing"]["rollback_lr"] == 1.0
    assert frozen["narrowing"]["revive_rate"] == "own" and frozen["narrowing"]["decay"] == "none"
    assert frozen["narrowing"]["faster_se"] == 0
    assert frozen["narrowing"]["rollback"] == evo["narrowing"]["rollback"]  # returning to the best state is selection
    assert evo["selection"]["window"] == frozen["selection"]["window"] == 5  # --evo-set reached both
    assert runs["evollm:w3"]["selection"]["window"] == 3  # the variant's own override, after --evo-set
    assert runs["evollm:w3"]["mutation"] == evo["mutation"]
    assert evo["founders"][0] == runs["default"]["hyperparameters"]  # the default founder: the default run's values
    assert len({f["lr"] for f in evo["founders"]}) == evo["population_size"]  # founders spread over the space
    # every ranking with its signal-to-noise, unpaired and paired over the same questions
    assert evo["rankings"] and all(r["kind"] in ("selection", "narrowing") for r in evo["rankings"])
    assert all(set(r) >= {"snr", "paired_snr", "size_before", "size_after"} for r in evo["rankings"])
    assert runs["default"]["fixed"] == {}
    # the single run evaluates as `evollm train` does (every train.evaluation_interval steps), like each member
    assert all(len(e["members"]) == 1 for e in runs["default"]["evaluations"])
    assert 1 <= len(runs["default"]["evaluations"]) <= runs["default"]["steps"]
    for arm in ("tpe", "random"):
        trials = runs[arm]["trials"]
        assert trials and all(1e-5 <= t["hyperparameters"]["lr"] <= 1e-2 for t in trials)
        finished = [t for t in trials if t["finished"]]
        assert all(t["value"] is not None for t in finished)
    grid = next(r for a, r in runs.items() if a.startswith("grid:"))
    assert grid["hyperparameters"]["lr"] == pytest.approx(float(grid["arm"].split("=")[1]))


def test_summary_pairs_every_arm_with_evollm(result):
    doc, out = result
    arms = doc["summary"]["arms"]
    assert set(arms) >= {"evollm", "no_mutation", "tpe", "random", "default", "grid_best"}
    for name, row in arms.items():
        assert len(row["by_checkpoint"]) == 2
        if name != "evollm":
            diff = row["evollm_minus_arm"][0]
            ours = doc["runs"][[r["arm"] for r in doc["runs"]].index("evollm")]["checkpoints"][-1]["score"]
            assert math.isfinite(diff) and -1.0 <= diff <= 1.0 and math.isfinite(ours)
    assert doc["report_set_se"] >= 0.0  # the standard error of one report evaluation (0 when all scores agree)
    md = Path(f"{out}.md").read_text()
    assert "- variant evollm:w3 − evollm, final (paired)" in md and "| evollm:w3 | 1 |" in md


def test_a_variant_is_named_once_per_override():
    from benchmarks.hpo.run import main, variants_of
    assert variants_of(["a=x.y=1", "b=x.z=[1, 2]", "a=x.w=q"]) == {"a": ["x.y=1", "x.w=q"], "b": ["x.z=[1, 2]"]}
    with pytest.raises(SystemExit):
        main(["--config", "x.yaml", "--budget-cpu-s", "1", "--variant", "no-override"])


def test_the_lr_decay_experiment_by_hand():
    from benchmarks.hpo.arms import decay_multiplier
    assert decay_multiplier("cosine", 0.0, 0.1) == pytest.approx(1.0)
    assert decay_multiplier("cosine", 0.5, 0.1) == pytest.approx(0.55)      # half way down the half cosine
    assert decay_multiplier("cosine", 1.0, 0.1) == pytest.approx(0.1)
    assert decay_multiplier("linear", 0.25, 0.0) == pytest.approx(0.75)
    assert decay_multiplier("linear", 1.7, 0.2) == pytest.approx(0.2)       # past the budget: the floor
    assert decay_multiplier("wsd", 0.5, 0.1, cooldown=0.2) == pytest.approx(1.0)   # constant until the last fifth
    assert decay_multiplier("wsd", 0.95, 0.0, cooldown=0.2) == pytest.approx(0.25)  # a quarter of the cooldown left


def _run(arm, seed, scores):
    k = len(scores)
    return {"arm": arm, "seed": seed, "checkpoints": [{"fraction": (i + 1) / k, "score": s} for i, s in enumerate(scores)]}


def test_the_half_budget_target_is_judged_at_half_the_budget_or_said_not_measured():
    from benchmarks.hpo import stats
    assert [stats.half_checkpoint(k) for k in (1, 2, 3, 4, 6, 8)] == [-1, 0, 0, 1, 2, 3]
    # four checkpoints: the second is at 1/2; evollm 0.5 there against the default's final 0.6 -> no
    runs = [_run("evollm", 0, [0.3, 0.5, 0.7, 0.8]), _run("default", 0, [0.2, 0.4, 0.5, 0.6])]
    summary = stats.summarise(runs, 4)
    assert summary["half_fraction"] == 0.5
    assert summary["arms"]["evollm"]["half_minus_default_final"][0] == pytest.approx(-0.1)
    assert "score at 1/2 of the budget" in stats.verdict(summary) and stats.verdict(summary).endswith("**no**")
    # three checkpoints: none at 1/2; behind at 1/3 is not a "no" ...
    runs = [_run("evollm", 0, [0.3, 0.7, 0.8]), _run("default", 0, [0.2, 0.5, 0.6])]
    summary = stats.summarise(runs, 3)
    assert summary["half_fraction"] == pytest.approx(1 / 3)
    assert "**not measured**" in stats.verdict(summary) and "0.33 (no checkpoint at 1/2)" in stats.table(summary, 3)
    # ... and ahead at 1/3 is a "yes": the default's final score was reached before half the budget
    runs = [_run("evollm", 0, [0.65, 0.7, 0.8]), _run("default", 0, [0.2, 0.5, 0.6])]
    assert "**yes**" in stats.verdict(stats.summarise(runs, 3)).splitlines()[1]


def test_the_best_fixed_setting_at_half_the_budget_bounds_the_second_target():
    """Each fixed setting's score at half the budget against the default run's final, paired by seed; the best,
    chosen after the fact, is said in the verdict (no search returning one fixed setting does better there)."""
    from benchmarks.hpo import stats
    runs = [dict(_run("default", s, [0.2, 0.4, 0.5, 0.6 + s / 10]), hyperparameters={"lr": 1e-4}) for s in (0, 1)]
    runs += [_run("grid:lr=0.0003", s, [0.3, 0.55, 0.7, 0.8]) for s in (0, 1)]
    runs += [_run("grid:lr=0.001", s, [0.4, 0.6 - s / 10, 0.6, 0.5]) for s in (0, 1)]
    runs += [_run("evollm", s, [0.3, 0.5, 0.6, 0.7]) for s in (0, 1)]
    fixed = stats.summarise(runs, 4)["fixed_at_half"]
    assert fixed["grid:lr=0.0001 (default)"] == pytest.approx((-0.25, 0.05))   # 0.4 - 0.6, 0.4 - 0.7
    assert fixed["grid:lr=0.0003"] == pytest.approx((-0.1, 0.05))              # 0.55 - 0.6, 0.55 - 0.7
    assert fixed["grid:lr=0.001"] == pytest.approx((-0.1, 0.1))                # 0.6 - 0.6, 0.5 - 0.7
    line = [x for x in stats.verdict(stats.summarise(runs, 4)).splitlines() if "best fixed setting" in x][0]
    assert "(lr=0.0003)" in line and "−0.100 ± 0.050" not in line and "-0.100 ± 0.050" in line
    # the grid's best by final score is a different point (0.8 against 0.65 and 0.55)
    assert stats.summarise(runs, 4)["grid_choice"] == "grid:lr=0.0003"


def test_workers_take_every_arm_in_turn():
    """Each arm runs on every worker (a slow core must not slow one arm only); finished jobs are left out."""
    from benchmarks.hpo.run import deal

    jobs = [(arm, seed) for seed in range(4) for arm in ("evollm", "default", "tpe")]
    shares = deal(jobs, 2)
    assert sorted(j for share in shares for j in share) == sorted(jobs)
    for share in shares:
        assert {arm for arm, _ in share} == {"evollm", "default", "tpe"}
        assert abs(len(share) - len(jobs) / 2) <= 1
    left = deal(jobs, 2, done=lambda job: job[1] < 3)
    assert sorted(j for share in left for j in share) == [j for j in sorted(jobs) if j[1] == 3]


def test_two_parts_directories_are_compared_seed_by_seed(tmp_path):
    """benchmarks.hpo.paired: A − B per checkpoint over the seeds both directories hold, by hand."""
    from benchmarks.hpo.paired import compare, load

    for folder, arm, seed, scores in [("a", "evollm", 0, [0.3, 0.6]), ("a", "evollm", 1, [0.2, 0.4]),
                                      ("a", "evollm", 2, [0.9, 0.9]), ("b", "evollm", 0, [0.3, 0.5]),
                                      ("b", "evollm", 1, [0.2, 0.5]), ("b", "default", 0, [0.1, 0.1])]:
        (tmp_path / folder).mkdir(exist_ok=True)
        run = {**_run(arm, seed, scores), "steps": 10 + seed, "recommended_hyperparameters": {"lr": 1e-4}}
        (tmp_path / folder / f"{arm}_seed{seed}.json").write_text(json.dumps(run))
    _, a = load(str(tmp_path / "a"))
    _, b = load(str(tmp_path / "b"))
    assert sorted(a) == [0, 1, 2] and sorted(b) == [0, 1]  # evollm's runs only, by default
    lines = compare(a, b, 2)
    assert lines[0] == "seeds: [0, 1]"  # seed 2 is in A alone
    assert lines[1] == "at 1/2 of the budget: A − B +0.000 ± 0.000 (A ahead 0, behind 0, of 2)"
    assert lines[2] == "at 2/2 of the budget: A − B +0.000 ± 0.100 (A ahead 1, behind 1, of 2)"
    _, d = load(f"{tmp_path / 'b'}:default")
    assert compare(a, d, 2)[2].startswith("at 2/2 of the budget: A − B +0.500 (A ahead 1")
    # each run's last checkpoint, whatever the budgets: A given half of B's budget against B's final score
    (tmp_path / "h").mkdir()
    for seed, scores in ((0, [0.2, 0.7]), (1, [0.1, 0.4])):
        run = {**_run("evollm", seed, scores), "steps": 5, "budget_cpu_s": 20}
        (tmp_path / "h" / f"evollm_seed{seed}.json").write_text(json.dumps(run))
    _, h = load(str(tmp_path / "h"))
    b = {s: {**r, "budget_cpu_s": 40} for s, r in b.items()}
    line = next(x for x in compare(h, b, 2) if x.startswith("each run's last"))
    assert line == ("each run's last checkpoint (budgets [20] against [40] s): A − B +0.050 ± 0.150 "
                    "(A ahead 1, behind 1, of 2)")


def test_the_noise_floor_pairs_runs_that_handed_the_same_member_to_the_lone_phase(tmp_path, capsys):
    """benchmarks.hpo.noise_floor: only seeds whose first lone evaluation has the same step and hyperparameters
    count, read from a results JSON (FILE.json:ARM) and a parts directory alike; the spread by hand."""
    from benchmarks.hpo.noise_floor import floor_lines, main

    def run(arm, seed, lone_step, lr, final):
        evals = [{"step": 10, "members": [1, 2], "hyperparameters": [{"lr": 1e-4}, {"lr": lr}]},
                 {"step": lone_step, "members": [2], "hyperparameters": [{"lr": lr}]}]
        return {**_run(arm, seed, [final]), "evaluations": evals}

    a = [run("evollm", 0, 20, 2e-4, 0.7), run("evollm", 1, 20, 2e-4, 0.5), run("evollm", 2, 20, 3e-4, 0.6),
         run("evollm", 3, 30, 2e-4, 0.6)]
    (tmp_path / "a.json").write_text(json.dumps({"runs": a + [run("default", 0, 20, 2e-4, 0.1)]}))
    (tmp_path / "b").mkdir()
    for seed, lr, lone_step, final in ((0, 2e-4, 20, 0.6), (1, 2e-4, 20, 0.6), (2, 1e-4, 20, 0.6), (3, 2e-4, 20, 0.6)):
        (tmp_path / "b" / f"no_mutation_seed{seed}.json").write_text(json.dumps(run("no_mutation", seed, lone_step, lr, final)))
    assert main([f"{tmp_path / 'a.json'}:evollm", f"{tmp_path / 'b'}:no_mutation"]) == 0
    out = capsys.readouterr().out
    assert "4 seeds in both, seed 0: +0.100, seed 1: -0.100" in out  # seed 2: another lr; seed 3: another step
    assert "seed 2" not in out and "seed 3" not in out
    assert "2 same-lineage pairs: mean +0.000 ± 0.100, sd 0.141" in out
    assert floor_lines([0.1, -0.1], seeds=(2,))[1] == "  a paired mean over 2 seeds of noise alone has se 0.100 (2 se: 0.200)"
    assert floor_lines([0.1]) == ["1 same-lineage pair(s): too few for a spread"]


def test_a_run_starts_from_the_same_random_state_whether_or_not_it_is_its_workers_first(tmp_path):
    """The first run of a worker also scores the base model (building an adapter draws from torch's
    generator): the run itself must not depend on it, or a seed's result depends on the job order."""
    import numpy as np
    import torch

    from benchmarks.hpo.run import start_run
    from benchmarks.hpo.task import load_task
    from evollm.config import RunConfig

    config = tmp_path / "task.yaml"
    config.write_text(CONFIG)
    cfg = RunConfig.from_yaml(str(config))
    task = load_task(cfg, 8)
    setup: dict = {}
    start_run(task, cfg, 3, setup)  # the worker's first run: evaluates the base model
    first = (torch.get_rng_state(), np.random.get_state()[1].copy())
    assert "initial" in setup
    torch.manual_seed(123)  # whatever the previous run left
    start_run(task, cfg, 3, setup)
    assert torch.equal(first[0], torch.get_rng_state()) and np.array_equal(first[1], np.random.get_state()[1])


def test_a_run_leaves_the_workers_base_as_it_found_it(tmp_path, monkeypatch):
    """Every adapter a run made (its last members, the kept best state) is deleted after it is scored: the
    next run of the same worker starts on the same base, not one carrying every earlier run's adapters."""
    import benchmarks.hpo.run as run
    from benchmarks.hpo import task as task_module

    loaded, load = [], task_module.load_task

    def spy(*a, **k):
        loaded.append(load(*a, **k))
        return loaded[-1]

    monkeypatch.setattr(task_module, "load_task", spy)
    config = tmp_path / "task.yaml"
    config.write_text(CONFIG)
    rc = run.main(["--config", str(config), "--seeds", "2", "--budget-cpu-s", "0.4", "--checkpoints", "1",
                   "--arms", "evollm", "default", "--grid-points", "0", "--report-size", "8", "--in-process",
                   "--out", str(tmp_path / "bench"), "--parts-dir", str(tmp_path / "parts")])
    assert rc == 0 and len(loaded) == 1
    assert len(run._adapters(loaded[0])) == 1  # the base model's scoring member's, which PEFT cannot drop


TEAM_CONFIG = """
seed: 0
threads: 1
model: {source: tiny_coop, warm_start: false}
task: {name: relay_sum}
env: {type: team}
algorithm:
  name: IPPO
  population_size: 2
  lora: {r: 4, lora_alpha: 8}
  hyperparameters: {num_agents: 2, num_turns: 2, max_new_tokens: 3, rollout_buffer_size: 8, mini_batch_size: 8,
                    ppo_epochs: 1}
train: {evaluation_interval: 1}
"""


def test_a_team_task_enters_the_benchmark_like_any_other(tmp_path):
    """An IPPO team config (env.type: team) runs through the same arms: the population of teams evolves the
    actors' learning rate (the library's default space), every checkpoint snapshots every agent's adapter
    and is scored on the report rows, which are cut from the evaluation rows like a single-turn task's."""
    from benchmarks.hpo.arms import actor_parameters, members_of, snapshot, with_overrides
    from benchmarks.hpo.run import main
    from benchmarks.hpo.task import load_task
    from evollm.config import RunConfig

    config = tmp_path / "team.yaml"
    config.write_text(TEAM_CONFIG)
    task = load_task(RunConfig.from_yaml(str(config)), 190)
    assert task.kind == "team" and (task.validation_size, task.report_size) == (10, 190)
    cfg = with_overrides(task.cfg, ["algorithm.population_size=1", "hpo={}"])
    team = members_of(cfg, task, None)[0]
    params = actor_parameters(team)
    assert len(params) == 2 * len(team.agents[0].shared.parameters(team.agents[0].adapter_name()))  # both agents
    assert all(torch_equal(a, b) for a, b in zip(snapshot(team), params))
    team.release()

    out = tmp_path / "bench"
    rc = main(["--config", str(config), "--seeds", "1", "--budget-cpu-s", "0.5", "--checkpoints", "2",
               "--arms", "evollm", "default", "--grid-points", "0", "--report-size", "190", "--in-process",
               "--out", str(out), "--parts-dir", str(tmp_path / "parts")])
    assert rc == 0
    runs = {r["arm"]: r for r in json.loads(out.with_suffix(".json").read_text())["runs"]}
    assert runs["evollm"]["population_size"] == 2
    assert runs["evollm"]["founders"][0] == {"actor_learning_rate": 1e-4}  # the default founder
    assert 1e-5 <= runs["evollm"]["founders"][1]["actor_learning_rate"] <= 1e-3
    for run in runs.values():
        assert run["report_size"] == 190 and run["validation_size"] == 10
        assert all(0.0 <= c["score"] <= 1.0 for c in run["checkpoints"]) and len(run["checkpoints"]) == 2


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)


def test_the_gpu_cost_model_by_hand():
    """step(N) = G + L*N fitted to the measurement's rows (G: mean generation time, L: mean learn time per
    member); a CPU second with N live members is charged step(N) / (N * step(1))."""
    from benchmarks.hpo.cost import fit_step_cost, load_step_cost

    rows = [{"members": 1, "generate_s": 3.0, "learn_s": 1.0}, {"members": 4, "generate_s": 1.0, "learn_s": 4.0}]
    cost = fit_step_cost(rows)
    assert (cost.generate_s, cost.learn_s_per_member) == (2.0, 1.0)
    assert cost.factor(1) == 1.0
    assert cost.factor(4) == pytest.approx((2 + 4) / (4 * 3))
    assert cost.factor(0) == 1.0  # no member live (between builds): a lone member's charge
    measured = load_step_cost()  # the stored H200 measurement: 8 members cost far less than 8 lone steps
    assert 0.1 < measured.factor(8) < 0.3 and measured.factor(2) > measured.factor(4) > measured.factor(8)
    with pytest.raises(ValueError, match="no rows"):
        fit_step_cost([])


def test_the_charged_clock_charges_each_second_at_the_size_it_was_spent_at(monkeypatch):
    from benchmarks.hpo import cost as cost_module
    from benchmarks.hpo.cost import ChargedClock, StepCost

    now = [100.0]
    monkeypatch.setattr(cost_module.time, "process_time", lambda: now[0])
    clock = ChargedClock(StepCost(2.0, 1.0))
    clock.set_members(4)  # factor 0.5
    now[0] += 2.0
    assert clock() == pytest.approx(1.0)
    clock.set_members(1)  # the 2 s before were spent by 4 members; from now on a lone member's
    now[0] += 3.0
    assert clock() == pytest.approx(4.0) and clock.raw() == pytest.approx(5.0)
    assert ChargedClock(None)() == 0.0  # no model: the CPU clock itself


def test_a_run_on_a_gpu_is_budgeted_in_wall_seconds(monkeypatch, tmp_path):
    """--device cuda: the arms share the GPU's time, so the budget's clock is the wall clock, not the
    process's CPU time, and the loop's narrowing reads that clock too."""
    from benchmarks.hpo import cost as cost_module
    from benchmarks.hpo.arms import Clock, budget_kwargs
    from evollm.config import RunConfig

    cpu, wall = [10.0], [500.0]
    monkeypatch.setattr(cost_module.time, "process_time", lambda: cpu[0])
    monkeypatch.setattr(cost_module.time, "perf_counter", lambda: wall[0])
    gpu_clock, cpu_clock = Clock(30.0, 2, wall=True), Clock(30.0, 2)
    cpu[0] += 1.0  # the process waits on the GPU: little CPU time, much wall time
    wall[0] += 7.0
    assert gpu_clock.cpu() == pytest.approx(7.0) and cpu_clock.cpu() == pytest.approx(1.0)
    config = tmp_path / "task.yaml"
    config.write_text(CONFIG)
    cfg = RunConfig.from_yaml(str(config))
    assert budget_kwargs(cfg, gpu_clock)["max_time_clock"] is gpu_clock.charged
    assert budget_kwargs(cfg, cpu_clock)["max_time_clock"] == "cpu"


def test_a_population_under_the_gpu_cost_model_gets_more_cpu_than_its_budget(tmp_path):
    """--cost-model gpu: the population arm is charged less than a CPU second per CPU second while several
    members are live, and the loop's narrowing schedule reads the same charged clock; the default run (a lone
    member) is charged its CPU seconds."""
    from benchmarks.hpo.run import main

    config = tmp_path / "task.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "bench"
    rc = main(["--config", str(config), "--seeds", "1", "--budget-cpu-s", "1.0", "--checkpoints", "2",
               "--arms", "evollm", "default", "--grid-points", "0", "--report-size", "8", "--in-process",
               "--cost-model", "gpu", "--out", str(out), "--parts-dir", str(tmp_path / "parts")])
    assert rc == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    runs = {r["arm"]: r for r in doc["runs"]}
    assert doc["setting"]["cost_model"] == "gpu"
    pop, single = runs["evollm"], runs["default"]
    assert pop["cost_model"]["factor"]["8"] < 0.3 and single["cost_model"]["factor"]["1"] == 1.0
    by_size = {int(n): s for n, s in pop["raw_cpu_s_by_members"].items()}
    assert by_size[8] > 0 and set(by_size) <= {1, 2, 4, 8}  # the narrowing's sizes, 8 from the first step
    charged = sum(s * pop["cost_model"]["factor"][str(n)] for n, s in by_size.items())
    assert charged == pytest.approx(pop["cpu_s"], rel=1e-3) and pop["cpu_s"] >= 1.0
    assert pop["raw_cpu_s"] > pop["cpu_s"]  # the population got more CPU seconds than its budget
    assert set(single["raw_cpu_s_by_members"]) == {"1"} and single["raw_cpu_s"] == pytest.approx(single["cpu_s"], rel=1e-3)


def test_ranking_noise_tabulates_each_kind_of_ranking_over_the_runs():
    """benchmarks.hpo.ranking_noise: per kind of ranking (largest first, narrowings before selections), the medians
    of snr and paired_snr over every ranking of that kind and how many each calls mostly noise (below 1); unknown
    values (NaN, None) are left out of both."""
    from benchmarks.hpo.ranking_noise import table

    cut = lambda snr, paired: {"kind": "narrowing", "size_before": 8, "size_after": 4, "snr": snr, "paired_snr": paired}
    pick = {"kind": "selection", "size_before": 4, "size_after": 4, "snr": 0.3, "paired_snr": 0.9}
    last = {"kind": "narrowing", "size_before": 4, "size_after": 1, "snr": 0.2, "paired_snr": None}
    lines = table([[cut(0.5, 2.0), pick, last], [cut(0.7, 0.8)], [cut(1.5, float("nan"))]])
    assert lines[2:] == ["| narrowing 8→4 | 3 | 0.70 | 1.40 | 2/3 | 1/2 |",
                         "| narrowing 4→1 | 1 | 0.20 | nan | 1/1 | 0/0 |",
                         "| selection 4→4 | 1 | 0.30 | 0.90 | 1/1 | 1/1 |"]


def test_cut_evidence_replays_a_rule_that_keeps_the_default_founder_on_weak_leads(tmp_path, capsys):
    """benchmarks.hpo.cut_evidence: for each first cut to one member with the default founder in it, the best
    member's lead over the default founder in standard errors, and the replayed rule (a seed it would have kept
    the default founder on counts as level with the default run); runs without such a cut are left out. And, over
    every run, how often the first ranking had nothing to rank on."""
    from benchmarks.hpo.cut_evidence import first_cuts, main

    def evo(seed, fitness, se, kept, final, size_after=1):
        hps = [{"lr": 1e-4}, {"lr": 8e-4}]
        evals = [{"step": 25, "members": [1, 2], "hyperparameters": hps, "fitness": fitness, "fitness_se": se},
                 {"step": 50, "members": [kept], "hyperparameters": [hps[kept - 1]]}]
        cut = {"kind": "narrowing", "step": 25, "size_before": 2, "size_after": size_after}
        return {**_run("evollm", seed, [final]), "founders": hps, "evaluations": evals, "rankings": [cut]}

    runs = [evo(0, [0.0, 0.1], [0.0, 0.05], 2, 0.3),     # lead 2 se, the fast member kept: -0.1
            evo(1, [0.1, 0.4], [0.05, 0.05], 2, 0.7),    # lead 4.2 se: +0.2
            evo(2, [0.1, 0.1], [0.05, 0.05], 1, 0.28),   # a tie, the default founder kept: -0.02
            evo(3, [0.0, 0.5], [0.0, 0.05], 2, 0.9),     # no default run for seed 3
            evo(4, [0.0, 0.5], [0.0, 0.05], 2, 0.9, size_after=2)]  # not a cut to one
    runs += [_run("default", s, [f]) for s, f in ((0, 0.4), (1, 0.5), (2, 0.3), (4, 0.1))]
    cuts = first_cuts({"runs": runs})
    assert [(c["seed"], round(c["z"], 2), c["kept_default"], round(c["diff"], 3)) for c in cuts] == \
        [(0, 2.0, False, -0.1), (1, 4.24, False, 0.2), (2, 0.0, True, -0.02)]
    (tmp_path / "hpo_t.json").write_text(json.dumps({"runs": runs}))
    assert main([str(tmp_path / "hpo_t.json"), "--thresholds", "1", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "t: first ranking at step 25 (narrowing 2→1: 4, narrowing 2→2: 1); every member's score equal on " \
        "1 seeds of 5, no member above the default founder on 1"
    # k = 1 keeps every cut as it was; k = 3 keeps the default founder on seed 0: [0, 0.2, -0.02]
    assert out[-1] == \
        "| t | 3 | +0.027 ± 0.090 | 1: -0.020 | 0 (+0.00); +0.027 ± 0.090 | 1 (-0.10); +0.060 ± 0.070 |"


def test_flat_cuts_counts_the_cuts_with_nothing_to_rank_on_that_leave_more_than_one_member(tmp_path, capsys):
    """benchmarks.hpo.flat_cuts: per task, the evollm runs' cuts, the flat ones (every score equal) that left more
    than one member, the runs with one and, of those, the runs returned at the default founder's rate; a run
    kept in two files counts once, other arms and files that are not results are left out."""
    from benchmarks.hpo.flat_cuts import flat_cuts, main

    def evo(seed, cuts, final_lr):
        rankings = [{"kind": "narrowing", "spread": spread, "size_after": after} for spread, after in cuts]
        rankings.append({"kind": "selection", "spread": 0.0, "size_after": 4})  # not a cut
        return {**_run("evollm", seed, [0.5]), "founders": [{"lr": 1e-4}, {"lr": 5e-4}], "rankings": rankings,
                "final_members": [{"lr": final_lr}]}

    runs = [evo(0, [(0.0, 4), (0.0, 2), (0.0, 1)], 1e-4),  # two flat cuts leaving more than one, the default rate
            evo(1, [(0.0, 2), (0.02, 1)], 5e-4),           # one, another rate returned
            evo(2, [(0.03, 4), (0.01, 2), (0.0, 1)], 1e-4),  # the flat cut left one member: not counted
            {**_run("default", 0, [0.4]), "rankings": [{"kind": "narrowing", "spread": 0.0, "size_after": 2}]}]
    for name in ("hpo_game_ppo.json", "hpo_game_ppo_again.json"):
        (tmp_path / name).write_text(json.dumps({"runs": runs}))
    (tmp_path / "hpo_notes.json").write_text("[1, 2]")
    paths = [str(p) for p in sorted(tmp_path.glob("*.json"))]
    assert flat_cuts(paths) == {"game_ppo": {"cuts": 8, "flat": 3, "runs": 2, "at_default": 1}}
    main(paths)
    assert capsys.readouterr().out.splitlines()[-1] == "| game_ppo | 8 | 3 | 2 | 1 |"


def test_the_verdicts_table_answers_both_questions_per_task_by_hand(tmp_path, capsys):
    """benchmarks.hpo.verdicts: the library's arm (here a variant) against the default run and the other
    competitors of the same file, paired by seed; the older library's arm is left out."""
    from benchmarks.hpo.verdicts import main

    runs = [_run("evollm:new", 0, [0.5, 0.7]), _run("evollm:new", 1, [0.4, 0.6]),
            _run("evollm", 0, [0.9, 0.9]), _run("evollm", 1, [0.9, 0.9]),  # the older library: not a competitor
            _run("default", 0, [0.3, 0.6]), _run("default", 1, [0.3, 0.5]),
            _run("tpe", 0, [0.2, 0.8]), _run("tpe", 1, [0.2, 0.4])]
    path = tmp_path / "task.json"
    path.write_text(json.dumps({"runs": runs}))
    assert main([f"toy={path}:evollm:new", "--checkpoints", "2"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["toy", "2", "+0.100 ± 0.000 (2 ahead, 0 behind)"]
    assert cells[3] == "Optuna TPE trials +0.050 ± 0.150"  # 0.7 − 0.8 and 0.6 − 0.4
    assert cells[4] == "yes"
    assert cells[5:8] == ["-0.100 ± 0.000", "-", "no"]  # at half: 0.5 − 0.6 and 0.4 − 0.5; no run given half
    runs[-1] = _run("tpe", 1, [0.2, 0.7])  # TPE now ahead on the mean: the first question fails, naming it
    path.write_text(json.dumps({"runs": runs}))
    main([f"toy={path}:evollm:new", "--checkpoints", "2"])
    cells = [c.strip() for c in capsys.readouterr().out.strip().splitlines()[-1].strip("|").split("|")]
    assert cells[4] == "no (Optuna TPE trials)"
    # runs given half the budget, against the default runs of their own day (another file, another arm name)
    half, full = tmp_path / "half.json", tmp_path / "full.json"
    half.write_text(json.dumps({"runs": [_run("evollm", 0, [0.4, 0.65]), _run("evollm", 1, [0.3, 0.5]),
                                         _run("evollm", 2, [0.3, 0.9])]}))  # seed 2 has no default run: left out
    full.write_text(json.dumps({"runs": [_run("default", 0, [0.3, 0.6]), _run("default", 1, [0.3, 0.55])]}))
    main([f"toy={path}:evollm:new", "--checkpoints", "2", "--half", f"toy={half}@{full}"])
    cells = [c.strip() for c in capsys.readouterr().out.strip().splitlines()[-1].strip("|").split("|")]
    assert cells[5:8] == ["-0.100 ± 0.000", "+0.000 ± 0.050 (1 ahead, 1 behind, of 2)", "yes (a run given ½)"]
    with pytest.raises(SystemExit):  # a --half for a task no spec names
        main([f"toy={path}:evollm:new", "--half", f"other={half}@{full}"])
    with pytest.raises(SystemExit):  # an arm the file does not hold
        main([f"toy={path}:evollm:new", "--half", f"toy={half}:evollm:x@{full}"])
