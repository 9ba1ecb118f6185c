"""PNG plots of a population report: fitness over steps per member, and every
hyperparameter's trajectory."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def plot_population(report: pd.DataFrame, out_dir: str | Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    paths = {}
    fig, ax = plt.subplots(figsize=(7, 4))
    for member, rows in report.groupby("member"):
        ax.plot(rows["step"], rows["fitness"], marker="o", ms=3, label=f"member {member}")
    best = report.groupby("step")["fitness"].max()
    ax.plot(best.index, best.values, color="black", lw=2, label="best")
    ax.set_xlabel("step")
    ax.set_ylabel("fitness (held-out)")
    ax.set_title("Fitness per member")
    if report["member"].nunique() <= 12:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths["fitness_plot"] = out / "fitness.png"
    fig.savefig(paths["fitness_plot"], dpi=110)
    plt.close(fig)

    hp_cols = [c for c in report.columns if c.startswith("hp_") and pd.api.types.is_numeric_dtype(report[c])]
    if hp_cols:
        fig, axes = plt.subplots(len(hp_cols), 1, figsize=(7, 2.2 * len(hp_cols)), squeeze=False)
        for ax, col in zip(axes[:, 0], hp_cols):
            for member, rows in report.groupby("member"):
                ax.plot(rows["step"], rows[col], marker=".", label=f"member {member}")
            ax.set_ylabel(col[3:])
            if col == "hp_lr":
                ax.set_yscale("log")
        axes[-1, 0].set_xlabel("step")
        fig.suptitle("Hyperparameter trajectories")
        fig.tight_layout()
        paths["hyperparameter_plot"] = out / "hyperparameters.png"
        fig.savefig(paths["hyperparameter_plot"], dpi=110)
        plt.close(fig)
    return paths
