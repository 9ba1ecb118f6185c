"""Strict, documented config sections: dataclasses loaded from plain dicts (YAML / JSON / ``--set``).

A section is a dataclass deriving from :class:`Section` whose fields are declared with :func:`option`::

    @dataclass
    class ModelSection(Section):
        dtype: str = option("float32", "Weights dtype of a hub model.", choices=("float32", "bfloat16"),
                            when={"source": ("hub",)})

Adding a setting is one such line. Loading (:meth:`Section.from_dict`) is strict:

* an unknown key is a :class:`ConfigError` naming the key, its section, a close match and the valid keys;
* values are coerced to the annotated type: a float/int field accepts ``"1e-3"`` (YAML 1.1 reads
  exponent notation without a dot as a string), a nested section is loaded recursively, anything else
  that does not fit is an error naming the field and the expected type;
* ``choices`` are checked; ``when`` declares the settings a field depends on, and
  :func:`check_no_effect` turns an explicitly given field whose condition fails into an error (a setting
  that would silently do nothing);
* ``path=True`` marks a path the run writes, resolved against ``output_dir`` by :func:`resolve_paths`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, field
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml


class ConfigError(ValueError):
    """A bad setting; the message is one line naming the field and what is valid."""


def option(default: Any = MISSING, help: str = "", *, choices: Any = None, when: dict | None = None,
           path: bool = False, default_factory: Callable[[], Any] | Any = MISSING) -> Any:
    """A documented section field.

    Args:
        default: the default value (lists and dicts are copied for every instance).
        help: what the setting does (shown in the docs and in errors).
        choices: the valid values (a sequence, or a callable returning one).
        when: ``{other_field: allowed_values}`` that must hold for this field to have an effect;
            ``other_field`` is a name in the same section or an absolute dotted path (``"env.type"``).
        path: a path the run writes; relative values are taken relative to ``output_dir``.
    """
    metadata = {"help": help, "choices": choices, "when": when, "path": path}
    if default_factory is MISSING and isinstance(default, (list, dict, set)):
        default_factory = lambda value=default: copy.deepcopy(value)  # noqa: E731
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def did_you_mean(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def unknown_key_error(key: Any, where: str, valid: list[str]) -> ConfigError:
    section = f"section {where!r}" if where else "the top level"
    full = f"{where}.{key}" if where else str(key)
    return ConfigError(f"{full}: unknown key in {section}; {did_you_mean(key, valid)}valid keys: {sorted(valid)}")


class Section:
    """Base of every config section: strict loading, the set of explicitly given keys, dict views."""

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> "Section":
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where or 'config'} must be a mapping of keys to values, got {data!r}")
        data = cls.prepare(dict(data), where)
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}
        kwargs = {}
        for key, value in data.items():
            if key not in fields:
                raise unknown_key_error(key, where, list(fields))
            name = f"{where}.{key}" if where else str(key)
            value = coerce(value, hints[key], name)
            choices = fields[key].metadata.get("choices")
            choices = choices() if callable(choices) else choices
            if choices is not None and value is not None and value not in choices:
                raise ConfigError(f"{name}={value!r} is not valid; {did_you_mean(value, list(choices))}"
                                  f"choose one of {list(choices)}")
            kwargs[key] = value
        given = frozenset(kwargs)
        for key in fields.keys() - given:  # default sub-sections are loaded too, so their checks run
            if isinstance(hints[key], type) and issubclass(hints[key], Section):
                kwargs[key] = hints[key].from_dict({}, f"{where}.{key}" if where else key)
        try:
            section = cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where or 'config'}: {e}") from e
        object.__setattr__(section, "_given", given)
        object.__setattr__(section, "_where", where)
        section.finalize()
        return section

    @classmethod
    def prepare(cls, data: dict, where: str) -> dict:
        """Hook: rewrite the raw mapping before strict loading (e.g. to accept a legacy spelling)."""
        return data

    def finalize(self) -> None:
        """Hook: derive defaults and check cross-field rules after loading (raise :class:`ConfigError`)."""

    def given(self, name: str) -> bool:
        """Whether ``name`` was set explicitly (not left at its default)."""
        return name in getattr(self, "_given", ())

    def path(self) -> str:
        """Dotted path of this section in the run config (``""`` at the top)."""
        return getattr(self, "_where", "")

    def where(self, name: str) -> str:
        prefix = getattr(self, "_where", "")
        return f"{prefix}.{name}" if prefix else name

    def get(self, name: str, default: Any = None) -> Any:
        """Dict-style read of a field (``default`` for a name that is not a field)."""
        return getattr(self, name, default) if name in field_names(type(self)) else default

    def to_dict(self, explicit: bool = False) -> dict:
        """Plain data; with ``explicit`` only the keys that were given (what reloads to the same config)."""
        if not explicit:
            return to_plain(self)
        out = {}
        for name in field_names(type(self)):
            value = getattr(self, name)
            if isinstance(value, Section):
                sub = value.to_dict(explicit=True)
                if sub or self.given(name):
                    out[name] = sub
            elif self.given(name):
                out[name] = to_plain(value)
        return out


def name_field(prefix: str, message: str, config_cls) -> str:
    """``prefix.field ...`` when ``message`` starts with a field of ``config_cls``, else ``prefix: message``."""
    head = re.match(r"(\w+)", message)
    if head and head.group(1) in init_hints(config_cls):
        return f"{prefix}.{message}"
    return f"{prefix}: {message}"


def init_hints(cls) -> dict[str, Any]:
    """Type hints of the fields a dataclass takes in ``__init__``."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


