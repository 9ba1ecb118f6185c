"""The `evollm train` entry point on the demo config (shortened) and its error messages."""

import json

from evollm.recipes.cli import main


def test_train_demo_config_writes_outputs(tmp_path, cache_dir, capsys):
    out = tmp_path / "run"
    rc = main(["train", "configs/demo.yaml", "--quiet", "--set", f"output_dir={out}",
               "--set", f"model.cache_dir={cache_dir}", "--set", "algorithm.population_size=2",
               "--set", "train.max_steps=4", "--set", "train.evaluation_interval=2", "--set", "train.evo_steps=2",
               "--set", "task.n_test=16"])
    assert rc == 0
    for name in ("report.csv", "lineage.csv", "metrics.csv", "progress.json", "fitness.png", "hyperparameters.png",
                 "lineage.png", "diagnostics.png", "diagnostics/member_0.png", "tensorboard/population", "summary.json",
                 "best_member/adapter/adapter_model.safetensors"):
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["initial_fitness"] <= 1.0 and 0.0 <= summary["final_fitness"] <= 1.0
    printed = capsys.readouterr().out
    assert "warm start" in printed and "Last rows of the report" in printed


def test_config_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: {name: GRPO}\ntrainer: {}\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "trainer: unknown key in the top level; did you mean 'train'?" in err and len(err.splitlines()) == 1
    bad.write_text("algorithm: {name: PPO2}\n")
    assert main(["train", str(bad), "--set", f"output_dir={tmp_path / 'o'}"]) == 2
    assert "algorithm.name='PPO2' is not valid" in capsys.readouterr().err
