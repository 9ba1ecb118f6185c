"""Plots that say what happened: the best member visible under the best line, unused diagnostics
marked, a clone's running mean of its own steps only, equal-reward groups plotted, only evolved
hyperparameters drawn."""

import pandas as pd

from evollm.run.plots import diagnostic_panels, evolved_columns, fitness_figure, member_diagnostics_figure


def _tables():
    report = pd.DataFrame({"step": [2, 2, 4, 4], "generation": 0, "member": [0, 1, 0, 1],
                           "parent": pd.array([None, None, None, None], dtype="Int64"),
                           "fitness": [0.2, 0.5, 0.3, 0.6], "train_reward": [0.1, 0.2, 0.3, 0.4],
                           "hp_lr": [1e-3, 2e-3, 1e-3, 2e-3], "hp_beta": 0.0, "hp_clip_coef": 0.2})
    lineage = pd.DataFrame({"member": [0, 1, 2], "parent": pd.array([None, None, 1], dtype="Int64"),
                            "generation": [0, 0, 1], "step": [0, 0, 4], "mutation": ["none", "none", "lr"],
                            "hp_lr": [1e-3, 2e-3, 2.4e-3], "hp_beta": 0.0, "hp_clip_coef": 0.2})
    rows = []
    for step in range(1, 9):
        member = 1 if step <= 4 else 2  # member 2 is member 1's clone, born at step 4
        rows.append({"step": step, "member": member, "mean_reward": 0.5, "kl": 0.0, "clip_fraction": 0.0,
                     "entropy": 1.0, "loss": 0.1, "grad_norm": 1.0 if member == 1 else 0.0,
                     "zero_std_groups": 0.0 if member == 1 else 1.0})
    return report, lineage, pd.DataFrame(rows)


def test_the_best_line_is_drawn_behind_the_members():
    report, lineage, _ = _tables()
    ax = fitness_figure(report, lineage).axes[0]
    best = next(line for line in ax.lines if line.get_label() == "best")
    members = [line for line in ax.lines if line.get_label().startswith("member")]
    assert members and all(best.get_zorder() < m.get_zorder() for m in members) and best.get_alpha() < 0.5


def test_unused_diagnostics_say_so_and_equal_reward_groups_are_a_panel():
    _, _, metrics = _tables()
    titles = dict(diagnostic_panels(metrics))
    assert titles["kl"] == "KL to reference: not used: beta = 0 (no reference pass)"
    assert titles["clip_fraction"].startswith("clip fraction: not used")
    assert titles["zero_std_groups"] == "groups with equal rewards (no signal)"
    assert "not used" not in dict(diagnostic_panels(metrics.assign(kl=0.01)))["kl"]


def test_a_clones_running_mean_is_of_its_own_steps_only():
    report, lineage, metrics = _tables()
    fig = member_diagnostics_figure(metrics, report, 2, lineage)
    grad = next(ax for ax in fig.axes if ax.get_title() == "grad norm")
    own = next(line for line in grad.lines if line.get_label().startswith("running mean"))
    assert list(own.get_xdata()) == [5, 6, 7, 8] and set(own.get_ydata()) == {0.0}  # not 1.0 blended in
    kl = next(ax for ax in fig.axes if ax.get_title() == "KL to reference")
    assert not kl.lines and "not used" in kl.texts[0].get_text()


def test_only_evolved_hyperparameters_are_drawn():
    report, lineage, _ = _tables()
    assert evolved_columns(report, lineage) == ["hp_lr"]
    constant = report.assign(hp_lr=1e-3)
    assert evolved_columns(constant, lineage.assign(hp_lr=1e-3)) == ["hp_lr", "hp_beta", "hp_clip_coef"]
