"""Evolvable hyperparameter specifications.

:class:`RLParameter` describes the range and the mutation rule of one
hyperparameter (float, int or categorical); :class:`HyperparameterConfig`
groups them by name for an agent. ``lora_rank`` is an ordinary name in the
config: the mutation engine routes it to ``agent.set_lora_rank``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np

LORA_RANK = "lora_rank"

_DTYPE_NAMES = {float: "float", int: "int"}
_DTYPES_BY_NAME = {"float": float, "int": int}


def _round_half_up(x: float) -> int:
    """Round to the nearest integer, halves away from zero (4.5 -> 5, -4.5 -> -5)."""
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


@dataclass
class RLParameter:
    """Range and mutation rule of one evolvable hyperparameter.

    Args:
        min, max: inclusive bounds (numeric parameters only).
        grow_factor, shrink_factor: multiplicative perturbations; a perturbation
            picks one of them with probability 1/2.
        dtype: ``float`` or ``int`` (the strings ``"float"``, ``"int"`` and
            ``"categorical"`` are accepted too). Ignored when ``choices`` is given.
        log: sample log-uniformly (``min`` must then be > 0).
        choices: makes the parameter categorical, e.g. ``["grpo", "gspo"]``;
            ``min``/``max`` are then unused.
    """

    min: Optional[float] = None
    max: Optional[float] = None
    grow_factor: float = 1.2
    shrink_factor: float = 0.8
    dtype: Any = float
    log: bool = False
    choices: Optional[Sequence[Any]] = field(default=None)

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype == "categorical":
                if self.choices is None:
                    raise ValueError("RLParameter.choices is required for dtype='categorical'")
            elif self.dtype in _DTYPES_BY_NAME:
                self.dtype = _DTYPES_BY_NAME[self.dtype]
            else:
                raise ValueError(f"RLParameter.dtype must be float, int or 'categorical', "
                                 f"got {self.dtype!r}")
        if self.choices is not None:
            self.choices = list(self.choices)
            if not self.choices:
                raise ValueError("RLParameter.choices must not be empty")
            self.dtype = "categorical"
            self.log = False
            return
        if self.dtype not in (float, int):
            raise ValueError(f"RLParameter.dtype must be float, int or 'categorical', "
                             f"got {self.dtype!r}")
        for name in ("min", "max"):
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"RLParameter.{name} is required for numeric parameters")
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                raise ValueError(f"RLParameter.{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"RLParameter.{name} must be finite, got {value!r}")
            if self.dtype is int:
                if float(value) != int(value):
                    raise ValueError(f"RLParameter.{name} must be an integer for dtype=int, "
                                     f"got {value!r}")
                setattr(self, name, int(value))
            else:
                setattr(self, name, float(value))
        if self.min > self.max:
            raise ValueError(f"RLParameter.min ({self.min}) must be <= max ({self.max})")
        for name in ("grow_factor", "shrink_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RLParameter.{name} must be > 0, got {getattr(self, name)!r}")
        if self.log and self.min <= 0:
            raise ValueError(f"RLParameter.min must be > 0 when log=True, got {self.min}")

    @property
    def is_categorical(self) -> bool:
        """Whether the parameter takes values from ``choices``."""
        return self.choices is not None

    @property
    def dtype_name(self) -> str:
        """``"float"``, ``"int"`` or ``"categorical"``."""
        return "categorical" if self.is_categorical else _DTYPE_NAMES[self.dtype]

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is one of ``choices``, or numeric and inside ``[min, max]``."""
        if self.is_categorical:
            return value in self.choices
        try:
            return self.min <= value <= self.max
        except TypeError:
            return False

    def clamp(self, value: Any) -> Any:
        """Clip a numeric value to ``[min, max]`` and cast it to ``dtype``."""
        if self.is_categorical:
            return value
        value = min(max(value, self.min), self.max)
        return int(value) if self.dtype is int else float(value)

    def sample(self, rng: np.random.Generator) -> Any:
        """Draw a value uniformly over the range (log-uniformly when ``log``).

        Integers are drawn uniformly over ``{min, ..., max}``; with ``log`` the
        draw is log-uniform over ``[min, max + 1)`` then floored.
        """
        if self.is_categorical:
            return self.choices[int(rng.integers(len(self.choices)))]
        if self.dtype is int:
            if self.log:
                x = math.exp(rng.uniform(math.log(self.min), math.log(self.max + 1)))
                return self.clamp(math.floor(x))
            return int(rng.integers(self.min, self.max + 1))
        if self.log:
            return self.clamp(math.exp(rng.uniform(math.log(self.min), math.log(self.max))))
        return self.clamp(rng.uniform(self.min, self.max))

    def from_unit(self, u: float) -> Any:
        """The value at quantile ``u`` in ``[0, 1)`` of the distribution :meth:`sample` draws from.

        ``from_unit(rng.uniform())`` is a draw like :meth:`sample`'s; a point of a design on the unit
        cube (e.g. a Latin hypercube) maps to founders spread over the range the same way.
        """
        u = min(max(float(u), 0.0), math.nextafter(1.0, 0.0))
        if self.is_categorical:
            return self.choices[int(u * len(self.choices))]
        if self.dtype is int:
            if self.log:
                x = math.exp(math.log(self.min) + u * (math.log(self.max + 1) - math.log(self.min)))
                return self.clamp(math.floor(x + 1e-9))  # exp(log) round-off: 7.99999... at the quantile of 8
            return self.clamp(self.min + math.floor(u * (self.max - self.min + 1)))
        if self.log:
            return self.clamp(math.exp(math.log(self.min) + u * (math.log(self.max) - math.log(self.min))))
        return self.clamp(self.min + u * (self.max - self.min))

    def to_unit(self, value: Any) -> float:
        """The quantile in ``[0, 1)`` where ``value`` lies: the inverse of :meth:`from_unit` (an int or a
        choice maps to the middle of its bin), so ``from_unit(to_unit(v)) == v`` for a value in range."""
        if self.is_categorical:
            return (list(self.choices).index(value) + 0.5) / len(self.choices)
        x, is_int = float(self.clamp(value)), self.dtype is int
        lo, hi = float(self.min), float(self.max) + is_int
        if self.log:  # an int: the middle of [x, x + 1) on the log scale
            mid = (math.log(x) + math.log(x + 1)) / 2 if is_int else math.log(x)
            u = (mid - math.log(lo)) / (math.log(hi) - math.log(lo))
        else:
            u = (x + 0.5 * is_int - lo) / (hi - lo)
        return min(max(u, 0.0), math.nextafter(1.0, 0.0))

    def mutate(self, value: Any, rng: np.random.Generator,
               explore_prob: float = 0.0) -> tuple[Any, bool]:
        """Return ``(new_value, explored)``; ``new_value != value`` whenever the range allows it.

        With probability ``explore_prob`` the value is resampled over the whole
        range (:meth:`sample`, redrawn or perturbed if the draw equals ``value``)
        and ``explored`` is ``True``. Otherwise it is perturbed:

        * floats are multiplied by ``grow_factor`` or ``shrink_factor`` (50/50);
          on a linear scale, a value whose magnitude is below a floor of 1/10 of
          the range (e.g. ``beta = 0``) takes an additive step of ``(factor - 1) * floor``
          instead, so zero is not a fixed point;
        * integers are rounded to the nearest integer and step by 1 in the
          direction of the perturbation when rounding leaves them unchanged;
        * categorical values move to a different choice, picked uniformly.

        A step past a bound is reflected back into ``[min, max]`` (a value at
        ``max`` that grows comes back below it) instead of being clamped onto
        the bound. The value is returned unchanged only when the range has a
        single value (``min == max`` or one choice).
        """
        if not 0.0 <= explore_prob <= 1.0:
            raise ValueError(f"explore_prob must be in [0, 1], got {explore_prob!r}")
        if explore_prob > 0.0 and rng.random() < explore_prob:
            for _ in range(8):
                new = self.sample(rng)
                if new != value:
                    return new, True
            return self._perturb(value, rng), True
        return self._perturb(value, rng), False

    def _perturb(self, value: Any, rng: np.random.Generator) -> Any:
        if self.is_categorical:
            others = [c for c in self.choices if c != value]
            return others[int(rng.integers(len(others)))] if others else value
        if self.min == self.max:
            return self.clamp(self.min)
        grow = bool(rng.random() < 0.5)
        factor = self.grow_factor if grow else self.shrink_factor
        if self.dtype is int:
            value = int(value)
            new = _round_half_up(value * factor)
            if new == value:
                new = value + (1 if grow else -1)
            new = int(self._reflect(new))
            if new == value:  # reflected onto itself (a unit step at a bound): step the other way
                new = value + (-1 if new >= self.max else 1)
            return self.clamp(new)
        value = float(value)
        floor = 0.1 * (self.max - self.min)
        if (self.log or abs(value) >= floor) and value * factor != value:
            raw = value * factor
        else:
            raw = value + (factor - 1.0) * (floor if floor > 0 else 1.0)
        new = self.clamp(self._reflect(raw))
        if new == value:  # e.g. a factor of 1: move by a tenth of the range instead
            new = self.clamp(self._reflect(value + (floor if grow else -floor)))
        return new

    def _reflect(self, x: float) -> float:
        """Reflect ``x`` off the bounds back into ``[min, max]`` (clamped if it overshoots twice)."""
        if x > self.max:
            x = self.max - (x - self.max)
        elif x < self.min:
            x = self.min + (self.min - x)
        return min(max(x, self.min), self.max)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly representation; inverse of :meth:`from_dict`."""
        return {"min": self.min, "max": self.max, "grow_factor": self.grow_factor,
                "shrink_factor": self.shrink_factor, "dtype": self.dtype_name,
                "log": self.log, "choices": None if self.choices is None else list(self.choices)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RLParameter":
        """Build a parameter from :meth:`to_dict` output."""
        return cls(**data)


class HyperparameterConfig:
    """Named collection of :class:`RLParameter` (mapping-like, read-only).

    Example:
        ``HyperparameterConfig(lr=RLParameter(1e-6, 1e-4, log=True),
        lora_rank=RLParameter(min=2, max=64, dtype=int))``
    """

    def __init__(self, **params: RLParameter) -> None:
        for name, param in params.items():
            if not isinstance(param, RLParameter):
                raise TypeError(f"HyperparameterConfig.{name} must be an RLParameter, "
                                f"got {type(param).__name__}")
        self._params: dict[str, RLParameter] = dict(params)

    def names(self) -> tuple[str, ...]:
        """All parameter names, in definition order."""
        return tuple(self._params)

    def rl_hp_names(self) -> tuple[str, ...]:
        """Names other than ``lora_rank`` (the ones an ``rl_hp`` mutation picks from)."""
        return tuple(n for n in self._params if n != LORA_RANK)

    def keys(self) -> tuple[str, ...]:
        return self.names()

    def items(self):
        return self._params.items()

    def values(self):
        return self._params.values()

    def get(self, name: str, default: Any = None) -> Any:
        return self._params.get(name, default)

    def __getitem__(self, name: str) -> RLParameter:
        try:
            return self._params[name]
        except KeyError:
            raise KeyError(f"no hyperparameter {name!r} in config; "
                           f"known: {list(self._params)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HyperparameterConfig):
            return NotImplemented
        return self._params == other._params

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._params.items())
        return f"HyperparameterConfig({inner})"

    def validate_for(self, agent: Any) -> None:
        """Check that ``agent`` can evolve every name in the config.

        ``lora_rank`` is accepted when the agent has ``set_lora_rank``.

        Raises:
            ValueError: one line listing the unknown names and the names the
                agent can evolve.
        """
        allowed = list(agent.mutable_hyperparameters())
        if hasattr(agent, "set_lora_rank") and LORA_RANK not in allowed:
            allowed.append(LORA_RANK)
        unknown = [n for n in self._params if n not in allowed]
        if unknown:
            raise ValueError(f"agent {getattr(agent, 'index', '?')} cannot evolve "
                             f"hyperparameter(s) {unknown}; evolvable: {allowed}")

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        """Draw one value per parameter with :meth:`RLParameter.sample`."""
        return {name: param.sample(rng) for name, param in self._params.items()}

    def from_unit(self, point) -> dict[str, Any]:
        """One value per parameter (in order) at the quantiles ``point`` (see :meth:`RLParameter.from_unit`)."""
        if len(point) != len(self._params):
            raise ValueError(f"a point of {len(point)} coordinates for {len(self._params)} parameters")
        return {name: p.from_unit(u) for (name, p), u in zip(self._params.items(), point)}

    def to_unit(self, values: dict[str, Any]) -> list[float]:
        """The quantiles of ``values`` (one per parameter, in order): the inverse of :meth:`from_unit`."""
        return [p.to_unit(values[name]) for name, p in self._params.items()]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """JSON-friendly representation; inverse of :meth:`from_dict`."""
        return {name: param.to_dict() for name, param in self._params.items()}

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> "HyperparameterConfig":
        """Build a config from :meth:`to_dict` output."""
        return cls(**{name: RLParameter.from_dict(d) for name, d in data.items()})
