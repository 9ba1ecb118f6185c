"""The evolution loop's options, in one object.

:class:`LoopSettings` is what :func:`~evollm.training.loop.evolve` and the three drivers built on it
(:func:`~evollm.training.loop.finetune_llm_reasoning`, :func:`~evollm.training.multiturn.finetune_llm_multiturn`,
:func:`~evollm.training.ippo.finetune_ippo`) take. A recipe builds it once (``TrainSection.loop_settings``)
and hands it down; in a script the same options may be passed as keywords instead::

    finetune_llm_reasoning(pop, env, LoopSettings(max_steps=100, evo_steps=10))
    finetune_llm_reasoning(pop, env, max_steps=100, evo_steps=10)      # the same run

Objects (the selection, the mutation engine, callbacks, the population record) are arguments of
their own; only plain options live here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .quarantine import DivergenceLimits
from .schedule import validate_cooldown


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class LoopSettings:
    """Every option of the evolution loop (each field documented in its ``help``)."""

    max_steps: int | None = _opt(None, "Training steps: every member answers one batch of prompts (or plays one "
                                 "step's episodes) and learns once per step. Required.")
    evaluation_interval: int = _opt(10, "Steps between evaluations of every member on the fixed test set.")
    evo_steps: int | None = _opt(None, "Steps between selections (a multiple of evaluation_interval unless the "
                                 "selection ranks on training rewards); None: no "
                                 "evolution.")
    max_time: float | None = _opt(None, "Wall-clock budget in seconds: the run stops after the step that crosses "
                                  "it, with a final evaluation; None: no limit.")
    max_reward: float | None = _opt(None, "Stop after an evaluation whose best fitness reaches this; None: never.")
    save_elite: bool = _opt(False, "Save the evaluated best member at every selection (elite_path/step_N) and at "
                            "the end (elite_path/final).")
    keep_best: bool = _opt(False, "Keep the best evaluated state of the run (a clone of the member whose fitness "
                           "beat every earlier evaluation) and return it as the best member at the end when "
                           "no live member's last fitness reaches it; saved with run checkpoints.")
    elite_path: str | Path | None = _opt(None, "Folder of the saved elites; None: ./elite.")
    checkpoint_dir: str | Path | None = _opt(None, "Checkpoint the whole run into checkpoint_dir/step_N; None: no "
                                             "run checkpoints.")
    checkpoint_every: int | None = _opt(None, "Steps between checkpoints (also at every selection, on "
                                        "SIGINT/SIGTERM and at the end); None: every evaluation_interval; 0: only "
                                        "at selections, signals and the end.")
    keep_checkpoints: int | None = _opt(3, "Newest checkpoints kept (and the newest healthy one); None keeps all.")
    stop_grace: float | None = _opt(20.0, "Seconds a stop signal (SIGINT/SIGTERM) waits for the current step to "
                                    "end and be saved; a step still running then is abandoned (the last "
                                    "checkpoint kept). None: wait for the step.")
    resume: bool = _opt(False, "Continue exactly from the newest valid checkpoint in checkpoint_dir (members and "
                        "env built as for the original run).")
    run_config: dict | None = _opt(None, "Plain data written into every checkpoint as given (the recipe's run "
                                   "config); never read by the loop.")
    seed: int = _opt(0, "Seed of the loop: torch is seeded with seed + step before every step.")
    verbose: bool = _opt(True, "Progress bar and one line per evaluation.")
    divergence: DivergenceLimits | None = _opt(None, "When a member with finite but blown-up weights, KL or loss "
                                               "is quarantined (DivergenceLimits); None: the default limits.")
    max_time_clock: Any = _opt("wall", "Clock of max_time and of the narrowing schedule: 'wall' seconds, 'cpu' "
                               "(this process's CPU seconds over all its threads), or a callable returning "
                               "seconds (a clock of your own, e.g. one that charges a cost model).")
    lr_cooldown: float = _opt(0.0, "Share of the budget (max_steps, or max_time where further spent) at its end over "
                              "which every member's learning rates fall linearly to lr_cooldown_floor times their "
                              "value (constant before it); 0: off.")
    lr_cooldown_floor: float = _opt(0.1, "The factor on the learning rates at the end of the cool-down.")
    narrowing: Any = _opt(None, "A Narrowing (evollm.hpo.narrowing): the worst members are released at fixed "
                          "fractions of the budget (successive halving into PBT); None: the population stays whole.")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Reject values no run can use (one line naming the option)."""
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.evaluation_interval < 1:
            raise ValueError(f"evaluation_interval must be >= 1, got {self.evaluation_interval}")
        if not callable(self.max_time_clock) and self.max_time_clock not in ("wall", "cpu"):
            raise ValueError(f"max_time_clock={self.max_time_clock!r} is not valid; choose 'wall', 'cpu' or a "
                             "callable returning seconds")
        if self.max_time is not None and not self.max_time > 0:
            raise ValueError(f"max_time must be > 0 seconds, got {self.max_time}")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 or None, got {self.checkpoint_every}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 or None, got {self.keep_checkpoints}")
        if self.stop_grace is not None and not self.stop_grace > 0:
            raise ValueError(f"stop_grace must be > 0 seconds or None, got {self.stop_grace}")
        validate_cooldown(self.lr_cooldown, self.lr_cooldown_floor)
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir (the folder holding the step_N checkpoints)")

    def checkpoint_interval(self) -> int:
        """Steps between periodic checkpoints (``checkpoint_every``, default ``evaluation_interval``)."""
        return self.evaluation_interval if self.checkpoint_every is None else self.checkpoint_every

    def replace(self, **changes) -> "LoopSettings":
        return dataclasses.replace(self, **changes)


#: the option names (for callers that take them as keywords)
OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LoopSettings))


def loop_settings(settings: LoopSettings | None, options: dict, caller: str) -> LoopSettings:
    """``settings`` with keyword ``options`` applied on top (a :class:`LoopSettings` field each);
    any other keyword is a one-line ``TypeError`` naming ``caller``."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{caller} got unexpected keyword(s) {unknown}; loop options: {sorted(OPTIONS)}")
    if settings is None:
        return LoopSettings(**options)
    if not isinstance(settings, LoopSettings):
        raise TypeError(f"{caller}: settings must be a LoopSettings, got {type(settings).__name__}")
    return dataclasses.replace(settings, **options) if options else settings


def describe_loop_settings() -> str:
    """``name = default: help`` for every loop option, one line each."""
    return "\n".join(f"{f.name} = {f.default!r}: {f.metadata['help']}" for f in dataclasses.fields(LoopSettings))
