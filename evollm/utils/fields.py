"""Documented dataclass fields, in one style (TRL's): the help text of a field lives in its
``metadata["help"]``::

    @dataclass
    class GRPOConfig(AgentConfig):
        group_size: int = documented(8, "Completions sampled per prompt; advantages are relative to them.")

A subclass may change a field's default without repeating its help (``lr: float = 1e-4``):
:func:`field_help` takes the help from the nearest class in the MRO that documents the field.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import MISSING, field
from typing import Any


def documented(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING) -> Any:
    """A dataclass field with help text (lists, dicts and sets as defaults are copied per instance)."""
    if default_factory is MISSING and isinstance(default, (list, dict, set)):
        default_factory = lambda value=default: copy.deepcopy(value)  # noqa: E731
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def field_help(cls) -> dict[str, str]:
    """``{field: help}`` for every init field of the dataclass ``cls`` ("" where none is documented); the help
    of a field whose default a subclass overrides comes from the nearest class in the MRO documenting it."""
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        text = f.metadata.get("help", "")
        if not text:
            for base in cls.__mro__[1:]:
                inherited = getattr(base, "__dataclass_fields__", {}).get(f.name)
                if inherited is not None and inherited.metadata.get("help"):
                    text = inherited.metadata["help"]
                    break
        out[f.name] = text
    return out


def field_default(f: dataclasses.Field) -> Any:
    """The default value of a dataclass field (its factory called), or ``MISSING``."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING
