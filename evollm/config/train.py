"""The ``train:`` section of a run config: the evolution loop's budget, evaluations, checkpoints and run directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from evollm.config.schema import ConfigError, Section, option


@dataclass
class TrainSection(Section):
    """The evolution loop and the run directory."""

    max_steps: int = option(100, "Training steps (every member answers one batch of prompts and learns once per "
                            "step; AgileRL counts prompts instead).")
    max_time: float | None = option(None, "Time budget in seconds (on max_time_clock): the run stops after the step "
                                    "that crosses it, with a final evaluation; null: no limit.")
    max_time_clock: str = option("wall", "Clock of max_time (and of hpo.narrowing): 'wall' seconds, or 'cpu': this "
                                 "process's CPU seconds over all its threads (fairer on a shared machine).",
                                 choices=("wall", "cpu"), when={"max_time": lambda v: v is not None})
    evaluation_interval: int = option(10, "Steps between evaluations of every member on the fixed test set.")
    evo_steps: int | None = option(None, "Steps between selections (a multiple of evaluation_interval); "
                                   "null: no evolution.")
    save_elite: bool = option(False, "Save the evaluated best member at every selection (elite_path/step_N) "
                              "and at the end (elite_path/final, also without evolution).")
    keep_best: bool = option(False, "Keep the best evaluated state of the run (a clone; saved with checkpoints) and "
                             "return it as the best member (best_member/, export) when no live member's last fitness "
                             "reaches it less its luck (the expected maximum of the run's evaluations, in its se).")
    lr_cooldown: float = option(0.0, "Share of the budget at its end (of max_steps, or of max_time where that is "
                                "further spent) over which every member's learning rates fall linearly to "
                                "lr_cooldown_floor times their value, constant before it (WSD's stable-then-decay "
                                "schedule; the member's hyperparameters, and mutations of them, keep their values); "
                                "0: off.")
    lr_cooldown_floor: float = option(0.1, "The factor on the learning rates at the end of the budget.",
                                      when={"lr_cooldown": lambda v: v > 0})
    elite_path: str | None = option(None, "Folder of the saved elites (relative to output_dir; default "
                                    "output_dir/elites).",
                                    when={"save_elite": (True,)}, path=True)
    checkpoint_every: int | None = option(None, "Steps between checkpoints of the whole run into "
                                          "output_dir/checkpoints/step_N (also at every selection, on "
                                          "SIGINT/SIGTERM and at the end); null: every evaluation_interval; "
                                          "0: only at selections, signals and the end.")
    keep_checkpoints: int | None = option(3, "Newest checkpoints kept (and the newest one in which some member "
                                          "was healthy); null keeps all.")
    stop_grace: float | None = option(20.0, "Seconds SIGINT/SIGTERM waits for the current step to end and be "
                                      "saved; a step still running then is abandoned and the last checkpoint "
                                      "kept (a stop takes at most this plus one checkpoint write); null: wait.")
    episodes_per_step: int = option(16, "Training seeds per step of a multi-turn game (all processes together: "
                                    "a multiple of their number under accelerate launch).",
                                    when={"env.type": ("multiturn",)})
    eval_episodes: int = option(64, "Fixed greedy evaluation episodes of a multi-turn game (split over processes: "
                                "a multiple of their number under accelerate launch).",
                                when={"env.type": ("multiturn",)})

    def finalize(self) -> None:
        if self.max_time is not None and not self.max_time > 0:
            raise ConfigError(f"train.max_time must be > 0 seconds or null, got {self.max_time}")
        for name in ("max_steps", "evaluation_interval", "episodes_per_step", "eval_episodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise ConfigError(f"train.checkpoint_every must be >= 0 or null, got {self.checkpoint_every}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ConfigError(f"train.keep_checkpoints must be >= 1 or null, got {self.keep_checkpoints}")
        if self.stop_grace is not None and not self.stop_grace > 0:
            raise ConfigError(f"train.stop_grace must be > 0 seconds or null, got {self.stop_grace}")
        if not 0.0 <= self.lr_cooldown < 1.0:
            raise ConfigError(f"train.lr_cooldown must be a share of the budget in [0, 1), got {self.lr_cooldown}")
        if not 0.0 <= self.lr_cooldown_floor <= 1.0:
            raise ConfigError(f"train.lr_cooldown_floor must be a factor in [0, 1], got {self.lr_cooldown_floor}")

    def checkpoint_interval(self) -> int:
        return self.evaluation_interval if self.checkpoint_every is None else self.checkpoint_every

    def loop_settings(self, output_dir: str | Path, seed: int, resume: bool = False, run_config: dict | None = None,
                      verbose: bool = True):
        """The :class:`~evollm.training.settings.LoopSettings` of this section (paths resolved against
        ``output_dir``: checkpoints in ``output_dir/checkpoints``, elites in ``output_dir/elites`` by default)."""
        from evollm.training.settings import LoopSettings

        out = Path(output_dir)
        return LoopSettings(max_steps=self.max_steps, evaluation_interval=self.evaluation_interval,
                            evo_steps=self.evo_steps, max_time=self.max_time, save_elite=self.save_elite,
                            keep_best=self.keep_best, lr_cooldown=self.lr_cooldown,
                            lr_cooldown_floor=self.lr_cooldown_floor, elite_path=self.elite_path or str(out / "elites"),
                            checkpoint_dir=str(out / "checkpoints"), checkpoint_every=self.checkpoint_interval(),
                            keep_checkpoints=self.keep_checkpoints, stop_grace=self.stop_grace, resume=resume,
                            run_config=run_config, seed=int(seed), verbose=verbose)
