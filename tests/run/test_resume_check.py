"""The field-by-field comparison of a resumed config with the checkpoint's record (pure functions)."""

from evollm.run.resume_check import SAFE_ON_RESUME, config_changes, covers, flatten, refused_changes


def test_flatten_and_changes():
    saved = {"train": {"max_steps": 10, "evo_steps": 5}, "algorithm": {"hyperparameters": {"lr": 1e-3}}, "x": []}
    resumed = {"train": {"max_steps": 20, "evo_steps": 5}, "algorithm": {"hyperparameters": {"lr": 1e-3,
                                                                                             "loss_type": "dapo"}}}
    assert flatten(saved) == {"train.max_steps": 10, "train.evo_steps": 5, "algorithm.hyperparameters.lr": 1e-3,
                              "x": []}
    assert config_changes(saved, resumed) == [("algorithm.hyperparameters.loss_type", None, "dapo"),
                                              ("train.max_steps", 10, 20), ("x", [], None)]


def test_only_safe_or_allowed_fields_pass():
    changes = [("train.max_steps", 10, 20), ("logging.plots", True, False), ("task.reward", "a", "b"),
               ("algorithm.hyperparameters.lr", 1e-3, 1e-4)]
    assert refused_changes(changes) == changes[2:]
    assert refused_changes(changes, ["task"]) == changes[3:]
    assert refused_changes(changes, ["task.reward", "algorithm.hyperparameters.lr"]) == []
    assert covers("logging.wandb.project", SAFE_ON_RESUME) and not covers("loggingx", SAFE_ON_RESUME)
    assert not covers("train.max_steps_unit", ["train.max_steps"])
