"""PNG plots of a run, drawn from its three tables (``report``, ``lineage``, ``metrics``):

* ``fitness.png``: held-out fitness and train reward of every member over the steps, clones joined
  to their parent at birth, the best of the population as a wide grey band behind the members (the
  best member's own line stays visible), selections as dotted lines;
* ``hyperparameters.png``: the hyperparameters that evolved (differ between members or over time) of
  every member (birth value, then at each evaluation), so mutations show as jumps where a clone
  leaves its parent;
* ``lineage.png``: the family tree (see :mod:`evollm.run.plots_lineage`);
* ``diagnostics.png``: the learn diagnostics of every member, running means side by side;
* ``diagnostics/member_<id>.png``: one member's diagnostics, every step plus its running mean (of its
  own steps only), after the history it inherited from its ancestors (grey).

A diagnostic that is 0 at every step because its mechanism is off (KL with ``beta = 0``, the clip
fraction when every update is on-policy) says "not used" instead of drawing a flat line.

Figures are built with :class:`matplotlib.figure.Figure` (no pyplot, so a notebook's backend is
left alone) and written atomically.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import pandas as pd
from matplotlib.figure import Figure

from evollm.run.plots_lineage import lineage_figure
from evollm.utils.atomic import atomic_file

#: Diagnostics panels: (metrics column, title). The fifth panel shows the first column present of
#: ``value_loss`` (critic, PPO) and ``loss``.
DIAGNOSTICS = (("mean_reward", "train reward"), ("kl", "KL to reference"), ("clip_fraction", "clip fraction"),
               ("entropy", "entropy (nats/token)"), (("value_loss", "loss"), None), ("grad_norm", "grad norm"),
               ("zero_std_groups", "groups with equal rewards (no signal)"))
#: Why a diagnostic is 0 at every step: its mechanism is not used in this run.
NOT_USED = {"kl": "not used: beta = 0 (no reference pass)",
            "clip_fraction": "not used: every update is on-policy (ratio 1, nothing clipped)"}
#: Steps in the running mean drawn over the noisy per-step diagnostics.
RUNNING_MEAN_STEPS = 10


def member_colors(members: Iterable[int]) -> dict[int, tuple]:
    """One stable colour per member id (tab10 up to 10 members, tab20 up to 20, then a spread of turbo)."""
    from matplotlib import colormaps

    ids = sorted({int(m) for m in members})
    n = len(ids)
    if n <= 10:
        cmap = colormaps["tab10"]
        return {m: cmap(i) for i, m in enumerate(ids)}
    if n <= 20:
        cmap = colormaps["tab20"]
        return {m: cmap(i) for i, m in enumerate(ids)}
    cmap = colormaps["turbo"]
    return {m: cmap(0.05 + 0.9 * i / (n - 1)) for i, m in enumerate(ids)}


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` to ``path`` atomically."""
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        if ax.get_xlabel() == "training step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return path


def legend_columns(n_entries: int, height_in: float) -> int:
    """Columns a legend of ``n_entries`` needs to fit ``height_in`` inches (7-point entries)."""
    rows = max(1, int(height_in * 72 / 13) - 2)
    return max(1, math.ceil(n_entries / rows))


def member_figure(n_members: int, n_extra: int, width: float, height: float, nrows: int, ncols: int = 1,
                  sharex: bool = True, top: float = 0.55, bottom: float = 0.55):
    """A figure with room on its right for a member legend (none past 40 members: lineage.png names
    them, only the ``n_extra`` summary lines are listed). Fixed margins in inches: no layout engine,
    which would cost a second draw of the figure."""
    entries = (n_members if n_members <= 40 else 0) + n_extra
    ncol = legend_columns(entries, height) if entries else 0
    legend_w = 1.15 * ncol + (0.1 if ncol else 0)
    fig = Figure(figsize=(width + legend_w, height))
    total = width + legend_w
    fig.subplots_adjust(left=0.8 / total, right=(width - 0.15) / total, top=1 - top / height, bottom=bottom / height,
                        hspace=0.35 if ncols == 1 else 0.45, wspace=0.3)
    axes = fig.subplots(nrows, ncols, sharex=sharex, squeeze=False)
    return fig, axes, ncol


