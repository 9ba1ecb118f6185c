"""What users see of a run: the per-step metrics record, the run files kept current, TensorBoard
event files, the optional trackers, and `evollm report` on finished and interrupted runs."""

import json
import math
import multiprocessing
import os
import signal
import sys
import time
import types

import pandas as pd
import pytest
import torch
from conftest import make_grpo

from evollm.recipes.cli import main
from evollm.hpo import Mutations, TournamentSelection
from evollm.run.population import Population
from evollm.run.files import RunFilesWriter
from evollm.config import RunConfig
from evollm.run.logging import TensorBoardLogger, logging_callbacks
from evollm.run.report import read_run, report_run
from evollm.training.loop import finetune_llm_reasoning

LEARN = ("loss", "kl", "clip_fraction", "entropy", "grad_norm", "mean_reward", "zero_std_groups", "completion_length")
COSTS = ("time_generate_s", "time_learn_s", "time_eval_s", "gen_tokens", "tokens_per_s", "peak_memory_mb")


def _evolve(model, tok, env, steps=4, callbacks=(), n=2):
    pop = make_grpo(model, tok, n=n)
    return finetune_llm_reasoning(
        pop, env, max_steps=steps, evaluation_interval=2, evo_steps=2, verbose=False,
        tournament=TournamentSelection(2, True, n), mutation=Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0),
        callbacks=list(callbacks))


def test_metrics_record_has_every_learn_metric_and_the_costs(tiny, arithmetic_env):
    model, tok = tiny
    agents, record = _evolve(model, tok, arithmetic_env, steps=3)
    m = record.metrics()
    assert list(m.columns[:3]) == ["step", "generation", "member"] and tuple(m.columns[-6:]) == COSTS
    assert set(LEARN) <= set(m.columns)
    assert len(m) == 6 and sorted(m["step"].unique()) == [1, 2, 3]
    assert str(m["step"].dtype) == "int64" and str(m["gen_tokens"].dtype) == "Int64"
    # generation and learning are timed per step; evaluation only on the evaluated steps (2 and 3 = last)
    assert (m["time_generate_s"] > 0).all() and (m["time_learn_s"] > 0).all() and (m["peak_memory_mb"] > 0).all()
    assert m.loc[m["step"] == 1, "time_eval_s"].isna().all()
    assert (m.loc[m["step"] > 1, "time_eval_s"] > 0).all()
    # tokens: at most group_size * prompts * max_output_tokens per member, and tokens/s is tokens / generate time
    assert ((m["gen_tokens"] > 0) & (m["gen_tokens"] <= 4 * 4 * 4)).all()
    assert (m["tokens_per_s"] - m["gen_tokens"] / m["time_generate_s"]).abs().max() < 1e-9
    assert m["gen_tokens"].astype(float).equals(m["completion_length"] * 16)  # 16 completions per member
    # the members after selection are the ones with step-3 rows; the clone's generation is 1
    assert set(m.loc[m["step"] == 3, "member"]) == {a.index for a in agents}
    assert set(m.loc[m["step"] == 3, "generation"]) == {1}
    # the record is plain JSON and comes back whole
    state = json.loads(json.dumps(record.state_dict()))
    again = Population()
    again.load_state_dict(state)
    pd.testing.assert_frame_equal(again.metrics(), m)


def test_report_and_lineage_dtypes(tiny, arithmetic_env):
    model, tok = tiny
    _, record = _evolve(model, tok, arithmetic_env, steps=3)
    report, lineage = record.report(), record.lineage()
    assert str(report["parent"].dtype) == "Int64" and str(lineage["parent"].dtype) == "Int64"
    assert report.loc[report["step"] == 2, "parent"].isna().all()  # founders only at step 2
    assert report.loc[report["step"] == 3, "parent"].notna().sum() == 1  # the clone of the selection at step 2
    assert lineage["parent"].notna().sum() == 1 and int(lineage["parent"].dropna().iloc[0]) in (0, 1)
    assert str(lineage["mutation"].dtype) == "string" and str(report["member"].dtype) == "int64"


