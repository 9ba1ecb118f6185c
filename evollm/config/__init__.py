"""The run config: ``evollm train CONFIG.yaml`` as documented dataclass sections.

* :mod:`evollm.config.schema` -- the section machinery (typed fields with help text, strict loading,
  did-you-mean, ``--set`` overrides, rules for settings that would have no effect);
* :mod:`evollm.config.hpo` -- the ``hpo:`` section (hp_config, mutation, selection);
* :mod:`evollm.config.train` -- the ``train:`` section (budget, evaluations, checkpoints);
* :mod:`evollm.config.logs` -- the ``logging:`` section;
* :mod:`evollm.config.run` -- every other section and :class:`RunConfig`;
* :mod:`evollm.config.describe` -- ``describe_config()``: every setting and every algorithm field, documented.

Only :mod:`evollm.recipes` reads a run config: it builds the objects once and hands them down.
"""

from .hpo import HPOSection
from .run import (ALGORITHMS, HF_SOURCES, SINGLE_TURN_TASKS, TEAM_TASKS, TINY_SOURCES, AlgorithmSection, EnvSection,
                  LoggingSection, LoraSection, ModelSection, RunConfig, TaskSection, TrainSection, algorithm_class,
                  multiturn_tasks, task_names)
from .describe import describe_config
from .schema import ConfigError, apply_override

__all__ = ["ALGORITHMS", "HF_SOURCES", "SINGLE_TURN_TASKS", "TEAM_TASKS", "TINY_SOURCES", "AlgorithmSection",
           "ConfigError", "EnvSection", "HPOSection", "LoggingSection", "LoraSection", "ModelSection", "RunConfig",
           "TaskSection", "TrainSection", "algorithm_class", "apply_override", "describe_config", "multiturn_tasks",
           "task_names"]
