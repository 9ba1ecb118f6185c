"""Summaries of the benchmark's runs: scores at the budget's checkpoints, paired differences against
evollm, time to the default run's final score, markdown tables and one plot per task."""

from __future__ import annotations

import math
from pathlib import Path

ORDER = ("evollm", "no_mutation", "tpe", "random", "default", "grid_best")
NAMES = {"evollm": "evollm (library defaults)", "no_mutation": "population, selection only",
         "tpe": "Optuna TPE trials", "random": "random-search trials", "default": "one run, library defaults",
         "grid_best": "best lr of a post-hoc grid (context)"}


def mean_se(xs) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def fmt(m: float, se: float, digits: int = 3) -> str:
    if math.isnan(m):
        return "-"
    return f"{m:.{digits}f}" + ("" if math.isnan(se) else f" ± {se:.{digits}f}")


def fmt_diff(m: float, se: float) -> str:
    return "-" if math.isnan(m) else f"{m:+.3f} ± {se:.3f}" if not math.isnan(se) else f"{m:+.3f}"


def curve(run: dict, checkpoints: int) -> list[float | None]:
    """Report score at each checkpoint fraction k/checkpoints (None where the run did not get there)."""
    by = {round(c["fraction"] * checkpoints): c["score"] for c in run["checkpoints"]}
    return [by.get(k + 1) for k in range(checkpoints)]


def fixed_runs(runs: list[dict], checkpoints: int) -> dict[str, dict[int, list]]:
    """``{point: {seed: curve}}`` of the fixed settings: the grid's points and the default run (a fixed setting
    too: the library's learning rate, named ``grid:lr=... (default)``)."""
    grid: dict[str, dict[int, list]] = {}
    for r in runs:
        if r["arm"].startswith("grid:"):
            grid.setdefault(r["arm"], {})[r["seed"]] = curve(r, checkpoints)
        elif r["arm"] == "default":
            hp = sorted((r.get("hyperparameters") or {}).items())
            lr = next((v for k, v in hp if k.startswith("lr") or k.startswith("actor_learning_rate")), None)
            grid.setdefault(f"grid:lr={lr:g} (default)" if lr else "grid:library (default)", {})[r["seed"]] = \
                curve(r, checkpoints)
    return grid


def arm_runs(runs: list[dict], checkpoints: int) -> dict[str, dict[int, list]]:
    """``{arm: {seed: curve}}``; the grid's points are folded into ``grid_best``: the point with the highest
    mean final score over its seeds (chosen after the fact)."""
    out: dict[str, dict[int, list]] = {}
    for r in runs:
        if not r["arm"].startswith("grid:"):
            out.setdefault(r["arm"], {})[r["seed"]] = curve(r, checkpoints)
    grid = fixed_runs(runs, checkpoints)
    if len(grid) > 1:
        best = max(grid, key=lambda a: mean_se([c[-1] for c in grid[a].values()])[0])
        out["grid_best"] = grid[best]
        out["_grid_choice"] = best  # type: ignore[assignment]
    return out


def first_reach(c: list, target: float) -> float | None:
    """Fraction of the budget at the first checkpoint whose score reaches ``target``."""
    for k, v in enumerate(c):
        if v is not None and v >= target - 1e-9:
            return (k + 1) / len(c)
    return None


def half_checkpoint(checkpoints: int) -> int:
    """Index of the last checkpoint at or before half the budget (``-1``: none). With an even number of
    checkpoints it is the one at exactly 1/2; with an odd number it comes earlier (3: the one at 1/3), so
    the half-budget question is then answered only where the score there already reaches the target.

    >>> half_checkpoint(4), half_checkpoint(3), half_checkpoint(1)
    (1, 0, -1)
    """
    return checkpoints // 2 - 1


def summarise(runs: list[dict], checkpoints: int) -> dict:
    arms = arm_runs(runs, checkpoints)
    grid_choice = arms.pop("_grid_choice", None)
    ref = arms.get("evollm", {})
    default = arms.get("default", {})
    half = half_checkpoint(checkpoints)
    rows = {}
    for arm in [a for a in ORDER if a in arms] + sorted(a for a in arms if a not in ORDER):
        seeds = arms[arm]
        finals = [c[-1] for c in seeds.values()]
        row = {"seeds": sorted(seeds), "final": mean_se(finals),
               "by_checkpoint": [mean_se([c[k] for c in seeds.values()]) for k in range(checkpoints)]}
        paired = [ref[s][-1] - seeds[s][-1] for s in seeds if s in ref and ref[s][-1] is not None
                  and seeds[s][-1] is not None]
        if arm != "evollm" and paired:
            row["evollm_minus_arm"] = mean_se(paired)
            row["evollm_ahead"] = f"{sum(d > 0 for d in paired)}/{sum(d < 0 for d in paired)}/{len(paired)}"
        if default:
            reach = [first_reach(seeds[s], default[s][-1]) for s in seeds if s in default and default[s][-1] is not None]
            row["to_default_final"] = reach
            diffs = [seeds[s][half] - default[s][-1] for s in seeds if s in default and half >= 0
                     and seeds[s][half] is not None and default[s][-1] is not None]
            row["half_minus_default_final"] = mean_se(diffs)
        rows[arm] = row
    return {"arms": rows, "grid_choice": grid_choice, "half_fraction": (half + 1) / checkpoints if half >= 0 else None,
            "fixed_at_half": fixed_at_half(runs, checkpoints)}


