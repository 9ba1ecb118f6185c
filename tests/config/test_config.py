"""The run config schema: strict sections, numbers written 1e-3, --set overrides, no-effect settings,
and a corpus of bad configs, each a one-line error naming the field."""

import copy
import dataclasses
from pathlib import Path

import pytest

from evollm.recipes import cli
from evollm.config import RunConfig, apply_override, describe_config
from evollm.config.schema import ConfigError, Section, option, walk

BASE = {"algorithm": {"name": "GRPO", "population_size": 2}}
EVO = {"train": {"max_steps": 4, "evaluation_interval": 2, "evo_steps": 2}}
GAME = {"task": {"name": "guess_number"}, "env": {"type": "multiturn"}, "model": {"source": "tiny_multiturn"}}


def load(data=None, overrides=()):
    raw = copy.deepcopy(BASE)
    for key, value in (data or {}).items():
        raw[key] = value
    for item in overrides:
        apply_override(raw, item)
    return RunConfig.from_dict(raw)


def test_every_shipped_config_loads():
    for path in sorted(Path("configs").glob("*.yaml")):
        cfg = RunConfig.from_yaml(path)
        assert cfg.algorithm.population_size >= 1, path


def test_numbers_written_in_exponent_form_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  name: GRPO\n  population_size: 2\n  hyperparameters: {lr: 1e-3, max_grad_norm: 5e-1}\n"
                    "hpo:\n  hp_config: {lr: {min: 1e-5, max: 1e-2, log: true}}\n"
                    "train: {max_steps: 1e2, evaluation_interval: 10, evo_steps: 20}\n")
    cfg = RunConfig.from_yaml(path)
    assert cfg.algorithm.hyperparameters == {"lr": 1e-3, "max_grad_norm": 0.5}
    assert cfg.hpo.hp_config["lr"].min == 1e-5 and cfg.train.max_steps == 100
    assert isinstance(cfg.train.max_steps, int)
    cfg = RunConfig.from_yaml(path, ["algorithm.hyperparameters.lr=2e-4", "train.max_steps=10"])
    assert cfg.algorithm.hyperparameters["lr"] == 2e-4 and cfg.train.max_steps == 10


def test_defaults_and_round_trip():
    cfg = load(EVO)
    assert RunConfig.from_dict({"algorithm": {}}).model.source == "tiny"
    assert cfg.model.source == "tiny" and cfg.hpo.selection.type == "tournament"
    again = RunConfig.from_dict(cfg.to_dict(explicit=True))
    assert again.to_dict() == cfg.to_dict()
    assert cfg.to_dict(explicit=True) == {**BASE, **EVO}
    assert load({"model": {"name_or_path": "some/model"}}).model.source == "hub"


def test_game_settings_may_sit_in_the_task_section():
    cfg = load({**GAME, "task": {"name": "guess_number", "high": "8"}})
    assert cfg.task.game == {"high": 8}


def test_every_field_is_documented():
    lines = describe_config().splitlines()
    assert len(lines) >= 40
    assert all(line.split(": ", 1)[1].strip() for line in lines), [l for l in lines if l.endswith(": ")]
    for section, f in walk(RunConfig()):
        assert f.metadata.get("help"), f"{type(section).__name__}.{f.name} has no help"


def test_adding_a_field_is_one_line():
    @dataclasses.dataclass
    class Extra(Section):
        gguf_file: str | None = option(None, "GGUF file inside the model folder.", when={"flavour": ("hub",)})
        flavour: str = option("tiny", "Where the model comes from.", choices=("tiny", "hub"))

    assert Extra.from_dict({"gguf_file": "m.gguf", "flavour": "hub"}).gguf_file == "m.gguf"
    with pytest.raises(ConfigError, match="x.gguf_fle: unknown key in section 'x'; did you mean 'gguf_file'"):
        Extra.from_dict({"gguf_fle": "m.gguf"}, "x")


def test_paths_are_relative_to_output_dir(tmp_path):
    cfg = load({"output_dir": str(tmp_path / "run"), "model": {"cache_dir": "cache"},
                "train": {**EVO["train"], "save_elite": True, "elite_path": "elites"}})
    cfg.resolve_paths()
    assert cfg.model.cache_dir == str(tmp_path / "run" / "cache")
    assert cfg.train.elite_path == str(tmp_path / "run" / "elites")
    cfg = load({"model": {"cache_dir": str(tmp_path / "abs")}})
    cfg.resolve_paths()
    assert cfg.model.cache_dir == str(tmp_path / "abs")


