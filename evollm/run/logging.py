"""Live logging of a run through the tools people already watch: TensorBoard (on by default),
Weights & Biases and MLflow (when installed and asked for). Each is a loop callback.

What is logged, at the loop's step (``state.step``, completed training steps):

* every step, per member: each learn metric and cost as ``train/<name>`` (``train/kl``,
  ``train/time_generate_s``, ...);
* every evaluation, per member: ``eval/fitness``, ``eval/train_reward`` and each hyperparameter
  as ``hp/<name>``; for the population: ``population/best_fitness``, ``mean_fitness`` and
  ``generation``.

TensorBoard gets one run per member (``tensorboard/member_<id>/``) plus ``tensorboard/population/``,
so its charts overlay the members; W&B and MLflow get one run with keys ``member_<id>/<tag>``.
"""

from __future__ import annotations

import abc

import math
from pathlib import Path
from typing import Any

from .callbacks import Callback, LoopState


def logging_callbacks(run_dir: str | Path, tensorboard: bool = True, wandb: bool | dict = False,
                      mlflow: bool | dict = False, run_config: dict | None = None) -> list[Callback]:
    """The live loggers asked for (the ``logging:`` section of a run config), writing under
    ``run_dir``; ``wandb``/``mlflow`` are ``True`` or a dict of settings. Raises a one-line
    ``ValueError`` when W&B or MLflow is asked for but not installed."""
    run_dir = Path(run_dir)
    out: list[Callback] = []
    if tensorboard:
        out.append(TensorBoardLogger(run_dir / "tensorboard"))
    if wandb:
        out.append(WandbLogger(wandb if isinstance(wandb, dict) else {}, run_dir, run_config))
    if mlflow:
        out.append(MLflowLogger(mlflow if isinstance(mlflow, dict) else {}, run_config))
    return out


def step_scalars(metrics: dict) -> dict[str, float]:
    """``train/<name>`` for every finite number in one member's step metrics."""
    return {f"train/{k}": float(v) for k, v in metrics.items() if _finite(v)}


def evaluation_scalars(state: LoopState, fitness) -> tuple[dict[int, dict[str, float]], dict[str, float]]:
    """Per member ``eval/fitness``, ``eval/train_reward`` and ``hp/<name>``; and the population's
    ``population/best_fitness``, ``population/mean_fitness``, ``population/generation``."""
    rows = {r["member"]: r for r in state.record.rows if r["step"] == state.step}
    members: dict[int, dict[str, float]] = {}
    for agent, f in zip(state.agents, fitness):
        row = rows.get(agent.index, {})
        scalars = {"eval/fitness": f, "eval/train_reward": row.get("train_reward")}
        scalars.update({f"hp/{k[3:]}": v for k, v in row.items() if k.startswith("hp_")})
        members[agent.index] = {k: float(v) for k, v in scalars.items() if _finite(v)}
    finite = [float(f) for f in fitness if _finite(f)]
    population = {"population/generation": float(getattr(state.record, "generation", 0))}
    if finite:
        population.update({"population/best_fitness": max(finite), "population/mean_fitness": sum(finite) / len(finite)})
    return members, population


class TensorBoardLogger(Callback):
    """Scalars per member through :class:`torch.utils.tensorboard.SummaryWriter`: one writer per
    member (``<log_dir>/member_<id>``) and one for the population (``<log_dir>/population``).

    A resumed run (``state.step > 0`` when training begins) opens its writers with
    ``purge_step = step + 1``: what a killed process logged after its last checkpoint is hidden, so
    TensorBoard never shows a step twice."""

    def __init__(self, log_dir: str | Path, flush_secs: int = 10):
        self.log_dir = Path(log_dir)
        self.flush_secs = flush_secs
        self.writers: dict[str, Any] = {}
        self.purge_step: int | None = None
        self._opened: set[str] = set()

    def on_train_begin(self, state: LoopState) -> None:
        self.purge_step = state.step + 1 if state.step > 0 else None

    def writer(self, name: str):
        if name not in self.writers:
            from torch.utils.tensorboard import SummaryWriter

            purge = self.purge_step if name not in self._opened else None  # once per folder and process
            self._opened.add(name)
            self.writers[name] = SummaryWriter(log_dir=str(self.log_dir / name), flush_secs=self.flush_secs,
                                               purge_step=purge)
        return self.writers[name]

    def _log(self, name: str, scalars: dict[str, float], step: int) -> None:
        w = self.writer(name)
        for tag, value in scalars.items():
            w.add_scalar(tag, value, step)

    def on_step_end(self, state: LoopState, metrics: dict[int, dict]) -> None:
        for index, m in metrics.items():
            self._log(f"member_{index}", step_scalars(m), state.step)

    def on_evaluation(self, state: LoopState, fitness) -> None:
        members, population = evaluation_scalars(state, fitness)
        for index, scalars in members.items():
            self._log(f"member_{index}", scalars, state.step)
        self._log("population", population, state.step)
        for w in self.writers.values():
            w.flush()

    def on_selection(self, state: LoopState, result) -> None:
        living = {f"member_{a.index}" for a in state.agents} | {"population"}
        for name in [n for n in self.writers if n not in living]:
            self.writers.pop(name).close()

    def on_train_end(self, state: LoopState) -> None:
        for w in self.writers.values():
            w.close()
        self.writers.clear()


class _TrackerLogger(Callback, abc.ABC):
    """One tracker run for the whole population; keys ``member_<id>/<tag>`` and ``population/...``."""

    @abc.abstractmethod
    def log(self, scalars: dict[str, float], step: int) -> None:
        """Send ``scalars`` at ``step`` to the tracker."""

    def on_step_end(self, state: LoopState, metrics: dict[int, dict]) -> None:
        self.log({f"member_{i}/{k}": v for i, m in metrics.items() for k, v in step_scalars(m).items()}, state.step)

    def on_evaluation(self, state: LoopState, fitness) -> None:
        members, population = evaluation_scalars(state, fitness)
        flat = {f"member_{i}/{k}": v for i, s in members.items() for k, v in s.items()}
        self.log({**flat, **population}, state.step)


class WandbLogger(_TrackerLogger):
    """Weights & Biases: ``wandb.init(dir=<run_dir>, config=<run config>, **settings)``."""

    def __init__(self, settings: dict, run_dir: str | Path, run_config: dict | None = None):
        wandb = _require("wandb", "logging.wandb")
        self.run = wandb.init(**{"dir": str(run_dir), "config": run_config or {}, "project": "evollm", **settings})

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def on_train_end(self, state: LoopState) -> None:
        self.run.finish()


class MLflowLogger(_TrackerLogger):
    """MLflow: one run in ``experiment_name`` (the tracking server or local ``mlruns/`` that
    ``tracking_uri`` / ``MLFLOW_TRACKING_URI`` names), the run config as parameters."""

    def __init__(self, settings: dict, run_config: dict | None = None):
        mlflow = _require("mlflow", "logging.mlflow")
        self.mlflow = mlflow
        if settings.get("tracking_uri"):
            mlflow.set_tracking_uri(settings["tracking_uri"])
        if settings.get("experiment_name"):
            mlflow.set_experiment(settings["experiment_name"])
        self.run = mlflow.start_run(run_name=settings.get("run_name"))
        params = _flatten(run_config or {})
        if params:
            mlflow.log_params(params)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def on_train_end(self, state: LoopState) -> None:
        self.mlflow.end_run()


def _require(module: str, field_name: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{field_name} is set but {module} is not installed (pip install {module}), "
                         f"or set {field_name}: false") from None


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _flatten(data: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:250]
    return out