def fixed_at_half(runs: list[dict], checkpoints: int) -> dict[str, tuple[float, float]]:
    """For each fixed setting (:func:`fixed_runs`) with the default run's seeds: its score at half the budget
    minus the default run's final score, paired by seed (mean, se). The best of them, chosen after the fact, is
    what a search that returns one fixed setting could reach at half the budget even if it found the best
    point for free: where it is below 0, the second question asks for more than any such search can give.

    >>> runs = [{"arm": "default", "seed": s, "hyperparameters": {"lr": 1e-4},
    ...          "checkpoints": [{"fraction": 0.5, "score": 0.5}, {"fraction": 1.0, "score": 0.8 + s / 10}]}
    ...         for s in (0, 1)] + [{"arm": "grid:lr=0.0003", "seed": s,
    ...          "checkpoints": [{"fraction": 0.5, "score": 0.7 + s / 5}, {"fraction": 1.0, "score": 0.9}]}
    ...         for s in (0, 1)]
    >>> {k: tuple(round(x, 3) for x in v) for k, v in fixed_at_half(runs, 2).items()}
    {'grid:lr=0.0001 (default)': (-0.35, 0.05), 'grid:lr=0.0003': (-0.05, 0.05)}
    """
    half = half_checkpoint(checkpoints)
    grid = fixed_runs(runs, checkpoints)
    default = next((v for k, v in grid.items() if k.endswith("(default)")), None)
    if half < 0 or not default:
        return {}
    out = {}
    for point, seeds in grid.items():
        diffs = [seeds[s][half] - default[s][-1] for s in seeds if s in default and seeds[s][half] is not None
                 and default[s][-1] is not None]
        if diffs:
            out[point] = mean_se(diffs)
    return out


def half_label(summary: dict) -> str:
    """What the half-budget column measures: "1/2", or the earlier checkpoint it falls back to."""
    f = summary.get("half_fraction")
    return "1/2" if f == 0.5 else f"{f:.2g} (no checkpoint at 1/2)" if f else "1/2"


