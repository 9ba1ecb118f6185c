"""The run directory as ``evollm train`` and ``evollm resume`` claim it: a fresh run needs an empty
directory (or ``--overwrite``, or a run that never completed a step); a resumed run must be the run its
checkpoint recorded, apart from the fields :mod:`evollm.run.resume_check` lists as safe."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from evollm.config.schema import ConfigError
from evollm.run.checkpoints import list_checkpoints, newest_valid
from evollm.run.lock import LOCK
from evollm.run.resume_check import (SAFE_ON_RESUME, config_changes, covers, record_changes, refusal_message,
                                     refused_changes)
from evollm.run.state import RUN_STATE
from evollm.utils.atomic import MANIFEST, CheckpointError

RUN_CONFIG = "run_config.json"


def _entries(out: Path) -> list[Path]:
    return [p for p in out.iterdir() if not p.name.startswith(LOCK)]  # the lock (and one half-made by a kill)


def completed_steps(out: Path) -> int:
    """Steps a run directory shows as done: a complete checkpoint, progress.json or metrics rows (0: none)."""
    ckpts = [s for s, p in list_checkpoints(out / "checkpoints") if (p / MANIFEST).is_file()]
    try:
        progress = json.loads((out / "progress.json").read_text()).get("step", 0)
    except (OSError, ValueError, AttributeError):
        progress = 0
    metrics = out / "metrics.csv"
    rows = metrics.is_file() and len(metrics.read_text().splitlines()) > 1
    return max(ckpts + [progress if isinstance(progress, int) else 0, 1 if rows else 0])


def clear(out: Path) -> None:
    """Remove everything in ``out`` but its lock."""
    for p in _entries(out):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def prepare_output_dir(out: Path, overwrite: bool, log: Callable[[str], None] = print) -> None:
    """A fresh run needs an empty (or new) output_dir; ``overwrite`` clears a previous evollm run there, and a
    run that never completed a step (killed while starting) is started afresh without it."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {str(out)!r} is a file, not a directory")
    if not out.exists() or not _entries(out):
        return
    is_run = (out / RUN_CONFIG).exists() or (out / "config.json").exists() or (out / "checkpoints").is_dir()
    if is_run and not overwrite and completed_steps(out) == 0:
        log(f"evollm: output_dir {out} holds a run that never completed a step (stopped while starting); "
            "starting it afresh")
        clear(out)
        return
    if not overwrite:
        what = "a previous run" if is_run else "files"
        raise ConfigError(f"output_dir {str(out)!r} already holds {what}; pass --overwrite to replace it, "
                          f"`evollm resume {out}` to continue it, or choose another output_dir")
    if not is_run:
        raise ConfigError(f"output_dir {str(out)!r} is not empty and is not an evollm run directory; "
                          "--overwrite only replaces evollm runs, choose another output_dir")
    clear(out)


def check_overrides(overrides, allowed) -> None:
    """``--set`` on resume: a field outside :data:`SAFE_ON_RESUME` needs ``--allow-change FIELD``."""
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        if "=" in item and not covers(key, SAFE_ON_RESUME) and not covers(key, allowed):
            raise ConfigError(f"--set {item!r}: {key} cannot change when resuming (only "
                              f"{', '.join(SAFE_ON_RESUME[:-1])} may); pass --allow-change {key} to change it anyway "
                              "(recorded in the run)")


def resume_checkpoint(out: Path) -> tuple[Path, dict]:
    """The checkpoint a resume continues from and its ``run_state.json`` (nothing is cleaned up here)."""
    try:
        folder = newest_valid(out / "checkpoints", log=lambda msg: None, clean=False)
    except CheckpointError as e:
        if completed_steps(out) == 0:
            raise CheckpointError(f"{e}: the run never completed a step; start it again with `evollm train "
                                  f"{out / RUN_CONFIG}` (no --overwrite needed)") from None
        raise
    try:
        state = json.loads((folder / RUN_STATE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder}: {RUN_STATE} is unreadable ({e})") from None
    return folder, state


def check_resumed_config(out: Path, cfg, allowed, run_config_cls, record: bool = True) -> list:
    """Compare ``cfg`` (the resumed config) with the config recorded in the newest valid checkpoint; refuse
    unsafe changes that ``allowed`` does not name and a ``train.max_steps`` below the steps done. Returns
    the changes (recorded in ``config_changes.json`` when ``record``)."""
    folder, state = resume_checkpoint(out)
    step = int(state.get("step", 0))
    if cfg.train.max_steps < step:
        raise ConfigError(f"train.max_steps={cfg.train.max_steps} is below the {step} steps this run has done "
                          f"(checkpoint {folder}); set it to {step} or more")
    saved = state.get("config")
    if not isinstance(saved, dict):
        return []
    try:
        saved_full = run_config_cls.from_dict(json.loads(json.dumps(saved))).to_dict()
    except (ConfigError, ValueError, TypeError, KeyError):
        saved_full = saved  # recorded by another version of evollm: compare what was given
    resumed = cfg.to_dict() if saved_full is not saved else cfg.to_dict(explicit=True)
    saved_full.pop("output_dir", None)
    resumed.pop("output_dir", None)
    changes = config_changes(saved_full, resumed)
    refused = refused_changes(changes, allowed)
    if refused:
        raise ConfigError(refusal_message(refused, folder, len(changes)))
    if changes and record:
        record_changes(out, changes, step)
    return changes


def member_overrides(changes) -> dict:
    """Allowed changes of ``algorithm.hyperparameters.NAME``: applied to every resumed member."""
    prefix = "algorithm.hyperparameters."
    return {field[len(prefix):]: new for field, _, new in changes
            if field.startswith(prefix) and "." not in field[len(prefix):]}


def apply_on_resume(values: dict, log: Callable[[str], None] = print):
    """A loop callback that sets ``values`` (allowed changes of algorithm.hyperparameters) on every member
    once the checkpoint is restored (the checkpointer restores first), the member parked as the reserve
    (``hpo.narrowing.revive``: it may train later) included."""
    from evollm.training.callbacks import Callback

    class ApplyOnResume(Callback):
        def on_train_begin(self, state) -> None:
            reserve = getattr(state.record, "reserve", None)
            parked = [reserve.member] if reserve is not None and reserve.member is not None else []
            for agent in list(state.agents) + parked:
                for name, value in values.items():
                    try:
                        agent.set_hyperparameter(name, value)
                    except (ValueError, TypeError) as e:
                        raise ConfigError(f"--allow-change algorithm.hyperparameters.{name}: cannot set it on the "
                                          f"resumed members ({e})") from None
            log(f"evollm: resumed members now have {values} (allowed change, recorded in config_changes.json)")

    return ApplyOnResume()