def test_run_files_and_tensorboard_event_files(tiny, arithmetic_env, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, tok = tiny
    agents, record = _evolve(model, tok, arithmetic_env, steps=4, callbacks=[
        RunFilesWriter(tmp_path, plots=False), TensorBoardLogger(tmp_path / "tensorboard")])
    run = read_run(tmp_path)
    pd.testing.assert_frame_equal(run.metrics, record.metrics(), check_exact=False, rtol=1e-9)
    pd.testing.assert_frame_equal(run.report, record.report(), check_exact=False, rtol=1e-9)
    assert str(run.lineage["parent"].dtype) == "Int64" and len(run.lineage) == len(record.lineage())
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["status"] == "finished" and progress["step"] == 4
    assert not list(tmp_path.glob("*.png"))  # plots: false
    # TensorBoard: one run per member, read back with tensorboard's own reader
    founder = EventAccumulator(str(tmp_path / "tensorboard" / "member_0")).Reload()
    kl = founder.Scalars("train/kl")
    rows = record.metrics()[lambda d: d["member"] == 0]
    assert [e.step for e in kl] == list(rows["step"])
    assert [e.value for e in kl] == pytest.approx(list(rows["kl"]), abs=1e-6)
    fitness = founder.Scalars("eval/fitness")
    assert [e.step for e in fitness] == [2, 4] and fitness[-1].value == pytest.approx(agents[0].fitness[-1])
    assert "hp/lr" in founder.Tags()["scalars"] and "train/tokens_per_s" in founder.Tags()["scalars"]
    pop = EventAccumulator(str(tmp_path / "tensorboard" / "population")).Reload()
    best = pop.Scalars("population/best_fitness")
    assert [e.step for e in best] == [2, 4]
    assert best[-1].value == pytest.approx(max(a.fitness[-1] for a in agents))



def test_wandb_and_mlflow_when_installed_and_a_one_line_error_when_not(monkeypatch, tmp_path, tiny, arithmetic_env):
    calls = []
    run = types.SimpleNamespace(log=lambda d, step: calls.append(("wandb", step, d)), finish=lambda: calls.append("fin"))
    wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or run)
    mlflow = types.SimpleNamespace(
        set_tracking_uri=lambda uri: calls.append(("uri", uri)), set_experiment=lambda n: None,
        start_run=lambda run_name=None: calls.append(("start", run_name)), log_params=lambda p: calls.append(("params", p)),
        log_metrics=lambda d, step: calls.append(("mlflow", step, d)), end_run=lambda: calls.append("end"))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    log = RunConfig.from_dict({"algorithm": {"name": "GRPO"}, "logging": {
        "tensorboard": False, "wandb": {"mode": "offline"}, "mlflow": {"run_name": "r"}}}).logging
    cbs = logging_callbacks(tmp_path, log.tensorboard, log.wandb, log.mlflow, {"seed": 3, "train": {"max_steps": 2}})
    model, tok = tiny
    _evolve(model, tok, arithmetic_env, steps=2, callbacks=cbs)
    init = next(c for c in calls if c[0] == "init")[1]
    assert init["mode"] == "offline" and init["config"]["seed"] == 3 and init["dir"] == str(tmp_path)
    assert ("params", {"seed": "3", "train.max_steps": "2"}) in calls
    for tracker in ("wandb", "mlflow"):
        logged = [c for c in calls if isinstance(c, tuple) and c[0] == tracker]
        assert [c[1] for c in logged] == [1, 2, 2]  # two steps, then the evaluation at step 2
        assert "member_0/train/kl" in logged[0][2] and "population/best_fitness" in logged[-1][2]
    assert "fin" in calls and "end" in calls
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: import fails
    with pytest.raises(ValueError, match=r"^logging.wandb is set but wandb is not installed \(pip install wandb\)"):
        logging_callbacks(tmp_path, wandb=True)
    with pytest.raises(ValueError, match=r"logging.tensorbord: unknown key .*did you mean 'tensorboard'"):
        RunConfig.from_dict({"algorithm": {"name": "GRPO"}, "logging": {"tensorbord": True}})


