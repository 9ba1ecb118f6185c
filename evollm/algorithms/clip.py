"""The policy clip range, in ONE encoding: two offsets ``clip_low`` / ``clip_high``.

The importance ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` (TRL's ``epsilon`` /
``epsilon_high``, DAPO's clip-higher). ``clip_coef`` is an alias of the pair: a float ``c`` sets both
offsets to ``c``; a tuple ``(a, b)`` means ``clip_low = a``, ``clip_high = b`` (two offsets, never
bounds). An offset the user sets itself wins over the alias; what neither gives comes from the
algorithm's default (:meth:`~evollm.algorithms.base.AgentConfig.default_clip`; GRPO's is its loss
type's preset, so it follows ``loss_type`` when that mutates).

:func:`clip_range` is the one place where these fields become the two offsets; everything below the
config (the losses in :mod:`evollm.functional`) receives ``clip_low`` / ``clip_high``. PPO's value-loss
clip is a separate field (``value_clip``) and never moves with these.
"""

from __future__ import annotations

import math

#: the hyperparameter names of the clip range (each can evolve)
CLIP_NAMES = ("clip_coef", "clip_low", "clip_high")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def coef_offsets(clip_coef) -> tuple[float, float]:
    """``(clip_low, clip_high)`` from a ``clip_coef`` float or ``(clip_low, clip_high)`` tuple."""
    if isinstance(clip_coef, (tuple, list)):
        if len(clip_coef) != 2:
            raise ValueError(f"clip_coef tuple must contain exactly two values (clip_low, clip_high), "
                             f"got {clip_coef!r}")
        if not all(_number(v) for v in clip_coef):
            raise TypeError(f"clip_coef must be a float or a tuple or list of two floats, got {clip_coef!r}")
        return float(clip_coef[0]), float(clip_coef[1])
    if _number(clip_coef):
        return float(clip_coef), float(clip_coef)
    raise TypeError(f"clip_coef must be a float or a tuple or list of two floats, got {clip_coef!r}")


def clip_range(config) -> tuple[float, float]:
    """``(clip_low, clip_high)`` in effect: the offsets set themselves, else from ``clip_coef``, else the
    config's :meth:`default_clip`."""
    low, high = config.default_clip() if config.clip_coef is None else coef_offsets(config.clip_coef)
    if config.clip_low is not None:
        low = float(config.clip_low)
    if config.clip_high is not None:
        high = float(config.clip_high)
    return low, high


def check_clip(config) -> None:
    """Reject a clip range no loss can use, naming the field that gave it (one line)."""
    low, high = clip_range(config)
    for name, value, side in (("clip_low", low, "low"), ("clip_high", high, "high")):
        given = getattr(config, name)
        if given is not None and not _number(given):
            raise TypeError(f"{name} must be a float, got {given!r}")
        source = name if given is not None else "clip_coef"
        shown = given if given is not None else config.clip_coef
        if side == "low" and not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"{source}={shown!r} gives clip_low={value}: the lower offset must be in [0, 1] "
                             f"(the ratio is clipped below at 1 - clip_low >= 0)")
        if side == "high" and not value >= 0.0:  # inf: no upper clip
            raise ValueError(f"{source}={shown!r} gives clip_high={value}: the upper offset must be >= 0")


def get_clip(config, name: str) -> float:
    """``clip_low`` or ``clip_high`` in effect, or ``clip_coef``: the alias itself when it is a float
    that nothing overrides, else the mean of the two offsets."""
    low, high = clip_range(config)
    if name == "clip_low":
        return low
    if name == "clip_high":
        return high
    if _number(config.clip_coef) and config.clip_low is None and config.clip_high is None:
        return float(config.clip_coef)
    return (low + high) / 2


def set_clip(config, name: str, value: float) -> None:
    """Set ``clip_low`` / ``clip_high``, or ``clip_coef``: a symmetric range stays one float; an asymmetric
    one (a tuple, set offsets, or a preset) has both offsets scaled so that their mean is ``value`` and
    their ratio is kept."""
    if name in ("clip_low", "clip_high"):
        setattr(config, name, float(value))
        return
    low, high = clip_range(config)
    plain = config.clip_low is None and config.clip_high is None and not isinstance(config.clip_coef, (tuple, list))
    if plain and (_number(config.clip_coef) or abs(low - high) < 1e-12):
        config.clip_coef = float(value)
        return
    old = (low + high) / 2
    if old > 0:
        config.clip_low, config.clip_high = low * float(value) / old, high * float(value) / old
    else:
        config.clip_low = config.clip_high = float(value)
