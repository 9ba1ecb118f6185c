"""LoopSettings: one object for the loop's options, built once by the recipe and handed down."""

import dataclasses

import pytest
from conftest import make_grpo

from evollm.config import RunConfig
from evollm.training import LoopSettings
from evollm.training.loop import finetune_llm_reasoning
from evollm.training.settings import OPTIONS, describe_loop_settings, loop_settings


def test_every_option_has_help_and_a_line_in_the_description():
    lines = describe_loop_settings().splitlines()
    assert len(lines) == len(OPTIONS)
    for f in dataclasses.fields(LoopSettings):
        assert f.metadata.get("help"), f.name


@pytest.mark.parametrize("options, message", [
    ({"max_steps": 0}, "max_steps must be >= 1, got 0"),
    ({"evaluation_interval": 0}, "evaluation_interval must be >= 1"),
    ({"max_time_clock": "gpu"}, "max_time_clock='gpu' is not valid"),
    ({"max_time": 0}, "max_time must be > 0 seconds"),
    ({"checkpoint_every": -1}, "checkpoint_every must be >= 0"),
    ({"keep_checkpoints": 0}, "keep_checkpoints must be >= 1"),
    ({"resume": True}, "resume=True needs checkpoint_dir"),
])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(ValueError, match=message):
        LoopSettings(**options)
    with pytest.raises(ValueError, match=message):  # also when applied on top of a settings object
        loop_settings(LoopSettings(max_steps=4), options, "caller")


def test_keywords_apply_on_top_of_settings_and_unknown_ones_are_named():
    base = LoopSettings(max_steps=8, evaluation_interval=2, seed=3)
    s = loop_settings(base, {"max_steps": 4}, "f")
    assert (s.max_steps, s.evaluation_interval, s.seed) == (4, 2, 3) and base.max_steps == 8
    assert loop_settings(base, {}, "f") is base
    with pytest.raises(TypeError, match=r"f got unexpected keyword\(s\) \['max_step'\]"):
        loop_settings(base, {"max_step": 4}, "f")
    with pytest.raises(TypeError, match="settings must be a LoopSettings"):
        loop_settings({"max_steps": 4}, {}, "f")


def test_train_section_builds_the_settings(tmp_path):
    cfg = RunConfig.from_dict({"algorithm": {"name": "GRPO", "population_size": 2}, "seed": 5,
                               "train": {"max_steps": 6, "evaluation_interval": 2, "evo_steps": 4, "max_time": 60,
                                         "save_elite": True, "keep_checkpoints": None}})
    s = cfg.train.loop_settings(tmp_path, cfg.seed, resume=True, run_config={"seed": 5}, verbose=False)
    assert (s.max_steps, s.evaluation_interval, s.evo_steps, s.max_time, s.save_elite) == (6, 2, 4, 60, True)
    assert s.checkpoint_dir == str(tmp_path / "checkpoints") and s.elite_path == str(tmp_path / "elites")
    assert (s.checkpoint_every, s.keep_checkpoints, s.resume, s.seed, s.verbose) == (2, None, True, 5, False)
    assert s.run_config == {"seed": 5}
    # every loop option the YAML has is carried over under its own name
    shared = {f.name for f in dataclasses.fields(type(cfg.train))} & set(OPTIONS)
    assert {n for n in shared if getattr(cfg.train, n) is not None} <= {n for n in shared if getattr(s, n) is not None}


def _env(tok):
    from evollm.envs.reasoning import ReasoningGym
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward

    train, test = arithmetic_dataset(n_train=16, n_test=4, digits=(1, 1), seed=0)
    return ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4)


def test_a_settings_object_and_keywords_run_the_same_loop(tiny):
    model, tok = tiny
    runs = []
    for how in ("object", "keywords"):
        pop = make_grpo(model, tok, n=2)
        if how == "object":
            agents, record = finetune_llm_reasoning(pop, _env(tok),
                                                    LoopSettings(max_steps=2, evaluation_interval=1, seed=4,
                                                                 verbose=False))
        else:
            agents, record = finetune_llm_reasoning(pop, _env(tok), max_steps=2,
                                                    evaluation_interval=1, seed=4, verbose=False)
        runs.append(([a.fitness for a in agents], [a.scores for a in agents], len(record.report())))
        for a in agents:
            a.release()
    assert runs[0] == runs[1] and runs[0][2] == 4


def test_selection_needs_a_fresh_evaluation_unless_it_ranks_on_training_rewards():
    from evollm.hpo import Mutations, TournamentSelection
    from evollm.training.loop import validate_settings

    class Member:
        shared = object()

    settings = LoopSettings(max_steps=6, evaluation_interval=3, evo_steps=2)
    with pytest.raises(ValueError, match="evo_steps=2 must be a multiple of evaluation_interval=3"):
        validate_settings([Member(), Member()], settings, TournamentSelection(2, fitness="last"), Mutations())
    validate_settings([Member(), Member()], settings, TournamentSelection(2, fitness="train"), Mutations())