def legend_outside(fig: Figure, ax, ncol: int, n_members: int, n_extra: int = 0) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if n_members > 40:
        handles, labels = handles[len(handles) - n_extra:], labels[len(labels) - n_extra:]
    if not handles or not ncol:
        return
    right = fig.subplotpars.right
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(right + 0.01, 0.5), fontsize=7, ncol=ncol,
               frameon=False, handlelength=1.5, columnspacing=0.8)


def plot_fitness(report: pd.DataFrame, lineage: pd.DataFrame, path: Path) -> Path:
    return save(fitness_figure(report, lineage), path)


def fitness_figure(report: pd.DataFrame, lineage: pd.DataFrame) -> Figure:
    colors = member_colors(report["member"])
    has_train = "train_reward" in report and report["train_reward"].notna().any()
    n = report["member"].nunique()
    fig, axes, ncol = member_figure(n, 2, 8, 6.5 if has_train else 4.2, 2 if has_train else 1)
    axes = axes[:, 0]
    births = _birth_points(report, lineage)
    for ax, col, label in zip(axes, ("fitness", "train_reward"), ("fitness (held-out, greedy)",
                                                                    "train reward (mean since last evaluation)")):
        for member, rows in report.groupby("member"):
            ax.plot(rows["step"], rows[col], marker="o", ms=3, lw=1.2, color=colors[member], label=f"member {member}",
                    zorder=3)
            if member in births and col in births[member]:
                (x0, y0), (x1, y1) = births[member][col], (rows["step"].iloc[0], rows[col].iloc[0])
                ax.plot([x0, x1], [y0, y1], ls="--", lw=0.8, color=colors[member])
        by_step = report.groupby("step")[col]
        ax.plot(by_step.max().index, by_step.max().values, color="black", lw=6, alpha=0.15, zorder=1,
                solid_capstyle="round", label="best")  # behind the members: the best member stays visible
        ax.plot(by_step.median().index, by_step.median().values, color="0.45", lw=1.2, ls=":",
                label="median")
        for step in _selection_steps(lineage):
            ax.axvline(step, color="0.8", lw=0.8, ls=":", zorder=0)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_title("Fitness per member (dashed: clone joined to its parent; dotted verticals: selections)",
                      fontsize=9)
    axes[-1].set_xlabel("training step")
    legend_outside(fig, axes[0], ncol, n, 2)
    return fig


def evolved_columns(report: pd.DataFrame, lineage: pd.DataFrame) -> list[str]:
    """The numeric ``hp_`` columns whose value differs between members or over time (founders drawn
    from a range, or mutated); all of them when none does."""
    cols = [c for c in report.columns if c.startswith("hp_") and pd.api.types.is_numeric_dtype(report[c])]
    moved = []
    for c in cols:
        values = pd.concat([report[c], lineage[c]]) if c in lineage else report[c]
        if values.dropna().astype(float).nunique() > 1:
            moved.append(c)
    return moved or cols


def plot_hyperparameters(report: pd.DataFrame, lineage: pd.DataFrame, path: Path) -> Path | None:
    cols = evolved_columns(report, lineage)
    if not cols:
        return None
    colors = member_colors(report["member"])
    n = report["member"].nunique()
    fig, axes, ncol = member_figure(n, 0, 8, 1.9 * len(cols) + 1.0, len(cols))
    axes = axes[:, 0]
    for ax, col in zip(axes, cols):
        for member, rows in report.groupby("member"):
            steps, values = list(rows["step"]), list(rows[col].astype(float))
            born = lineage[lineage["member"] == member] if col in lineage else lineage.iloc[0:0]
            if len(born) and pd.notna(born[col].iloc[-1]):
                steps, values = [int(born["step"].iloc[-1])] + steps, [float(born[col].iloc[-1])] + values
            ax.plot(steps, values, marker=".", ms=4, lw=1.2, drawstyle="steps-post", color=colors[member],
                    label=f"member {member}")
        name = col[3:]
        values = report[col].dropna().astype(float)
        if len(values) and values.min() > 0 and values.max() / values.min() > 10:
            ax.set_yscale("log")  # a learning rate that moved across decades
        else:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useMathText=True)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    fig.suptitle("Hyperparameter trajectories (from birth; jumps at a clone's start are its mutation)", fontsize=9,
                 x=fig.subplotpars.left, ha="left")
    axes[-1].set_xlabel("training step")
    legend_outside(fig, axes[0], ncol, n)
    return save(fig, path)