def table(summary: dict, checkpoints: int) -> str:
    fr = [f"{(k + 1) / checkpoints:.2g}" for k in range(checkpoints)]
    show = sorted({checkpoints // 4 - 1, checkpoints // 2 - 1, checkpoints - 1} - {-1})
    head = ("| arm | seeds | held-out score at " + ", ".join(fr[k] for k in show) + " of the budget (mean ± se) "
            "| evollm − arm, final (paired mean ± se) | evollm ahead / behind / seeds "
            "| reaches the default's final score (seeds; median fraction of the budget) "
            f"| score at {half_label(summary)} of the budget − default's final (paired) |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for arm, row in summary["arms"].items():
        name = NAMES.get(arm, arm) + (f" [{summary['grid_choice'].split(':', 1)[1]}]" if arm == "grid_best" else "")
        reach = [r for r in row.get("to_default_final", []) if r is not None]
        med = sorted(reach)[(len(reach) - 1) // 2] if reach else None
        reach_s = (f"{len(reach)}/{len(row.get('to_default_final', []))}; {med:.2f}" if med is not None
                   else f"0/{len(row.get('to_default_final', []))}") if "to_default_final" in row else "-"
        lines.append(f"| {name} | {len(row['seeds'])} | " + " / ".join(fmt(*row["by_checkpoint"][k]) for k in show)
                     + f" | {fmt_diff(*row.get('evollm_minus_arm', (math.nan, math.nan)))}"
                     f" | {row.get('evollm_ahead', '-')} | {reach_s}"
                     f" | {fmt_diff(*row.get('half_minus_default_final', (math.nan, math.nan)))} |")
    return "\n".join(lines)


def verdict(summary: dict) -> str:
    """The two questions, answered from the paired means (competitors only: the grid is context)."""
    arms = summary["arms"]
    if "evollm" not in arms:
        return "no evollm runs"
    behind = [a for a, r in arms.items() if a not in ("evollm", "grid_best") and not a.startswith("evollm:")
              and "evollm_minus_arm" in r and not r["evollm_minus_arm"][0] >= 0]
    lines = ["- evollm's final score >= every other arm's (paired mean difference >= 0): "
             + ("**yes**" if not behind else "**no**, behind " + ", ".join(
                 f"{NAMES[a]} ({fmt_diff(*arms[a]['evollm_minus_arm'])})" for a in behind))]
    half = arms["evollm"].get("half_minus_default_final")
    if half is not None and not math.isnan(half[0]):
        exact = summary.get("half_fraction", 0.5) == 0.5
        answer = ("**yes**" if half[0] >= 0 else "**no**" if exact else
                  "**not measured** (behind at the earlier checkpoint; an even --checkpoints puts one at 1/2)")
        lines.append("- evollm reaches the default run's final score in at most half the default's compute "
                     f"(score at {half_label(summary)} of the budget − default's final, paired: {fmt_diff(*half)}): "
                     + answer)
    for a in (a for a in arms if a.startswith("evollm:") and "evollm_minus_arm" in arms[a]):
        m, se = arms[a]["evollm_minus_arm"]
        lines.append(f"- variant {a} − evollm, final (paired): {fmt_diff(-m, se)}; its score at {half_label(summary)} of "
                     f"the budget − default's final: {fmt_diff(*arms[a].get('half_minus_default_final', (math.nan, math.nan)))}")
    fixed = summary.get("fixed_at_half") or {}
    if len(fixed) > 1:
        point = max(fixed, key=lambda k: fixed[k][0])
        lines.append(f"- context: the best fixed setting at {half_label(summary)} of the budget, chosen after the fact "
                     f"({point.split(':', 1)[1]}): − default's final {fmt_diff(*fixed[point])} (of "
                     f"{len(fixed)} fixed settings; below 0, no search that returns one fixed setting reaches the "
                     "default's final score in half its compute)")
    if "grid_best" in arms and "evollm_minus_arm" in arms["grid_best"]:
        lines.append(f"- context: evollm − the best grid point ({summary['grid_choice'].split(':', 1)[1]}): "
                     f"{fmt_diff(*arms['grid_best']['evollm_minus_arm'])}")
    return "\n".join(lines)


def per_run_table(runs: list[dict]) -> str:
    lines = ["| arm | seed | final held-out score ± se (report set) | CPU s | wall s | steps | trials "
             "| report evaluations | speed probe (CPU ms) | best hyperparameters at the end |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["arm"], r["seed"])):
        last = r["checkpoints"][-1] if r["checkpoints"] else {}
        hp = r.get("recommended_hyperparameters") or {}
        hs = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in hp.items())
        trials = len(r.get("trials", [])) or "-"
        lines.append(f"| {r['arm']} | {r['seed']} | {last.get('score', math.nan):.3f} ± {last.get('se', math.nan):.3f} "
                     f"| {r['cpu_s']:.0f} | {r['wall_s']:.0f} | {r.get('steps', '-')} | {trials} "
                     f"| {r['report_evals']} | {_probe_ms(r)} | {hs} |")
    return "\n".join(lines)


def _probe_ms(run: dict) -> str:
    """The machine's speed when the run's worker started (``run.speed_probe``), in CPU milliseconds; ``-`` for
    runs made before the probe existed."""
    probe = (run.get("setup") or {}).get("speed_probe_cpu_s")
    return f"{1000 * probe:.0f}" if probe is not None else "-"


def plot(runs: list[dict], checkpoints: int, budget: float, title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = arm_runs(runs, checkpoints)
    choice = arms.pop("_grid_choice", None)
    xs = [budget * (k + 1) / checkpoints for k in range(checkpoints)]
    fig, ax = plt.subplots(figsize=(8, 5))
    for arm in [a for a in ORDER if a in arms] + sorted(a for a in arms if a.startswith("evollm:")):
        stats = [mean_se([c[k] for c in arms[arm].values()]) for k in range(checkpoints)]
        m = [s[0] for s in stats]
        se = [0.0 if math.isnan(s[1]) else s[1] for s in stats]
        label = NAMES.get(arm, arm) + (f" [{choice.split(':', 1)[1]}]" if arm == "grid_best" and choice else "")
        style = dict(ls="--") if arm == "grid_best" else {}
        line, = ax.plot(xs, m, marker="o", ms=3, label=label, **style)
        ax.fill_between(xs, [a - b for a, b in zip(m, se)], [a + b for a, b in zip(m, se)], alpha=0.15,
                        color=line.get_color())
    if "default" in arms:
        final = mean_se([c[-1] for c in arms["default"].values()])[0]
        ax.axhline(final, color="grey", lw=0.8, ls=":")
        ax.axvline(budget / 2, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("CPU seconds per seed (process time, report evaluations excluded)")
    ax.set_ylabel("held-out score of the arm's recommendation")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