def test_invalid_settings_fail_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    def no_model(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(cli, "build_model", no_model, raising=False)
    import evollm.recipes.builders as builders
    monkeypatch.setattr(builders, "build_model", no_model)
    rc = cli.main(["train", "configs/demo.yaml", "--set", f"output_dir={tmp_path / 'o'}",
                   "--set", "algorithm.hyperparameters.clip_coef=2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "algorithm.hyperparameters.clip_coef" in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- bad-input corpus (API)
BAD_CONFIGS = [
    # (config data, --set overrides, text the one-line error must contain)
    ({"trainer": {}}, [], "trainer: unknown key in the top level; did you mean 'train'"),
    ({"model": {"dtyp": "bfloat16"}}, [], "model.dtyp: unknown key in section 'model'; did you mean 'dtype'"),
    ({"task": {"n_tran": 5}}, [], "task.n_tran: unknown key in section 'task'; did you mean 'n_train'"),
    ({"env": {"batch_size": 8}}, [], "env.batch_size: unknown key in section 'env'"),
    ({"train": {"max_step": 5}}, [], "train.max_step: unknown key in section 'train'; did you mean 'max_steps'"),
    ({"hpo": {"mutations": {}}}, [], "hpo.mutations: unknown key in section 'hpo'; did you mean 'mutation'"),
    ({**EVO, "hpo": {"selection": {"tournament": 2}}}, [], "hpo.selection.tournament: unknown key"),
    ({"algorithm": {"name": "GRPO", "lora": {"rank": 4}}}, [], "algorithm.lora.rank: unknown key"),
    ({"algorithm": {"name": "GRPO", "hyperparameters": {"learning_rate": 1e-3}}}, [],
     "algorithm.hyperparameters.learning_rate: unknown hyperparameter of GRPO"),
    ({"algorithm": {"name": "GRPO", "hyperparameters": {"gamma": 0.9}}}, [],
     "algorithm.hyperparameters.gamma: unknown hyperparameter of GRPO"),
    ({"algorithm": {"name": "GRP0"}}, [], "algorithm.name='GRP0' is not valid; did you mean 'GRPO'"),
    ({"algorithm": "GRPO"}, [], "algorithm must be a mapping"),
    ({"algorithm": {"name": "GRPO", "population_size": 0}}, [], "algorithm.population_size must be >= 1"),
    ({"algorithm": {"name": "GRPO", "population_size": "four"}}, [], "algorithm.population_size must be an integer"),
    ({"algorithm": {"name": "GRPO", "hyperparameters": {"group_size": 1}}}, [],
     "algorithm.hyperparameters.group_size must be >= 2 for GRPO-style group-relative advantages"),
    ({"algorithm": {"name": "GSPO", "hyperparameters": {"group_size": 1}}}, [],
     "algorithm.hyperparameters.group_size must be >= 2"),
    ({}, ["algorithm.hyperparameters.lr=-1e-3"], "algorithm.hyperparameters.lr must be a finite number > 0"),
    ({}, ["algorithm.hyperparameters.lr=abc"], "algorithm.hyperparameters.lr must be a number"),
    ({}, ["algorithm.hyperparameters.temperature=0"], "algorithm.hyperparameters.temperature must be > 0"),
    ({}, ["algorithm.hyperparameters.top_p=1.5"], "algorithm.hyperparameters.top_p must be in (0, 1]"),
    ({}, ["algorithm.hyperparameters.clip_coef=1.5"], "algorithm.hyperparameters.clip_coef"),
    ({}, ["algorithm.hyperparameters.loss_type=ppo"], "algorithm.hyperparameters.loss_type='ppo' is not valid"),
    ({}, ["algorithm.hyperparameters.beta=-0.1"], "algorithm.hyperparameters.beta must be >= 0"),
    ({}, ["algorithm.hyperparameters.max_output_tokens=0"], "algorithm.hyperparameters.max_output_tokens"),
    ({"algorithm": {"name": "LLMPPO", "hyperparameters": {"gae_lambda": 2}}, **GAME}, [],
     "algorithm.hyperparameters.gamma and gae_lambda must be in [0, 1]"),
    ({"algorithm": {"name": "GRPO", "lora": {"r": 0}}}, [], "algorithm.lora.r must be >= 1"),
    ({}, ["train.max_steps=abc"], "train.max_steps must be an integer, got 'abc'"),
    ({}, ["train.max_steps=2.5"], "train.max_steps must be an integer, got 2.5"),
    ({}, ["train.max_steps=0"], "train.max_steps must be >= 1"),
    ({}, ["train.evaluation_interval=5", "train.evo_steps=7", "hpo.selection.fitness=last"],
     "train.evo_steps=7 must be a multiple"),
    ({}, ["train.keep_checkpoints=0"], "train.keep_checkpoints must be >= 1"),
    ({}, ["train.checkpoint_every=-1"], "train.checkpoint_every must be >= 0"),
    ({}, ["train.max_steps"], "--set 'train.max_steps' must look like section.key=value"),
    ({}, ["=3"], "is not a dotted key"),
    ({}, ["seed.x=1"], "seed must be an integer, got {'x': 1}"),
    ({}, ["seed=abc"], "seed must be an integer, got 'abc'"),
    ({}, ["threads=0"], "threads must be >= 1"),
    ({}, ["model=3"], "model must be a mapping"),
    ({}, ["model.warm_start=yes please"], "model.warm_start must be true or false"),
    ({"model": {"dtype": "bfloat16"}}, [], "model.dtype has no effect when model.source='tiny'"),
    ({"model": {"name_or_path": "x/y", "warm_start": False}}, [], "model.warm_start has no effect when model.source='hub'"),
    ({"model": {"source": "hub"}}, [], "model.name_or_path is required"),
    ({"model": {"source": "gguf"}}, [], "model.source='gguf' is not valid"),
    ({"model": {"source": "tiny_multiturn"}}, [], "model.source='tiny_multiturn' needs a multi-turn task.name"),
    ({"task": {"name": "gsm8k"}}, [], "task.name='gsm8k' is not valid"),
    ({"task": {"reward": "exact"}}, [], "task.reward='exact' is not valid; did you mean 'exact_match'"),
    ({"task": {"ops": ["/"]}}, [], "task.ops must be a non-empty list"),
    ({"task": {"digits": [3, 1]}}, [], "task.digits must be [smallest, largest]"),
    ({"task": {"name": "guess_number"}}, [], "env.type='reasoning' does not fit task.name='guess_number'"),
    ({**GAME, "task": {"name": "guess_number", "hgh": 8}}, [], "task.hgh: unknown key in section 'task'; did you mean 'high'"),
    ({**GAME, "task": {"name": "guess_number", "reward": "exact_match"}}, [],
     "task.reward has no effect when task.name='guess_number'"),
    ({"env": {"max_turns": 3}}, [], "env.max_turns has no effect when env.type='reasoning'"),
    ({"env": {"data_batch_size_per_gpu": 0}}, [], "env.data_batch_size_per_gpu must be >= 1"),
    ({"env": {"type": "chat"}}, [], "env.type='chat' is not valid"),
    ({"train": {"episodes_per_step": 4}}, [], "train.episodes_per_step has no effect when env.type='reasoning'"),
    ({"hpo": {"selection": {"type": "tournament"}}}, [], "hpo.selection has no effect when train.evo_steps=None"),
    ({"algorithm": {"name": "GRPO", "population_size": 2, "init_sampler": None},
      "hpo": {"hp_config": {"lr": {"min": 1e-5, "max": 1e-3}}}}, [], "hpo.hp_config has no effect without train.evo_steps"),
    ({**EVO, "hpo": {"hp_config": {"lrr": {"min": 1e-5, "max": 1e-3}}}}, [], "hpo.hp_config.lrr: GRPO cannot evolve it; did you mean 'lr'"),
    ({**EVO, "hpo": {"hp_config": {"lr": {"min": 1e-3, "max": 1e-5}}}}, [], "hpo.hp_config.lr: RLParameter.min"),
    ({**EVO, "hpo": {"hp_config": {"lr": {"min": 0, "max": 1e-3, "log": True}}}}, [], "hpo.hp_config.lr: RLParameter.min must be > 0"),
    ({**EVO, "hpo": {"hp_config": {"lr": {"min": 1e-5, "max": 1e-3, "dtype": "double"}}}}, [], "hpo.hp_config.lr.dtype='double' is not valid"),
    ({**EVO, "hpo": {"hp_config": {"lr": {"min": -1, "max": 1e-3}}}}, [], "hpo.hp_config.lr.min=-1.0 is not a valid lr"),
    ({**EVO, "hpo": {"hp_config": {"lora_rank": {"min": 0, "max": 8, "dtype": "int"}}}}, [],
     "hpo.hp_config.lora_rank.min=0 is not a valid lora_rank"),
    ({**EVO, "hpo": {"hp_config": {"loss_type": {"choices": ["grpo", "ppo"]}}}}, [],
     "hpo.hp_config.loss_type.choices='ppo' is not a valid loss_type"),
    ({**EVO, "hpo": {"mutation": {"rl_hp": -1}}}, [], "hpo.mutation: Mutations.rl_hp must be a finite probability"),
    ({**EVO, "hpo": {"selection": {"tournament_size": 3}}}, [], "hpo.selection: tournament_size (3) must be <= population_size (2)"),
    ({**EVO, "hpo": {"selection": {"type": "truncation", "elitism": False}}}, [],
     "hpo.selection.elitism has no effect when hpo.selection.type='truncation'"),
    ({**EVO, "hpo": {"selection": {"type": "truncation", "quantile": 0.9}}}, [], "hpo.selection: quantile must be in (0, 0.5]"),
    ({"algorithm": {"name": "GRPO", "init_sampler": "qmc"}}, [], "algorithm.init_sampler has no effect when algorithm.population_size=1"),
    ({**EVO, "hpo": {"narrowing": {"at": [0.5, 0.25]}}}, [], "hpo.narrowing: Narrowing.at must be strictly increasing"),
    ({**EVO, "hpo": {"narrowing": {"patience": 0}}}, [], "hpo.narrowing: Narrowing.patience must be >= 1 evaluation"),
    ({**EVO, "hpo": {"narrowing": {"no_signal": 2}}}, [], "hpo.narrowing: Narrowing.no_signal must be a share in [0, 1]"),
    ({**EVO, "hpo": {"mutation": {"model_prob": 2}}}, [], "hpo.mutation: Mutations.model_prob must be in [0, 1]"),
    ({**EVO, "hpo": {"mutation": {"model_sampler": "cma"}}}, [], "hpo.mutation.model_sampler='cma' is not valid"),
    ({**EVO, "hpo": {"selection": {"fitness": "best"}}}, [], "hpo.selection.fitness='best' is not valid"),
    ({}, ["train.max_time_clock=cpu"], "train.max_time_clock has no effect"),
    ({}, ["train.max_time=10", "train.max_time_clock=gpu"], "train.max_time_clock='gpu' is not valid"),
    ({**EVO, "hpo": {"hp_config": {"loss_type": {}}}}, [], "hpo.hp_config.loss_type: no default range for 'loss_type'"),
    ({**EVO, "algorithm": {"name": "GRPO", "population_size": 2, "init_sampler": "sobol"},
      "hpo": {"hp_config": {"lr": {"min": 1e-5, "max": 1e-3}}}}, [], "algorithm.init_sampler='sobol' is not valid"),
]


@pytest.mark.parametrize("data,overrides,expected", BAD_CONFIGS, ids=[e[2][:40] for e in BAD_CONFIGS])
def test_bad_config_is_a_one_line_error_naming_the_field(data, overrides, expected):
    with pytest.raises(ConfigError) as info:
        load(data, overrides)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_set_hyperparameter_validates(tiny):
    from conftest import make_grpo

    model, tok = tiny
    agent = make_grpo(model, tok)[0]
    with pytest.raises(ValueError, match="lr=-0.001 is not valid: lr must be a finite number > 0"):
        agent.set_hyperparameter("lr", -1e-3)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        agent.set_hyperparameter("top_k", -1)
    with pytest.raises(ValueError, match="lora_rank must be an integer >= 1, got 0"):
        agent.set_hyperparameter("lora_rank", 0)
    assert agent.config.lr > 0 and agent.lora_rank == 8 and agent.config.top_k == 0
    agent.set_hyperparameter("lr", 3e-4)
    assert agent.optimizer.param_groups[0]["lr"] == 3e-4


def test_set_null_removes_a_section_and_switches_evolution_off():
    data = {"train": {"max_steps": 4, "evaluation_interval": 2, "evo_steps": 2},
            "hpo": {"mutation": {"no_mutation": 0.5, "rl_hp": 0.5}, "selection": {"type": "tournament"},
                    "hp_config": {"lr": {"min": 1e-5, "max": 1e-3}}}}
    with pytest.raises(ConfigError, match=r"hpo.mutation has no effect .*--set hpo.mutation=null"):
        load(copy.deepcopy(data), ["train.evo_steps=null"])
    cfg = load(copy.deepcopy(data), ["train.evo_steps=null", "hpo.mutation=null", "hpo.selection=null"])
    assert cfg.train.evo_steps is None and not cfg.hpo.given("mutation") and not cfg.hpo.given("selection")
    cfg = load(copy.deepcopy(data), ["hpo.hp_config.lr=null", "hpo.nothing.here=null"])  # a mapping entry; absent: no-op
    assert cfg.hpo.hp_config == {} and cfg.train.evo_steps == 2
    cfg = load({"algorithm": {"name": "GRPO", "init_sampler": "qmc"}}, ["algorithm.init_sampler=null"])
    assert cfg.algorithm.init_sampler is None  # a plain setting set to null is null


def test_resume_accepts_the_budget_intervals_and_logging_only():
    from evollm.config.schema import check_resume_override

    for item in ("train.max_steps=9", "train.max_time=60", "train.evaluation_interval=5", "logging.tensorboard=false",
                 "logging=null"):
        check_resume_override(item)
    for item in ("seed=3", "algorithm.hyperparameters.lr=0.1", "train.evo_steps=4", "task.reward=last_number"):
        with pytest.raises(ConfigError, match="cannot change when resuming") as err:
            check_resume_override(item)
        assert "train.max_time" in str(err.value) and "logging.*" in str(err.value)


def test_a_misspelt_evolvable_name_is_named_before_its_range_is_checked():
    with pytest.raises(ConfigError, match="hpo.hp_config.clip_coeff: GRPO cannot evolve it; did you mean 'clip_coef'"):
        load({"train": EVO["train"]}, ["hpo.hp_config.clip_coeff.min=0.1"])


def test_default_search_space_and_named_default_ranges():
    from evollm.recipes.builders import build_hpo, build_narrowing

    cfg = load(EVO)  # two members, no hp_config: the LoRA learning-rate range
    hp, mutation, selection = build_hpo(cfg)
    assert hp.names() == ("lr",) and (hp["lr"].min, hp["lr"].max, hp["lr"].log) == (1e-5, 1e-3, True)
    assert build_narrowing(cfg).sizes(2) == [2, 1, 1, 1]  # the better of two trains alone from 10% of the budget
    fixed = load({**EVO, "algorithm": {"name": "GRPO", "population_size": 2, "hyperparameters": {"lr": 1e-3}}})
    assert fixed.hp_config() is None  # the user's lr is kept for every member
    assert load({"algorithm": {"name": "GRPO"}}).hp_config() is None  # one member: nothing to search
    named = load({**EVO, "hpo": {"hp_config": {"beta": {}, "lr": {"min": 1e-4, "max": 1e-3}}}}).hp_config()
    assert (named["beta"].min, named["beta"].max) == (0.0, 0.05) and named["lr"].max == 1e-3
    ppo = load({**GAME, **EVO, "algorithm": {"name": "LLMPPO", "population_size": 2}}).hp_config()
    assert ppo.names() == ("lr_actor",)


def test_budget_options_reach_the_objects():
    from evollm.recipes.builders import build_hpo, build_narrowing

    cfg = load({**copy.deepcopy(EVO), "algorithm": {"name": "GRPO", "population_size": 8},
                "hpo": {"narrowing": {"at": [0.25, 0.5], "keep": 0.5},
                        "selection": {"fitness": "train", "window": 5},
                        "mutation": {"model_prob": 0.5, "model_sampler": "tpe"}}},
               ["train.evaluation_interval=4", "train.evo_steps=2", "train.max_time=60", "train.max_time_clock=cpu"])
    _, mutation, selection = build_hpo(cfg)
    narrowing = build_narrowing(cfg)
    assert narrowing.at == (0.25, 0.5) and narrowing.sizes(8) == [8, 4, 2]
    assert selection.fitness == "train" and selection.window == 5
    assert mutation.model_prob == 0.5 and mutation.model_sampler == "tpe"
    assert cfg.train.max_time_clock == "cpu"


def test_default_narrowing_applies_to_evolving_populations_only():
    from evollm.recipes.builders import build_narrowing

    eight = {"algorithm": {"name": "GRPO", "population_size": 8}}
    narrowing = build_narrowing(load({**EVO, **eight}))
    assert narrowing.at == (0.05, 0.1, 0.2) and narrowing.sizes(8) == [8, 4, 2, 1]
    assert build_narrowing(load(eight)) is None  # no evolution: every member trains to the end
    assert build_narrowing(load(eight, ["hpo.narrowing.at=[0.5]"])).sizes(8) == [8, 4]  # unless asked for
    assert not narrowing.evaluate and build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.evaluate=true"])).evaluate
    assert (narrowing.revive, narrowing.patience, narrowing.no_signal) == (True, 3, 0.5)  # the stall swap, on
    off = build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.revive=false", "hpo.narrowing.no_signal=0.9"]))
    assert not off.revive and off.no_signal == 0.9
    two = build_narrowing(load({**EVO, **eight, "hpo": {"narrowing": {"min_size": 2}}}))
    assert two.sizes(8) == [8, 4, 2, 2]  # keeps evolving to the end
    assert build_narrowing(load({**EVO, **eight, "hpo": {"narrowing": {"at": []}}})) is None
    assert (narrowing.rollback, narrowing.decline, narrowing.rollback_lr, narrowing.max_rollbacks) == (True, 0.1, 0.5, 2)
    assert narrowing.decline_se == 1.5
    assert build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.decline_se=0"])).decline_se == 0.0
    with pytest.raises(ConfigError, match=r"^hpo.narrowing: Narrowing.decline_se must be >= 0 standard errors, got -1.0$"):
        load({**EVO, **eight}, ["hpo.narrowing.decline_se=-1"])
    off = build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.rollback=false", "hpo.narrowing.max_rollbacks=1"]))
    assert not off.rollback and off.max_rollbacks == 1
    assert (narrowing.on_tie, narrowing.tiebreak) == ("cut", "default_first")
    tie = build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.on_tie=one_rung", "hpo.narrowing.tiebreak=reward"]))
    assert (tie.on_tie, tie.tiebreak, tie.tie_se) == ("one_rung", "reward", 0.0)
    assert build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.tie_se=1"])).tie_se == 1.0
    assert narrowing.pair_cut and not build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.pair_cut=false"])).pair_cut
    assert narrowing.decay == "auto" and build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.decay=cosine"])).decay == "cosine"
    assert (narrowing.anneal, narrowing.anneal_lr, narrowing.max_anneals, narrowing.anneal_share,
            narrowing.anneal_floor) == (True, 0.5, 2, 0.1, "start")
    assert not build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.anneal=false"])).anneal
    assert build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.anneal_floor=range"])).anneal_floor == "range"
    assert build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.anneal_share=0"])).anneal_share == 0.0
    with pytest.raises(ConfigError, match=r"^hpo.narrowing: Narrowing.anneal_share must be a share of the budget in \[0, 1\), got 1.5$"):
        load({**EVO, **eight}, ["hpo.narrowing.anneal_share=1.5"])
    off = build_narrowing(load({**EVO, **eight}, ["hpo.narrowing.anneal=false", "hpo.narrowing.anneal_lr=0.3"]))
    assert (off.anneal, off.anneal_lr, off.max_anneals) == (False, 0.3, 2)
    with pytest.raises(ConfigError, match=r"^hpo.narrowing: Narrowing.max_anneals must be >= 0, got -1$"):
        load({**EVO, **eight}, ["hpo.narrowing.max_anneals=-1"])
    with pytest.raises(ConfigError, match=r"^hpo.narrowing: Narrowing.tie_se must be >= 0 standard errors, got -0.5$"):
        load({**EVO, **eight}, ["hpo.narrowing.tie_se=-0.5"])
    with pytest.raises(ConfigError, match=r"hpo.narrowing.on_tie='wait' is not valid; .*\['cut', 'one_rung'\]"):
        load({**EVO, **eight}, ["hpo.narrowing.on_tie=wait"])
    with pytest.raises(ConfigError, match=r"^hpo.narrowing: Narrowing.decline must be a share in \(0, 1\), got 1.5$"):
        load({**EVO, **eight}, ["hpo.narrowing.decline=1.5"])