def running_mean(values: pd.Series, window: int = RUNNING_MEAN_STEPS) -> pd.Series:
    """Mean of the last ``window`` values at each point (fewer at the start)."""
    return values.rolling(window, min_periods=1).mean()


def diagnostic_panels(metrics: pd.DataFrame) -> list[tuple[str, str]]:
    """The ``(column, title)`` panels these metrics can fill."""
    panels = []
    for col, title in DIAGNOSTICS:
        if isinstance(col, tuple):
            col = next((c for c in col if c in metrics and metrics[c].notna().any()), None)
            title = {"value_loss": "value loss (critic)", "loss": "loss"}.get(col)
        if col is not None and col in metrics and metrics[col].notna().any():
            if col in NOT_USED and (metrics[col].dropna() == 0).all():
                title = f"{title}: {NOT_USED[col]}"
            panels.append((col, title))
    return panels


def member_history(metrics: pd.DataFrame, lineage: pd.DataFrame, member: int) -> pd.DataFrame:
    """``member``'s metrics rows preceded by those it inherited: its parent's up to its birth, the
    grandparent's before that, back to the founder. Column ``own`` tells them apart."""
    from evollm.run.plots_lineage import ancestry

    parts, until = [], None
    for birth in ancestry(lineage, member) if len(lineage) else [{"member": member, "step": 0}]:
        rows = metrics[metrics["member"] == birth["member"]]
        if until is not None:
            rows = rows[rows["step"] <= until]
        parts.append(rows.assign(own=birth["member"] == member))
        until = birth["step"]
    history = pd.concat(parts[::-1]) if parts else metrics.iloc[0:0].assign(own=True)
    return history.sort_values("step")


def plot_member_diagnostics(metrics: pd.DataFrame, report: pd.DataFrame, member: int, path: Path,
                            lineage: pd.DataFrame | None = None) -> Path | None:
    """One member's diagnostics grid: each learn metric per step (thin) and its running mean (bold);
    a clone's history inherited from its ancestors is drawn in grey before its birth. The reward
    panel also shows the member's held-out fitness."""
    fig = member_diagnostics_figure(metrics, report, member, lineage)
    return None if fig is None else save(fig, path)


def member_diagnostics_figure(metrics: pd.DataFrame, report: pd.DataFrame, member: int,
                              lineage: pd.DataFrame | None = None) -> Figure | None:
    """The figure of :func:`plot_member_diagnostics`."""
    history = member_history(metrics, lineage if lineage is not None else pd.DataFrame(), member)
    rows = history[history["own"]]
    panels = diagnostic_panels(rows)
    if rows.empty or not panels:
        return None
    fig = Figure(figsize=(13, 5.6))
    fig.subplots_adjust(left=0.05, right=0.98, top=0.9, bottom=0.15, hspace=0.45, wspace=0.28)
    axes = fig.subplots(2, 4, squeeze=False).ravel()
    inherited = history[~history["own"]]
    for ax, (col, _) in zip(axes, panels):
        if len(inherited):  # the ancestors' running mean, and the member's own: never blended
            ax.plot(inherited["step"], inherited[col], color="0.6", alpha=0.5, lw=0.9)
            ax.plot(inherited["step"], running_mean(inherited[col]), color="0.5", lw=2, label="inherited (ancestors)")
        ax.plot(rows["step"], rows[col], color="tab:blue", alpha=0.35, lw=0.9, label="per step")
        ax.plot(rows["step"], running_mean(rows[col]), color="tab:blue", lw=2,
                label=f"running mean ({RUNNING_MEAN_STEPS} own steps)")
        if col == "mean_reward" and len(report):
            fit = report[report["member"] == member]
            ax.plot(fit["step"], fit["fitness"], "o-", color="tab:orange", ms=4, lw=1, label="held-out fitness")
    _finish_panels(axes, panels)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    born = f", born at step {int(inherited['step'].max())}" if len(inherited) else ""
    fig.suptitle(f"Member {member}: learn diagnostics (own steps {rows['step'].min()}-{rows['step'].max()}{born})",
                 fontsize=10)
    return fig


