"""`evollm train` on a user's own task: the reward found from the config's folder and remembered for
resume, everything checkable checked before the model loads, and a failed start that leaves nothing."""

import json
import re
import sys

import pytest

from evollm.recipes.cli import main


def _task(tmp_path, reward_body="    return float(completion.strip() == str(answer))\n", reward="mytask/myreward.py:score"):
    cfg_dir = tmp_path / "project"
    (cfg_dir / "mytask").mkdir(parents=True)
    (cfg_dir / "mytask" / "myreward.py").write_text(f"def score(completion, answer, question):\n{reward_body}")
    (cfg_dir / "data.jsonl").write_text("\n".join(json.dumps({"problem": f"{i}+1=", "solution": i + 1})
                                                  for i in range(20)))
    config = cfg_dir / "mytask.yaml"
    config.write_text(f"""
output_dir: {tmp_path / 'run'}
model: {{source: tiny, warm_start: false}}
task: {{dataset: data.jsonl, columns: {{question: problem, answer: solution}}, test_size: 4,
        reward: "{reward}", user_template: "{{question}}"}}
env: {{data_batch_size_per_gpu: 2}}
algorithm: {{name: GRPO, population_size: 2, hyperparameters: {{group_size: 2, batch_size: 4, max_output_tokens: 2}}}}
train: {{max_steps: 2, evaluation_interval: 1}}
logging: {{tensorboard: false, plots: false}}
""")
    return config


@pytest.fixture(autouse=True)
def _clean_imports(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in ("mytask", "mytask.myreward", "myreward"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("reward", ["mytask/myreward.py:score", "mytask.myreward:score"])
def test_reward_next_to_the_config_is_found_and_remembered_for_resume(tmp_path, monkeypatch, capsys, reward):
    config = _task(tmp_path, reward=reward)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # neither the config's folder nor on sys.path
    assert main(["train", str(config), "--quiet"]) == 0, capsys.readouterr().err
    assert re.search(r"warm start: held-out fitness \d\.\d{3} ± \d\.\d{3} \(standard error\), the mean reward of "
                     r"greedy answers to 4 fixed test questions", capsys.readouterr().out)
    warm = json.loads((tmp_path / "run" / "warm_start.json").read_text())
    assert set(warm) == {"initial_fitness", "standard_error"} and warm["standard_error"] >= 0
    saved = json.loads((tmp_path / "run" / "run_config.json").read_text())["task"]
    assert saved["reward"] == f"{config.parent / 'mytask' / 'myreward.py'}:score"
    assert saved["dataset"] == str(config.parent / "data.jsonl")  # next to the config, remembered
    sys.modules.pop("myreward", None)
    sys.modules.pop("mytask.myreward", None)
    monkeypatch.chdir("/")  # "a new shell" somewhere else
    capsys.readouterr()
    assert main(["resume", str(tmp_path / "run"), "--quiet", "--set", "train.max_steps=3"]) == 0, \
        capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "(measured when the run started)" in printed  # the base is not evaluated again
    segments = json.loads((tmp_path / "run" / "segments.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(segments) == 2 and summary["wall_time_s"] == pytest.approx(sum(segments), abs=1e-2)
    assert summary["wall_time_last_segment_s"] == pytest.approx(segments[-1], abs=1e-2)


def test_a_bad_reward_fails_before_the_model_loads_and_leaves_no_run(tmp_path, monkeypatch, capsys):
    import evollm.recipes.builders as builders

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the task was checked")

    monkeypatch.setattr(builders, "build_model", no_model)
    config = _task(tmp_path, reward_body="    return None\n")
    assert main(["train", str(config), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "returned None (not a finite number)" in err
    assert _left_behind(tmp_path / "run") == []  # the corrected command needs no --overwrite
    bad_template = config.read_text().replace('user_template: "{question}"', 'user_template: "{level} {question}"')
    config.write_text(bad_template)
    assert main(["train", str(config), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "the prompt template uses {level}, which is not a dataset column" in err and "conversation_template" not in err
    assert _left_behind(tmp_path / "run") == []


def _left_behind(run):
    from evollm.run.lock import LOCK

    return [p.name for p in run.iterdir() if p.name != LOCK] if run.exists() else []


def test_a_second_ctrl_c_still_prints_the_resume_command(tmp_path, monkeypatch, capsys):
    from evollm.recipes import cli

    run = tmp_path / "run"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    (run / "checkpoints" / "step_4" / "manifest.json").write_text("{}")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "resume", interrupted)
    assert main(["resume", str(run)]) == 130
    err = capsys.readouterr().err
    assert f"resume with: evollm resume {run}" in err and "step_4" in err
