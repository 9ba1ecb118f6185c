"""What a population's search cost, and what it found, read from the run's own tables.

On one shared base a step of N members costs about what one member pays for N x the rows, so the
share of the member-steps that trained the returned member's weights is the share of the compute that
a single run would have spent on it. :func:`search_cost` reads it from ``lineage.csv`` and
``metrics.csv`` (or :meth:`Population.lineage` / :meth:`Population.metrics`), and says whether the
member returned descends from the default founder (the founder with the starting hyperparameters,
``algorithm.default_founder``): when it does, the search found nothing better than the starting values,
and a single run at them would have had the whole budget.
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

from evollm.run.plots_lineage import ancestry


def search_cost(lineage: pd.DataFrame, metrics: pd.DataFrame, member: int, step: int) -> dict[str, Any] | None:
    """The search behind ``member`` as evaluated at ``step``; ``None`` for a run of one member.

    Returns ``member_steps`` (learn steps of every member up to ``step``), ``steps`` (``step``: the
    member's weights trained at every one of them, as its ancestors' before it was cloned),
    ``share`` (``steps / member_steps``), ``founder`` (the founder of its lineage, ``None`` when the
    lineage does not hold it, e.g. a kept best state), ``default_founder`` (the default founder's id,
    ``None`` when the run had none or its files predate the column) and ``from_default_founder``.
    Hyperparameters at birth of both founders and of the member (those the founders differ in: the
    searched ones): ``founder_hyperparameters``, ``default_hyperparameters``, ``member_hyperparameters``.

    >>> lineage = pd.DataFrame({"member": [0, 1, 2], "parent": [None, None, 0], "step": [0, 0, 2],
    ...                         "default_founder": [True, False, True], "hp_lr": [5e-5, 5e-4, 6e-5]})
    >>> metrics = pd.DataFrame({"step": [1, 1, 2, 2, 3, 4], "member": [0, 1, 0, 1, 2, 2]})
    >>> out = search_cost(lineage, metrics, 2, 4)
    >>> out["member_steps"], out["share"], out["founder"], out["from_default_founder"]
    (6, 0.6666666666666666, 0, True)
    """
    if lineage.empty or lineage["member"].nunique() < 2 or metrics.empty:
        return None
    spent = int((metrics["step"] <= step).sum())
    chain = ancestry(lineage, int(member))
    founder = chain[-1]["member"] if chain and chain[-1]["parent"] is None else None
    founders = lineage[lineage["parent"].isna()].drop_duplicates("member", keep="first").set_index("member")
    default = None
    if "default_founder" in founders.columns:
        flagged = founders.index[founders["default_founder"].fillna(False).astype(bool)]
        default = int(flagged[0]) if len(flagged) else None
    # the searched hyperparameters: those the founders differ in (lora_rank, clip_coef... are logged for all)
    searched = [c for c in founders.columns if c.startswith("hp_") and founders[c].nunique(dropna=True) > 1]
    births = lineage.drop_duplicates("member", keep="last").set_index("member")
    return {"member_steps": spent, "steps": int(step), "share": step / spent if spent else math.nan,
            "founder": founder, "default_founder": default,
            "from_default_founder": founder is not None and founder == default,
            "founder_hyperparameters": _hyperparameters(founders, founder, searched),
            "default_hyperparameters": _hyperparameters(founders, default, searched),
            "member_hyperparameters": _hyperparameters(births, int(member), searched)}


def describe(cost: dict[str, Any]) -> list[str]:
    """The lines ``evollm report`` prints for :func:`search_cost`'s result."""
    lines = [f"the search: {cost['steps']:,} of the {cost['member_steps']:,} member-steps ({cost['share']:.0%}) "
             f"trained the best member's weights"]
    founder, default = cost["founder"], cost["default_founder"]
    if founder is None:
        return lines
    if cost["from_default_founder"]:
        start, now = cost["default_hyperparameters"], cost.get("member_hyperparameters") or {}
        moved = {k: v for k, v in now.items() if k in start and start[k] != v}
        lines.append(f"  it descends from founder m{founder}, the default founder (the starting hyperparameters): "
                     + ("the search found nothing better, and a single run at the starting values would have had "
                        "every member-step" if not moved else
                        f"its lineage mutated them to {_hps(moved)} (from {_hps({k: start[k] for k in moved})})"))
        return lines
    mine, theirs = cost["founder_hyperparameters"], cost["default_hyperparameters"]
    names = [k for k in mine if theirs.get(k) != mine[k]] if theirs else list(mine)
    lines.append(f"  it descends from founder m{founder} ({_hps({k: mine[k] for k in names})})"
                 + (f"; the default founder m{default} started at {_hps({k: theirs.get(k) for k in names})}"
                    if default is not None else ""))
    return lines


def _hyperparameters(rows: pd.DataFrame, member: int | None, columns: list[str]) -> dict[str, Any]:
    if member is None or member not in rows.index:
        return {}
    row = rows.loc[member]
    return {c[3:]: _plain(row[c]) for c in columns if c in rows.columns and pd.notna(row[c])}


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def _hps(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()) or "-"
