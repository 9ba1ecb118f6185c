"""The ``logging:`` section of a run config: where a run's live metrics go besides its CSV files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evollm.config.schema import Section, option, unknown_key_error


@dataclass
class LoggingSection(Section):
    """Live logging of the run (see :mod:`evollm.run.logging`); the CSV files of the run directory are
    always kept current."""

    tensorboard: bool = option(True, "Write TensorBoard event files under output_dir/tensorboard (one run per "
                               "member and one for the population).")
    wandb: bool | dict[str, Any] = option(False, "Log to Weights & Biases: true, or a dict of wandb.init keywords "
                                          "(project, entity, name, mode, ...). Needs `pip install wandb`.")
    mlflow: bool | dict[str, Any] = option(False, "Log to MLflow: true, or a dict with tracking_uri, "
                                           "experiment_name, run_name. Needs `pip install mlflow`.")
    plots: bool = option(True, "Redraw the run's PNGs at evaluations (at most ~10% of the run's wall time) and "
                         "at the end.")

    def finalize(self) -> None:
        if isinstance(self.mlflow, dict):
            valid = ["experiment_name", "run_name", "tracking_uri"]
            for key in self.mlflow:
                if key not in valid:
                    raise unknown_key_error(key, "logging.mlflow", valid)
