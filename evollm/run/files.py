"""The run directory kept current while a run goes, so that a run that dies still shows what it
learnt: ``metrics.csv`` grows by a few lines every step, ``report.csv``/``lineage.csv`` and the plots
are rewritten (atomically) at every evaluation and selection, the per-member diagnostics at the end, and ``progress.json`` says how far the
run got and whether it finished. ``evollm report RUN_DIR`` reads these files back.
"""

from __future__ import annotations

import csv
import os
import socket
import time
from pathlib import Path

from evollm.run.population import write_csv
from evollm.utils.atomic import atomic_file, write_json
from .callbacks import Callback, LoopState


class RunFilesWriter(Callback):
    """Writes ``report.csv``, ``lineage.csv``, ``metrics.csv``, ``progress.json`` and (with ``plots``)
    the PNGs into ``run_dir`` as the run goes.

    With ``plots``, the population plots are redrawn at an evaluation unless drawing them has
    already taken more than ``plot_budget`` of the run's wall time (tiny models evaluated every few
    steps would otherwise spend most of their time in matplotlib); everything is drawn at the end.

    A step's metrics rows are appended once the step is complete, evaluation included: at the next
    step's end, or at once when the step is evaluated. When a new metric column appears, the file is
    rewritten with the wider header (atomically), so every line always matches the header.
    """

    def __init__(self, run_dir: str | Path, plots: bool = True, plot_budget: float = 0.1):
        self.run_dir = Path(run_dir)
        self.plots = plots
        self.plot_budget = plot_budget
        self.plot_seconds = 0.0
        self.written = 0
        self.columns: list[str] = []
        self.started = time.time()

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.csv"

    # ------------------------------------------------------------------ events
    def on_train_begin(self, state: LoopState) -> None:
        self.started = time.time()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._rewrite_metrics(state.record.metric_rows)  # a resumed run starts from its record, not the file
        self._write_tables(state)
        self._progress(state, "running")

    def on_step_end(self, state: LoopState, metrics: dict[int, dict]) -> None:
        self._append_metrics(state.record.metric_rows, before_step=state.step)

    def on_evaluation(self, state: LoopState, fitness) -> None:
        self._append_metrics(state.record.metric_rows)
        self._write_tables(state)
        if self.plots and self.plot_seconds <= self.plot_budget * (time.time() - self.started):
            self._plot(state)
        self._progress(state, "running")

    def on_selection(self, state: LoopState, result) -> None:
        write_csv(state.record.lineage(), self.run_dir / "lineage.csv")
        if state.record.selection_rows:
            write_csv(state.record.selections(), self.run_dir / "selections.csv")
        self._progress(state, "running")

    def on_train_end(self, state: LoopState) -> None:
        self._append_metrics(state.record.metric_rows)
        self._write_tables(state)
        if self.plots:
            self._plot(state, every_member=True)
        self._progress(state, "finished")

    # ------------------------------------------------------------------ files
    def _write_tables(self, state: LoopState) -> None:
        for name, frame in (("report", state.record.report()), ("lineage", state.record.lineage()),
                            ("selections", state.record.selections())):
            if len(frame):  # no header-only files: a reader finds either rows or nothing
                write_csv(frame, self.run_dir / f"{name}.csv")

    def _plot(self, state: LoopState, every_member: bool = False) -> None:
        """The population plots; the per-member diagnostics grids (one PNG per member ever born,
        the slow part) only at the end: ``evollm report`` draws them for a run that died."""
        from evollm.run.plots import plot_run

        record, started = state.record, time.perf_counter()
        plot_run(record.report(), record.lineage(), record.metrics(), self.run_dir,
                 members=None if every_member else ())
        self.plot_seconds += time.perf_counter() - started

    def _rewrite_metrics(self, rows: list[dict]) -> None:
        self.columns = _columns(rows)
        self.written = len(rows)
        if not rows:
            self.metrics_path.unlink(missing_ok=True)  # rows of another run would not match this one
            return
        with atomic_file(self.metrics_path) as tmp, tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, self.columns, restval="", lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)

    def _append_metrics(self, rows: list[dict], before_step: int | None = None) -> None:
        end = len(rows)
        if before_step is not None:
            while end > self.written and rows[end - 1]["step"] >= before_step:
                end -= 1
        pending = rows[self.written:end]
        if not pending:
            return
        if any(k not in self.columns for row in pending for k in row):
            self._rewrite_metrics(rows[:end])
            return
        with self.metrics_path.open("a", newline="") as f:
            csv.DictWriter(f, self.columns, restval="", lineterminator="\n").writerows(pending)
            f.flush()
        self.written = end

    def close(self) -> None:
        """The run ended without :meth:`on_train_end` (Ctrl-C, SIGTERM, an error): ``progress.json`` says
        ``stopped`` at the last step it recorded, not ``running``."""
        state = getattr(self, "_state", None)
        if state is not None and self._status != "finished":
            self._progress(state, "stopped")

    def _progress(self, state: LoopState, status: str) -> None:
        """``progress.json``: status (running / finished), step, max_steps, generation, living members,
        last fitness, process id and host (``evollm report`` tells a live run from a dead one)."""
        self._state, self._status = state, status
        last = {r["member"]: r["fitness"] for r in state.record.rows}
        data = {"status": status, "step": state.step, "max_steps": state.max_steps,
                "generation": state.record.generation, "members": [a.index for a in state.agents],
                "last_fitness": {str(a.index): last.get(a.index) for a in state.agents},
                "started": _iso(self.started), "updated": _iso(time.time()),
                "pid": os.getpid(), "host": socket.gethostname()}
        write_json(self.run_dir / "progress.json", data)


def _columns(rows: list[dict]) -> list[str]:
    """Every key of ``rows`` in first-seen order, the cost columns kept last."""
    from evollm.run.population import COST_COLUMNS

    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(k for k in row if k not in COST_COLUMNS))
    return list(seen) + [c for c in COST_COLUMNS if any(c in r for r in rows)] if rows else []


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))
