"""``evollm report RUN_DIR``: read a run directory back (finished, still going, or dead), print
what it learnt and redraw every plot from its files alone.

The files it reads are those :class:`evollm.run.files.RunFilesWriter` keeps current
(``report.csv``, ``lineage.csv``, ``metrics.csv``, ``progress.json``) and, when present,
``config.json`` and ``summary.json`` from ``evollm train``.
"""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from evollm.run.plots_lineage import ancestry
from evollm.run.search import describe, search_cost
from evollm.utils.atomic import write_text
from evollm.run.population import LINEAGE_DTYPES, METRICS_DTYPES, REPORT_DTYPES, typed, write_csv


@dataclass
class RunFiles:
    """The tables and JSON files of one run directory."""

    path: Path
    report: pd.DataFrame
    lineage: pd.DataFrame
    metrics: pd.DataFrame
    progress: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


def read_run(run_dir: str | Path) -> RunFiles:
    """The run's tables with their column types (``parent`` as ``Int64``, ...); a one-line
    ``ValueError`` when ``run_dir`` holds none of them."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ValueError(f"run directory {str(path)!r} does not exist")
    tables = {name: _read_csv(path / f"{name}.csv", dtypes)
              for name, dtypes in (("report", REPORT_DTYPES), ("lineage", LINEAGE_DTYPES), ("metrics", METRICS_DTYPES))}
    if all(t.empty for t in tables.values()):
        raise ValueError(f"{path}: no report.csv, lineage.csv or metrics.csv with rows; not an evollm run "
                         "directory, or the run has not finished a step yet")
    return RunFiles(path, **tables, progress=_read_json(path / "progress.json"),
                    config=_read_json(path / "config.json"), summary=_read_json(path / "summary.json"))


def run_status(run: RunFiles) -> str:
    """``finished``, ``running`` (its process is alive on this host), ``stopped`` (it is not), or
    ``unknown`` (no progress.json, e.g. a run driven from Python without the files writer)."""
    status = run.progress.get("status")
    if status == "finished" or run.summary:
        return "finished"
    if status is None:
        return "unknown"
    if status == "stopped":  # the run ended without finishing (Ctrl-C, SIGTERM, an error)
        return "stopped"
    pid, host = run.progress.get("pid"), run.progress.get("host")
    if host != socket.gethostname():
        return "running"  # another machine's process cannot be checked from here
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError):
        return "stopped"
    return "running"


def lineage_chain(lineage: pd.DataFrame, member: int) -> list[dict]:
    """``member``'s ancestry back to its founder: one dict per birth (member, parent, step, mutation)."""
    return ancestry(lineage, member) if len(lineage) else []


def fitness_table(report: pd.DataFrame) -> pd.DataFrame:
    """Per evaluation step: best, mean and worst fitness and the best member."""
    if report.empty:
        return pd.DataFrame(columns=["step", "best", "mean", "worst", "best_member"])
    finite = report[report["fitness"].map(lambda f: math.isfinite(f))]
    g = finite.groupby("step")
    out = pd.DataFrame({"best": g["fitness"].max(), "mean": g["fitness"].mean(), "worst": g["fitness"].min(),
                        "best_member": finite.loc[g["fitness"].idxmax(), ["step", "member"]].set_index("step")["member"]})
    return out.reset_index()


