"""``describe_config()``: every setting a run config takes, one line each, with its default and help text:
the sections of :class:`~evollm.config.run.RunConfig`, then every field of every algorithm's config
dataclass (``algorithm.hyperparameters.<field>``) with whether evolution may change it (``hpo.hp_config``)."""

from __future__ import annotations

import dataclasses

from evollm.config.run import ALGORITHMS, RunConfig, algorithm_class
from evollm.config.schema import document
from evollm.utils.fields import field_default, field_help


def describe_algorithm(name: str) -> list[str]:
    """``algorithm.hyperparameters.<field> [<name>, evolvable|fixed] = <default>: <help>`` for every field of the
    config dataclass of algorithm ``name``, plus ``lora_rank`` (the adapters' rank, evolvable everywhere)."""
    cls = algorithm_class(name)
    config_cls = cls.config_cls
    evolvable = set(cls.evolvable_names(config_cls()))
    helps = field_help(config_cls)
    lines = []
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        kind = "evolvable" if f.name in evolvable else "fixed"
        lines.append(f"algorithm.hyperparameters.{f.name} [{name}, {kind}] = {field_default(f)!r}: {helps[f.name]}")
    lines.append(f"hpo.hp_config.lora_rank [{name}, evolvable] = algorithm.lora.r: the LoRA rank of every adapter "
                 "(resized keeping the function)")
    return lines


def describe_config() -> str:
    """Every setting of a run config with its default and help text, one line each, then every algorithm's
    hyperparameters (default, help, and whether they can evolve)."""
    lines = document(RunConfig).splitlines()
    for name in ALGORITHMS:
        lines += describe_algorithm(name)
    return "\n".join(lines)