def plot_diagnostics_overview(metrics: pd.DataFrame, path: Path) -> Path | None:
    """Every member's running mean of each diagnostic, side by side."""
    panels = diagnostic_panels(metrics)
    if metrics.empty or not panels:
        return None
    colors = member_colors(metrics["member"])
    n = metrics["member"].nunique()
    fig, axes, ncol = member_figure(n, 0, 14, 5.6, 2, 4, sharex=False, top=0.6, bottom=0.5)
    axes = axes.ravel()
    for ax, (col, _) in zip(axes, panels):
        for member, rows in metrics.groupby("member"):
            rows = rows.sort_values("step")
            ax.plot(rows["step"], running_mean(rows[col]), lw=1.3, color=colors[member], label=f"member {member}")
    _finish_panels(axes, panels)
    fig.suptitle(f"Learn diagnostics per member (running mean over {RUNNING_MEAN_STEPS} steps)", fontsize=10)
    legend_outside(fig, axes[0], ncol, n)
    return save(fig, path)


def _finish_panels(axes, panels) -> None:
    """Titles, small labels and grids on a diagnostics grid; the unused panels hidden."""
    for ax, (col, title) in zip(axes, panels):
        if col in NOT_USED and title.endswith(NOT_USED[col]):  # a flat zero says nothing: say why instead
            for line in list(ax.lines):
                line.remove()
            ax.text(0.5, 0.5, NOT_USED[col].replace(": ", ":\n", 1), ha="center", va="center", fontsize=8,
                    color="0.4", transform=ax.transAxes)
            ax.set_yticks([])
            title = title.split(":")[0]
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("training step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)


def plot_run(report: pd.DataFrame, lineage: pd.DataFrame, metrics: pd.DataFrame, out_dir: str | Path,
             members: Iterable[int] | None = None) -> dict[str, Path]:
    """Every plot of a run into ``out_dir``; per-member diagnostics only for ``members`` when given
    (the run-files writer passes none while the run goes: the per-member grids are drawn at its end)."""
    out = Path(out_dir)
    paths: dict[str, Path] = {}
    if len(report):
        paths["fitness_plot"] = plot_fitness(report, lineage, out / "fitness.png")
        hp = plot_hyperparameters(report, lineage, out / "hyperparameters.png")
        if hp is not None:
            paths["hyperparameter_plot"] = hp
        if len(lineage):
            paths["lineage_plot"] = save(lineage_figure(report, lineage), out / "lineage.png")
    if len(metrics):
        overview = plot_diagnostics_overview(metrics, out / "diagnostics.png")
        if overview is not None:
            paths["diagnostics_plot"] = overview
        wanted = set(metrics["member"].unique()) if members is None else set(members)
        for member in sorted(int(m) for m in wanted):
            p = plot_member_diagnostics(metrics, report, member, out / "diagnostics" / f"member_{member}.png", lineage)
            if p is not None:
                paths[f"diagnostics_member_{member}"] = p
    return paths


def plot_population(report: pd.DataFrame, out_dir: str | Path) -> dict[str, Path]:
    """Fitness and hyperparameter plots from a report alone (kept for callers of earlier versions)."""
    empty = pd.DataFrame(columns=["member", "parent", "step"])
    out = Path(out_dir)
    paths = {"fitness_plot": plot_fitness(report, empty, out / "fitness.png")}
    hp = plot_hyperparameters(report, empty, out / "hyperparameters.png")
    if hp is not None:
        paths["hyperparameter_plot"] = hp
    return paths


def _selection_steps(lineage: pd.DataFrame) -> list[int]:
    if not len(lineage) or "parent" not in lineage:
        return []
    return sorted(int(s) for s in lineage.loc[lineage["parent"].notna(), "step"].unique())


def _birth_points(report: pd.DataFrame, lineage: pd.DataFrame) -> dict[int, dict[str, tuple]]:
    """For each clone: its parent's last (step, value) at or before the clone's birth, per column."""
    out: dict[int, dict[str, tuple]] = {}
    if not len(lineage) or "parent" not in lineage:
        return out
    for _, b in lineage[lineage["parent"].notna()].iterrows():
        parent_rows = report[(report["member"] == int(b["parent"])) & (report["step"] <= int(b["step"]))]
        if len(parent_rows):
            last = parent_rows.iloc[-1]
            out[int(b["member"])] = {c: (int(last["step"]), last[c]) for c in ("fitness", "train_reward")
                                     if c in report}
    return out
