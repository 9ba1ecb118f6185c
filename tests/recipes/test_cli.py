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


def test_the_command_closes_the_process_group_after_a_success_only(tmp_path, monkeypatch):
    """`evollm` (recipes.cli.console) ends a launched run with dist.shutdown; main() leaves the group open for
    programs that call it more than once, and an error leaves it to the launcher."""
    import tomllib
    from pathlib import Path

    from evollm.parallel import distributed as dist
    from evollm.recipes import cli

    calls = []
    monkeypatch.setattr(dist, "shutdown", lambda: calls.append(1))
    missing = str(tmp_path / "missing")
    assert cli.main(["report", missing]) == 2 and calls == []
    assert cli.console(["report", missing]) == 2 and calls == []  # an error: no collective call
    monkeypatch.setattr(cli, "main", lambda argv=None: 0)  # a command that succeeded
    assert cli.console(["report", str(tmp_path)]) == 0 and calls == [1]
    scripts = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["evollm"] == "evollm.recipes.cli:console"
