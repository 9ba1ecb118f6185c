"""What may change when a run is resumed: the resumed run config is compared with the one recorded in
the checkpoint, field by field. Only the fields of :data:`SAFE_ON_RESUME` (budget, evaluation and
checkpoint cadence, logging) may differ freely; any other difference is refused naming the
field, unless it is allowed explicitly (``evollm resume RUN --allow-change FIELD``), and an allowed
change is recorded in ``RUN/config_changes.json``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from evollm.utils.atomic import write_json

# fields (or whole sections) a resumed run may change without a flag: they change when or how long the
# run goes on, what it logs and how often it saves, never what the members learn (the same list as
# evollm.config.schema.RESUME_SETTABLE, which `resume --set` accepts, plus the run directory itself)
SAFE_ON_RESUME = ("train.max_steps", "train.max_time", "train.evaluation_interval", "train.checkpoint_every",
                  "train.keep_checkpoints", "train.stop_grace", "logging", "output_dir")
CHANGES_FILE = "config_changes.json"


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and scalars are leaves; an empty dict is a leaf)."""
    if isinstance(data, dict) and data:
        out = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


def covers(field: str, names) -> bool:
    """Whether ``field`` is one of ``names`` or lies inside one of them (``logging`` covers ``logging.plots``)."""
    return any(field == n or field.startswith(n + ".") for n in names)


def config_changes(saved: dict, resumed: dict) -> list[tuple[str, Any, Any]]:
    """``(field, saved value, resumed value)`` for every leaf that differs, in sorted field order."""
    old, new = flatten(saved), flatten(resumed)
    missing = object()
    out = []
    for field in sorted(set(old) | set(new)):
        a, b = old.get(field, missing), new.get(field, missing)
        if a != b:
            out.append((field, None if a is missing else a, None if b is missing else b))
    return out


def refused_changes(changes, allowed=()) -> list[tuple[str, Any, Any]]:
    return [c for c in changes if not covers(c[0], SAFE_ON_RESUME) and not covers(c[0], allowed)]


def _show(value) -> str:
    return "unset" if value is None else repr(value)


def refusal_message(refused, checkpoint: Path, total: int) -> str:
    field, old, new = refused[0]
    old, new = _show(old), _show(new)
    more = f" (and {len(refused) - 1} more: {', '.join(c[0] for c in refused[1:4])})" if len(refused) > 1 else ""
    safe = ", ".join(SAFE_ON_RESUME[:-1])
    return (f"resuming would change {field} from {old} to {new}{more}: checkpoint {checkpoint} was trained with "
            f"{old}; only {safe} may change when resuming; undo the change, or pass --allow-change {field} to "
            "resume with it (recorded in the run)")


def record_changes(run_dir: Path, changes, step: int) -> list[dict]:
    """Append the changes a resume made (allowed ones included) to ``run_dir/config_changes.json``."""
    path = Path(run_dir) / CHANGES_FILE
    try:
        history = json.loads(path.read_text()) if path.is_file() else []
    except ValueError:
        history = []
    entries = [{"step": int(step), "field": f, "from": a, "to": b, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "safe": covers(f, SAFE_ON_RESUME)} for f, a, b in changes]
    write_json(path, list(history if isinstance(history, list) else []) + entries)
    return entries