def _train_args(out, cache_dir, steps, *extra):
    return ["train", "configs/demo.yaml", "--quiet", "--set", f"output_dir={out}", "--set", f"model.cache_dir={cache_dir}",
            "--set", "algorithm.population_size=2", "--set", f"train.max_steps={steps}",
            "--set", "train.evaluation_interval=2", "--set", "train.evo_steps=2", "--set", "task.n_test=8",
            "--set", "env.data_batch_size_per_gpu=4", "--set", "algorithm.hyperparameters.group_size=4",
            "--set", "algorithm.hyperparameters.batch_size=16", *extra]


def _train_quietly(argv):
    sys.stdout = sys.stderr = open(os.devnull, "w")
    main(argv)


def test_report_on_an_interrupted_run(tmp_path, cache_dir, warm, capsys):
    """A run killed (SIGKILL) mid-way still has its files; `evollm report` rebuilds everything from them.
    The run is a forked copy of this process (imports already done), killed after its first selection."""
    out = tmp_path / "run"
    method = "spawn" if torch.cuda.is_initialized() else "fork"  # CUDA cannot be used in a forked child
    proc = multiprocessing.get_context(method).Process(
        target=_train_quietly, args=(_train_args(out, cache_dir, 400, "--set", "logging.plots=false"),))
    proc.start()
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.is_alive():
            if (out / "metrics.csv").exists() and read_run(out).metrics["step"].max() >= 3:
                break
            time.sleep(0.2)
        assert proc.is_alive(), f"the run ended early with exit code {proc.exitcode}"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    result = report_run(out, echo=lambda s: None)
    assert result["status"] == "stopped"
    run = read_run(out)
    steps = int(run.metrics["step"].max())
    assert 3 <= steps < 400 and run.report["step"].max() >= 2 and len(run.lineage) >= 3
    assert (out / "tensorboard").is_dir() and not (out / "summary.json").exists()
    # every plot is rebuilt from the files: each PNG exists and is a real, non-empty image
    pngs = ["fitness.png", "hyperparameters.png", "lineage.png", "diagnostics.png"]
    pngs += [f"diagnostics/member_{m}.png" for m in sorted(run.metrics["member"].unique())]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.png")) == sorted(pngs)
    for name in pngs:
        data = (out / name).read_bytes()
        assert len(data) > 5000 and data[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "status: stopped" in (out / "summary.txt").read_text()
    assert rc_and_text(["report", str(out), "--no-plots"], capsys)[1].count("status: stopped") == 1


def rc_and_text(argv, capsys):
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_report_on_a_finished_run_and_on_a_wrong_directory(tmp_path, cache_dir, warm, capsys):
    out = tmp_path / "run"
    assert main(_train_args(out, cache_dir, 4, "--set", "logging.plots=false", "--set", "logging.tensorboard=false")) == 0
    capsys.readouterr()
    assert not (out / "tensorboard").exists() and not list(out.glob("*.png"))
    rc, text = rc_and_text(["report", str(out), "--out", str(tmp_path / "again"), "--no-plots"], capsys)
    assert rc == 0 and "status: finished (step 4/4); algorithm GRPO" in text
    best = json.loads((out / "summary.json").read_text())["best_member"]
    assert f"best member: {best} " in text and "hyperparameters: lr=" in text and "lineage: m" in text
    assert "(founder)" in text and "fitness over time" in text
    search = json.loads((out / "summary.json").read_text())["search"]  # 2 members x 4 steps, the best one's 4
    assert (search["member_steps"], search["steps"], search["share"]) == (8, 4, 0.5)
    assert "the search: 4 of the 8 member-steps (50%) trained the best member's weights" in text
    assert f"it descends from founder m{search['founder']}" in text
    # the demo's lr range (5e-4..3e-3) leaves out GRPO's default 5e-5: no founder keeps the starting values
    assert search["default_founder"] is None and not search["from_default_founder"]
    assert "default founder" not in text and search["founder_hyperparameters"]["lr"] >= 5e-4
    again = read_run(tmp_path / "again")  # the rebuilt tables keep their types
    assert str(again.report["parent"].dtype) == "Int64" and len(again.metrics) == 8
    pd.testing.assert_frame_equal(again.report, read_run(out).report)
    rc, text = rc_and_text(["report", str(tmp_path / "nothing")], capsys)
    assert rc == 2 and text.strip().count("\n") == 0 and "does not exist" in text
    (tmp_path / "empty").mkdir()
    rc, text = rc_and_text(["report", str(tmp_path / "empty")], capsys)
    assert rc == 2 and "not an evollm run directory" in text
    assert math.isfinite(float(pd.read_csv(out / "metrics.csv")["tokens_per_s"].iloc[0]))


def test_multiturn_ppo_metrics_have_the_critic_and_the_costs():
    from evollm.adapters.shared import default_lora_config
    from evollm.algorithms.ppo import LLMPPO
    from evollm.models.tiny import build_tiny_model
    from evollm.models.tokenizer import build_tokenizer
    from evollm.run.plots import diagnostic_panels
    from evollm.tasks.games import game_env_factory
    from evollm.training.multiturn import finetune_llm_multiturn

    tok = build_tokenizer()
    model = build_tiny_model(tok, seed=0)
    pop = [LLMPPO(model, pad_token_id=tok.pad_token_id, lora_config=default_lora_config(r=4), max_output_tokens=3,
                  batch_size=4)]
    factory = game_env_factory("guess_number", tok, game={"max_turns": 2}, max_model_len=96, max_output_tokens=3)
    _, record = finetune_llm_multiturn(pop, max_turns=2, env_factory=factory, max_steps=2, evaluation_interval=2,
                                       episodes_per_step=2, eval_episodes=2, verbose=False)
    m = record.metrics()
    assert len(m) == 2 and {"value_loss", "policy_loss", "explained_variance", "mean_turns"} <= set(m.columns)
    assert (m["gen_tokens"] > 0).all() and (m["time_generate_s"] > 0).all() and m["time_eval_s"].notna().tolist() == [False, True]
    assert ("value_loss", "value loss (critic)") in diagnostic_panels(m)


def test_progress_says_stopped_after_a_run_that_did_not_finish(tmp_path, tiny, arithmetic_env):
    from evollm.training.callbacks import Callback

    class StopAtStep2(Callback):
        def on_step_end(self, state, metrics):
            if state.step == 2:
                raise KeyboardInterrupt

    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    with pytest.raises(KeyboardInterrupt):
        finetune_llm_reasoning(pop, arithmetic_env, max_steps=4, evaluation_interval=1, verbose=False,
                               callbacks=[RunFilesWriter(tmp_path, plots=False), StopAtStep2()])
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["status"] == "stopped" and progress["step"] >= 1
    assert read_run(tmp_path).progress["status"] == "stopped"


def test_the_report_says_what_was_held_outside_the_population():
    from evollm.run.report import held_outside

    assert held_outside({"best_member": 3}, 3) == []
    lines = held_outside({"best_member": 12, "best_state": {"member": 12, "source": 4, "step": 30, "fitness": 0.75},
                          "reserve": {"member": 5, "swapped_step": 40, "revived": 7, "rescued_step": None},
                          "rollbacks": [{"step": 60, "fell": 7, "copy": 13}],
                          "anneals": [{"step": 80, "member": 13, "rates": "lr 0.0004 -> 0.0002"}]}, 7)
    assert lines == ["  kept best state: member 4 as it was at step 30 (fitness 0.7500)",
                     "  stall swap at step 40: the reserve, member 7, trained on in place of the stalled member "
                     "(hpo.narrowing.revive)",
                     "  roll-back at step 60: member 7 fell away from the best state; member 13, a copy of it at a "
                     "lower learning rate, trained on (hpo.narrowing.rollback)",
                     "  anneal at step 80: member 13 stopped improving and trained on at lr 0.0004 -> 0.0002 "
                     "(hpo.narrowing.anneal)",
                     "  best_member/ holds member 12: measured strictly better than every live member"]