def document(cls, prefix: str = "") -> str:
    """``section.field = default: help`` for every field of ``cls`` and its nested sections."""
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        tp, name = hints[f.name], f"{prefix}{f.name}"
        if isinstance(tp, type) and issubclass(tp, Section):
            lines.append(document(tp, name + "."))
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        lines.append(f"{name} = {default!r}: {f.metadata.get('help', '')}")
    return "\n".join(lines)


def to_plain(value: Any) -> Any:
    """Sections, tuples and nested containers as plain JSON/YAML data."""
    if isinstance(value, Section):
        return {name: to_plain(getattr(value, name)) for name in field_names(type(value))}
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


# --------------------------------------------------------------------------- coercion
def describe(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Any:
        return "any value"
    if isinstance(tp, type) and issubclass(tp, Section):
        return "a mapping"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin in (list, tuple) and args:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return f"a list of {len(args)} values ({', '.join(describe(a) for a in args)})"
        return f"a list of items, each {describe(args[0])}"
    if origin in (dict, Mapping) or tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def coerce(value: Any, tp: Any, name: str) -> Any:
    """``value`` as type ``tp`` (see the module docstring), or a :class:`ConfigError` naming ``name``."""
    try:
        return _coerce(value, tp, name)
    except _Mismatch:
        raise ConfigError(f"{name} must be {describe(tp)}, got {value!r}") from None


class _Mismatch(Exception):
    pass


def _coerce(value: Any, tp: Any, name: str) -> Any:
    if tp is Any:
        return value
    if isinstance(tp, type) and issubclass(tp, Section):
        return tp.from_dict(value, name)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in sorted((a for a in args if a is not type(None)), key=_union_order(value)):
            try:
                return _coerce(value, arg, name)
            except _Mismatch:
                continue
        raise _Mismatch
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        number = _number(value)
        if number is None:
            raise _Mismatch
        return number
    if tp is int:
        number = _number(value)
        if number is None or not math.isfinite(number) or number != int(number):
            raise _Mismatch
        return int(number)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise _Mismatch
            return tuple(_coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if (origin or tp) is tuple else out
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _Mismatch
        kt, vt = args if args else (Any, Any)
        return {coerce(k, kt, name): coerce(v, vt, f"{name}.{k}") for k, v in value.items()}
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _Mismatch
    return value


def _union_order(value: Any) -> Callable[[Any], int]:
    """Try the member of a union that matches the value's own type first (``3`` -> int before float)."""
    def rank(arg: Any) -> int:
        if isinstance(value, bool):
            return 0 if arg is bool else 1
        if isinstance(value, int) and arg is int:
            return 0
        if isinstance(value, float) and arg is float:
            return 0
        if isinstance(value, str) and arg is str:
            return 2  # "1e-3" for float | str is read as the number
        if isinstance(value, (list, tuple)) and typing.get_origin(arg) in (list, tuple):
            return 0
        return 1
    return rank


# --------------------------------------------------------------------------- whole-config passes
def walk(section: Section) -> Iterator[tuple[Section, dataclasses.Field]]:
    """Every (section, field) pair, nested sections and mappings of sections included."""
    for f in dataclasses.fields(section):
        if not f.init or f.name.startswith("_"):
            continue
        yield section, f
        value = getattr(section, f.name)
        children = value.values() if isinstance(value, Mapping) else [value]
        for child in children:
            if isinstance(child, Section):
                yield from walk(child)


def lookup(root: Section, section: Section, path: str) -> Any:
    node: Any = section if "." not in path else root
    for part in path.split("."):
        node = getattr(node, part)
    return node


def check_no_effect(root: Section) -> None:
    """An explicitly given field whose ``when`` condition fails is an error: it would do nothing."""
    for section, f in walk(root):
        when = f.metadata.get("when")
        if not when or not section.given(f.name) or getattr(section, f.name) is None:
            continue
        for path, allowed in when.items():
            actual = lookup(root, section, path)
            ok = allowed(actual) if callable(allowed) else actual in allowed
            if not ok:
                other = path if "." in path else section.where(path)
                valid = "" if callable(allowed) else f" (it applies when {other} is one of {list(allowed)})"
                raise ConfigError(f"{section.where(f.name)} has no effect when {other}={actual!r}{valid}; "
                                  f"remove it (on the command line: --set {section.where(f.name)}=null)")


def resolve_paths(root: Section, output_dir: str | Path) -> None:
    """Make every relative ``path=True`` field relative to ``output_dir`` (in place)."""
    for section, f in walk(root):
        value = getattr(section, f.name)
        if f.metadata.get("path") and isinstance(value, str) and value and not Path(value).is_absolute():
            setattr(section, f.name, str(Path(output_dir) / value))


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML file, or a one-line :class:`ConfigError`."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory, not a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of sections, got {type(data).__name__}")
    return data


def apply_override(data: dict, item: str) -> None:
    """Apply one ``section.key=value`` override (the value is parsed as YAML) to raw config data.
    ``null`` removes a section or mapping (``--set hpo.mutation=null``: back to its defaults, or
    absent); a plain setting set to ``null`` is null (``--set train.evo_steps=null``)."""
    key, parts, value = parse_override(item)
    node = data
    for depth, part in enumerate(parts[:-1]):
        if value is None and not isinstance(node.get(part), dict):
            return  # removing something that is not there
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[:depth + 1])} is a value, not a section")
        node = child
    if value is None and (isinstance(node.get(parts[-1]), dict) or parts[-1] not in node):
        node.pop(parts[-1], None)
        return
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, list[str], Any]:
    """``(dotted key, its parts, value)`` of a ``section.key=value`` override, or a one-line error."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"--set {item!r} must look like section.key=value (e.g. train.max_steps=10)")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {item!r}: {key!r} is not a dotted key like train.max_steps")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        hint = (f"; quote it: --set '{key.strip()}=\"{text}\"'" if text.strip()[:1] in "{[&*!|>%@`" else "")
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({getattr(e, 'problem', e)}){hint}") from e
    return key.strip(), parts, value


#: what ``evollm resume --set`` may change: the budget, how often the run evaluates and checkpoints,
#: and the live logging. Everything else would make the resumed run another run.
RESUME_SETTABLE = ("train.max_steps", "train.max_time", "train.evaluation_interval", "train.checkpoint_every",
                   "train.keep_checkpoints", "train.stop_grace", "logging")


def resume_settable(key: str) -> bool:
    """Whether ``--set key=...`` may change a run that resumes (see :data:`RESUME_SETTABLE`)."""
    return any(key == k or key.startswith(k + ".") for k in RESUME_SETTABLE)


def check_resume_override(item: str) -> str:
    """The dotted key of a ``--set`` that a resumed run accepts, or a one-line :class:`ConfigError`."""
    key, _, _ = parse_override(item)
    if not resume_settable(key):
        raise ConfigError(f"--set {item!r}: {key} cannot change when resuming (it would make another run); "
                          f"resume can change {', '.join(k + ('.*' if '.' not in k else '') for k in RESUME_SETTABLE)}")
    return key