def summarize(run: RunFiles) -> str:
    """The text ``evollm report`` prints."""
    lines = [f"run {run.path}"]
    alg = (run.config.get("algorithm") or {}).get("name") if run.config else None
    status = run_status(run)
    step, max_steps = run.progress.get("step"), run.progress.get("max_steps")
    where = f"step {step}/{max_steps}" if step is not None else ""
    if status in ("running", "stopped") and run.progress.get("updated"):
        where += f", last update {run.progress['updated']}"
    lines.append(f"status: {status}" + (f" ({where})" if where else "")
                 + (f"; algorithm {alg}" if alg else ""))
    if status == "stopped":
        lines.append("  the run's process is gone: the files hold everything up to its last evaluation")
    report, lineage, metrics = run.report, run.lineage, run.metrics
    n_members = lineage["member"].nunique() if len(lineage) else report["member"].nunique() if len(report) else 0
    generations = int(lineage["generation"].max()) if len(lineage) else 0
    lines.append(f"members ever: {n_members}; generations: {generations}; evaluations: "
                 f"{report['step'].nunique() if len(report) else 0}; training steps logged: "
                 f"{int(metrics['step'].max()) if len(metrics) else 0}")
    if report.empty:
        lines.append("no evaluation yet: only learn metrics are available")
        return "\n".join(lines)
    last = report[report["step"] == report["step"].max()]
    best = last.loc[last["fitness"].idxmax()]
    member = int(best["member"])
    lines.append(f"\nbest member: {member} (fitness {best['fitness']:.4f} at step {int(best['step'])}, "
                 f"train reward {best.get('train_reward', math.nan):.4f})")
    hps = {c[3:]: best[c] for c in report.columns if c.startswith("hp_") and pd.notna(best[c])}
    lines.append("  hyperparameters: " + "  ".join(f"{k}={_fmt(v)}" for k, v in hps.items()))
    chain = lineage_chain(lineage, member)
    if chain:
        lines.append("  lineage: " + " <- ".join(
            f"m{c['member']}" + (f" ({c['mutation']}, step {c['step']})" if c["parent"] is not None else " (founder)")
            for c in chain))
    lines.extend(held_outside(run.summary, member))
    cost = search_cost(lineage, metrics, member, int(best["step"]))
    if cost is not None:
        lines.extend(describe(cost))
    table = fitness_table(report)
    if len(table) > 16:
        keep = sorted(set(range(0, len(table), math.ceil(len(table) / 14))) | {len(table) - 1})
        table = table.iloc[keep]
    lines.append("\nfitness over time (held-out):")
    lines.append(table.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    return "\n".join(lines)


def held_outside(summary: dict, member: int) -> list[str]:
    """What ``summary.json`` says of the members held outside the population: the kept best state
    (``train.keep_best``, ``hpo.narrowing.rollback``) and the reserve (``hpo.narrowing.revive``), the
    roll-backs, the anneals (``hpo.narrowing.anneal``), and which member ``best_member/``
    holds when it is not ``member`` (the best of the last evaluation)."""
    out = []
    kept = summary.get("best_state")
    if kept:
        out.append(f"  kept best state: member {kept['source']} as it was at step {kept['step']} "
                   f"(fitness {kept['fitness']:.4f})")
    reserve = summary.get("reserve") or {}
    if reserve.get("swapped_step") is not None:
        out.append(f"  stall swap at step {reserve['swapped_step']}: the reserve, member {reserve['revived']}, trained on "
                   "in place of the stalled member (hpo.narrowing.revive)")
    if reserve.get("rescued_step") is not None:
        out.append(f"  every live member was quarantined at step {reserve['rescued_step']}: the reserve, member "
                   f"{reserve['rescued']}, trained on in their place")
    for r in summary.get("rollbacks") or []:
        rates = f" ({r['rates']})" if r.get("rates") else ""
        out.append(f"  roll-back at step {r['step']}: member {r['fell']} fell away from the best state; member "
                   f"{r['copy']}, a copy of it at a lower learning rate{rates}, trained on (hpo.narrowing.rollback)")
    for r in summary.get("anneals") or []:
        out.append(f"  anneal at step {r['step']}: member {r['member']} stopped improving and trained on at "
                   f"{r.get('rates') or 'a lower learning rate'} (hpo.narrowing.anneal)")
    chosen = summary.get("best_member")
    if chosen is not None and int(chosen) != int(member):
        out.append(f"  best_member/ holds member {chosen}: measured strictly better than every live member")
    return out


def report_run(run_dir: str | Path, out_dir: str | Path | None = None, plots: bool = True,
               echo=print) -> dict:
    """Read ``run_dir``, print its summary with ``echo``, write ``summary.txt`` and every plot into
    ``out_dir`` (default: the run directory itself; with another directory the three tables are
    written there too, with clean column types). Returns ``{"summary", "status", "best_member",
    "paths"}``."""
    run = read_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path
    out.mkdir(parents=True, exist_ok=True)
    text = summarize(run)
    paths: dict[str, Path] = {}
    if out.resolve() != run.path.resolve():
        for name in ("report", "lineage", "metrics"):
            frame = getattr(run, name)
            if len(frame):
                paths[name] = write_csv(frame, out / f"{name}.csv")
    if plots:
        from evollm.run.plots import plot_run

        paths.update(plot_run(run.report, run.lineage, run.metrics, out))
    paths["summary"] = out / "summary.txt"
    listing = "\n".join(f"  {p.relative_to(out) if p.is_relative_to(out) else p}" for p in paths.values())
    text_out = f"{text}\n\nwritten to {out}/:\n{listing}"
    write_text(paths["summary"], text_out + "\n")
    echo(text_out)
    best = None
    if len(run.report):
        last = run.report[run.report["step"] == run.report["step"].max()]
        best = int(last.loc[last["fitness"].idxmax(), "member"])
    return {"summary": text, "status": run_status(run), "best_member": best, "paths": paths}


def _read_csv(path: Path, dtypes: dict) -> pd.DataFrame:
    if not path.exists() or path.stat().st_size == 0:
        return pd.DataFrame()
    try:
        frame = pd.read_csv(path, on_bad_lines="skip")
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
    if "step" in frame:  # a line cut short by a crash mid-write has no step: drop it
        frame = frame[pd.to_numeric(frame["step"], errors="coerce").notna()].copy()
    return typed(frame, dtypes)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
