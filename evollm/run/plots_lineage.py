"""``lineage.png``: who was cloned from whom, with which mutation, and how well each member did.

One row per member, ordered so that every clone sits just below its parent (depth first, founders
first). A member's bar runs from its birth to its last evaluation, coloured by its held-out fitness
at each evaluation; a grey arrow leads from the parent's row to the clone's birth, labelled with the
mutation the clone got. The best member of the last evaluation is starred.
"""

from __future__ import annotations

import math
import pandas as pd
from matplotlib.collections import LineCollection
from matplotlib.colors import Normalize
from matplotlib.figure import Figure


def family_order(lineage: pd.DataFrame) -> list[int]:
    """Member ids depth first: each founder, then its clones (by birth step), recursively."""
    births = lineage.drop_duplicates("member", keep="last")
    children: dict[int | None, list[tuple[int, int]]] = {}
    for _, b in births.iterrows():
        parent = None if pd.isna(b["parent"]) else int(b["parent"])
        children.setdefault(parent, []).append((int(b["step"]), int(b["member"])))
    known = set(births["member"].astype(int))
    roots = sorted(children.get(None, [])) + sorted(
        (s, m) for p, kids in children.items() if p is not None and p not in known for s, m in kids)
    order: list[int] = []
    stack = [m for _, m in reversed(roots)]
    while stack:
        member = stack.pop()
        if member in order:
            continue
        order.append(member)
        stack.extend(m for _, m in sorted(children.get(member, []), reverse=True))
    return order


def ancestry(lineage: pd.DataFrame, member: int) -> list[dict]:
    """``member``'s births back to its founder, newest first: ``{member, parent, step, mutation}``
    (``mutation`` as :func:`mutation_label` writes it, ``"founder"`` for the founder)."""
    births = lineage.drop_duplicates("member", keep="last").set_index("member")
    chain, seen = [], set()
    while member in births.index and member not in seen:
        seen.add(member)
        b = births.loc[member]
        parent = None if pd.isna(b["parent"]) else int(b["parent"])
        chain.append({"member": member, "parent": parent, "step": int(b["step"]),
                      "mutation": mutation_label(b) if parent is not None else "founder"})
        if parent is None:
            break
        member = parent
    return chain


def mutation_label(birth: pd.Series) -> str:
    """``lr 1.2e-04 -> 3.0e-04`` style text for one birth ("clone" when nothing was mutated)."""
    name = birth.get("mutation")
    if pd.isna(name) or name in ("none", ""):
        return "clone"
    old, new = birth.get("old_value"), birth.get("new_value")
    if _missing(old) and _missing(new):
        return str(name)
    return f"{name} {_short(old)} -> {_short(new)}"


def lineage_figure(report: pd.DataFrame, lineage: pd.DataFrame) -> Figure:
    """The lineage tree of a run (see the module docstring)."""
    order = family_order(lineage)
    y = {m: i for i, m in enumerate(order)}
    births = lineage.drop_duplicates("member", keep="last").set_index("member")
    last_step = max(int(report["step"].max()) if len(report) else 0, int(lineage["step"].max()))
    fitness = report[["member", "step", "fitness"]].dropna()
    finite = fitness[fitness["fitness"].map(math.isfinite)]["fitness"]
    norm = Normalize(float(finite.min()) if len(finite) else 0.0, float(finite.max()) if len(finite) else 1.0)
    if norm.vmin == norm.vmax:
        norm = Normalize(norm.vmin - 0.5, norm.vmax + 0.5)
    height = max(3.2, 0.42 * len(order) + 1.6)
    fig = Figure(figsize=(10, height))
    fig.subplots_adjust(left=0.04, right=0.9, top=1 - 0.45 / height, bottom=0.55 / height)
    ax = fig.subplots()
    segments, values = [], []
    for member in order:
        row = y[member]
        born = int(births.loc[member, "step"])
        rows = fitness[fitness["member"] == member].sort_values("step")
        end = int(rows["step"].max()) if len(rows) else born
        ax.plot([born, end], [row, row], color="0.85", lw=7, solid_capstyle="butt", zorder=1)
        prev = born
        for step, f in zip(rows["step"], rows["fitness"]):
            segments.append([(prev, row), (int(step), row)])
            values.append(f if math.isfinite(f) else norm.vmin)
            prev = int(step)
        parent = births.loc[member, "parent"]
        founder = pd.isna(parent) or int(parent) not in y
        ax.plot([born], [row], marker="s" if founder else "o", ms=6, color="black", zorder=3)
        ax.annotate(f"m{member}", (born, row), xytext=(-6, 0), textcoords="offset points", ha="right",
                    va="center", fontsize=8, fontweight="bold")
        if not founder:
            ax.annotate("", xy=(born, row), xytext=(born, y[int(parent)]), zorder=2,
                        arrowprops={"arrowstyle": "-|>", "color": "0.45", "lw": 1.0, "shrinkA": 3, "shrinkB": 4})
            ax.annotate(mutation_label(births.loc[member]), (born, row), xytext=(6, 7), textcoords="offset points",
                        fontsize=7, color="0.25", va="bottom")
    lines = LineCollection(segments, cmap="viridis", norm=norm, linewidths=7, capstyle="butt", zorder=2)
    lines.set_array(values)
    ax.add_collection(lines)
    if len(report):
        last = report[report["step"] == report["step"].max()]
        best = last.loc[last["fitness"].idxmax()]
        if int(best["member"]) in y:
            ax.plot([int(best["step"])], [y[int(best["member"])]], marker="*", ms=15, color="gold",
                    markeredgecolor="black", zorder=4, label=f"best: member {int(best['member'])}")
            ax.legend(loc="upper right", fontsize=8, frameon=True)
    fig.colorbar(lines, ax=ax, label="held-out fitness", pad=0.01, fraction=0.03)
    span = max(1, last_step)
    ax.set_xlim(-0.08 * span, last_step + 0.18 * span)
    ax.set_ylim(len(order) - 0.4, -0.8)
    ax.set_yticks([])
    ax.set_xlabel("training step")
    ax.set_title("Lineage: arrows from parent to clone (label: its mutation); bars coloured by fitness",
                 fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value == ""


def _short(value) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if number.is_integer() and abs(number) < 1e6:
        return str(int(number))
    return f"{number:.3g}" if 1e-3 <= abs(number) < 1e4 else f"{number:.2e}"
