"""Calling a user's reward function, in either of the two shapes users bring.

* **per sample** (evollm's own): ``reward(completion, answer, question, **columns) -> float``; a
  function that names other dataset columns (or takes ``**kwargs``) receives them too.
* **batched** (TRL's ``GRPOTrainer`` style): ``reward(completions, **kwargs) -> list[float]``, called
  once per batch with keyword arguments ``prompts``, ``completions`` and one list per dataset column
  (``answer``, ``solution``, ...). For a conversational dataset (a ``prompt`` or ``messages`` column
  holding a list of messages) ``prompts`` are those messages and every completion is
  ``[{"role": "assistant", "content": text}]``, exactly as TRL passes them. A ``None`` in the list
  (TRL: "this reward does not apply to this sample") is not accepted: every sample needs a number.

A function is batched when it has a ``completions`` parameter (or ``fn.batched = True``).
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
from typing import Any, Callable, Sequence


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not a finite number."""


def reward_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _params(fn: Callable) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` is a TRL-style batched reward (a ``completions`` parameter, or ``fn.batched``)."""
    flag = getattr(fn, "batched", None)
    if flag is not None:
        return bool(flag)
    params = _params(fn)
    return params is not None and any(p.name == "completions" for p in params)


def check_signature(fn: Callable, where: str = "reward_fn") -> None:
    """A one-line :class:`ValueError` when ``fn`` fits neither shape."""
    params = _params(fn)
    if params is None:
        return
    if is_batched(fn):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ValueError(f"{where} must take (completion, answer, question) and return a float, or "
                         f"(completions, **kwargs) and return a list of floats (TRL style); it takes "
                         f"({', '.join(p.name for p in params)})")


def extra_columns_wanted(fn: Callable) -> tuple[str, ...] | None:
    """Extra dataset columns a per-sample ``fn`` takes as keywords: their names, or ``None`` for all of
    them (a ``**kwargs`` parameter)."""
    params = _params(fn)
    if params is None:
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    named = [p.name for p in params[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return tuple(n for n in named if n not in ("question", "answer", "completion"))


def _finite(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out


def _describe(row: dict, completion: str) -> str:
    return f"question={row.get('question')!r}, completion={completion!r}"


def with_timeout(fn: Callable, seconds: float | None) -> Callable:
    """``fn`` limited to ``seconds`` per call (``None``: unlimited): each call runs in a daemon thread and
    one that has not returned in time raises :class:`TimeoutError` (reported like any failing reward; the
    stuck call is left behind and ends with the process). Signature and ``batched`` flag are kept."""
    if seconds is None:
        return fn
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"reward_timeout must be a number of seconds > 0 or None, got {seconds!r}")

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        box: dict[str, Any] = {}
        done = threading.Event()

        def target():
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=target, daemon=True, name="evollm-reward").start()
        if not done.wait(seconds):
            raise TimeoutError(f"no result within reward_timeout={seconds:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    return timed


def call_per_sample(fn: Callable, completion: str, row: dict, i: int) -> float:
    """One sample's reward from a per-sample ``fn`` (``row``: question, answer and the extra columns)."""
    name = reward_name(fn)
    try:
        r = fn(completion, row.get("answer"), row.get("question"), **row.get("extra", {}))
    except Exception as e:  # noqa: BLE001 - re-raised with the sample named
        raise RewardFunctionError(f"reward function {name} raised {type(e).__name__}: {e} on sample {i} "
                                  f"({_describe(row, completion)})") from None
    value = _finite(r)
    if not math.isfinite(value):
        raise RewardFunctionError(f"reward function {name} returned {r!r} (not a finite number) on sample {i} "
                                  f"({_describe(row, completion)}); it must return a float")
    return value


def call_batched(fn: Callable, completions: Sequence[str], rows: Sequence[dict]) -> list[float]:
    """Rewards of ``completions[k]`` (an answer to ``rows[k]``) from a TRL-style batched ``fn``."""
    name = reward_name(fn)
    conversational = any(r.get("conversational") for r in rows)
    kwargs: dict[str, Any] = {
        "prompts": [r.get("prompt") for r in rows],
        "completions": ([[{"role": "assistant", "content": c}] for c in completions] if conversational
                        else list(completions)),
    }
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r.get("columns", {}) if k not in keys and k not in ("prompt", "completion")]
    kwargs.update({k: [r.get("columns", {}).get(k) for r in rows] for k in keys})
    params = _params(fn)
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
        names = {p.name for p in params}
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    try:
        out = fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with the batch named
        raise RewardFunctionError(f"reward function {name} raised {type(e).__name__}: {e} on a batch of "
                                  f"{len(completions)} completions (first: {_describe(rows[0], completions[0])})"
                                  ) from None
    if not isinstance(out, (list, tuple)) and not hasattr(out, "tolist"):
        raise RewardFunctionError(f"reward function {name} returned {type(out).__name__}; a batched reward "
                                  f"(completions, **kwargs) must return a list of {len(completions)} floats")
    out = list(out.tolist() if hasattr(out, "tolist") else out)
    if len(out) != len(completions):
        raise RewardFunctionError(f"reward function {name} returned {len(out)} rewards for {len(completions)} "
                                  "completions; it must return one float per completion")
    values = [_finite(v) for v in out]
    for k, v in enumerate(values):
        if not math.isfinite(v):
            raise RewardFunctionError(f"reward function {name} returned {out[k]!r} (not a finite number) for "
                                      f"completion {k} ({_describe(rows[k], completions[k])}); every "
                                      "completion needs a float")
    return values
