"""A reward function named in a config: a built-in name, a module path or a file path.

* ``exact_match``, ``last_number``, ... (:data:`evollm.tasks.user.BUILTIN_REWARDS`);
* ``mypkg.rewards:score`` (or ``mypkg.rewards.score``): a module importable from ``sys.path``, the
  config file's folder or the working directory;
* ``path/to/rewards.py:score``: a Python file, relative to the config file's folder or the working
  directory (or absolute).

:func:`locate_reward` turns a module or file spec into an absolute file spec
(``/abs/path/rewards.py:score``), which is what a run remembers: ``evollm resume`` in another shell or
another folder imports the same file. A file inside a package (folders with ``__init__.py``) is
imported under its package name, so its relative imports work.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, Iterable

from ..envs.reward_call import check_signature


def is_file_spec(spec: str) -> bool:
    """``path/to/file.py:fn`` (or ``file.py:fn``)."""
    path = spec.rpartition(":")[0] if ":" in spec else ""
    return path.endswith(".py") or "/" in path or os.sep in path


def split_spec(spec: str) -> tuple[str, str]:
    """``(module or file, function)`` of ``module:fn``, ``module.fn`` or ``file.py:fn``."""
    if ":" in spec and not (len(spec) > 1 and spec[1] == ":" and spec.count(":") == 1):  # not C:\\path
        target, _, attr = spec.rpartition(":")
    else:
        target, _, attr = spec.rpartition(".")
    return target, attr


def _hint(spec: str, attr: str, dirs: list[Path]) -> str:
    where = " and ".join(str(d) for d in dirs) or "the working directory"
    return (f"looked in {where} and on sys.path; give the file, e.g. 'path/to/rewards.py:{attr or 'score'}', "
            "or run with PYTHONPATH=<folder holding the module>")


def _package_root(path: Path) -> tuple[Path, str]:
    """``(folder for sys.path, dotted module name)`` of a .py file, walking up through packages."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").exists():
        parts.insert(0, folder.name)
        folder = folder.parent
    return folder, ".".join(parts)


def _find_module_file(module: str, dirs: Iterable[Path]) -> Path | None:
    rel = Path(*module.split("."))
    for d in dirs:
        for candidate in (d / rel.with_suffix(".py"), d / rel / "__init__.py"):
            if candidate.is_file():
                return candidate.resolve()
    return None


def locate_reward(spec: str, search_dirs: Iterable[str | os.PathLike] = ()) -> str:
    """``spec`` with a module or file resolved to an absolute file spec (``/abs/file.py:fn``); a
    built-in name, a callable or a module importable as it is (an installed package) are returned
    unchanged. ``search_dirs`` (e.g. the config file's folder, then the working directory) are tried
    first, in order. A spec that cannot be found is a one-line :class:`ValueError` with a hint."""
    from .user import BUILTIN_REWARDS

    if not isinstance(spec, str) or spec in BUILTIN_REWARDS:
        return spec
    dirs = [Path(d).resolve() for d in search_dirs] or [Path.cwd()]
    target, attr = split_spec(spec)
    if not target or not attr:
        raise ValueError(f"task.reward={spec!r} is not valid; choose one of {sorted(BUILTIN_REWARDS)} or give "
                         "'module:function' or 'path/to/file.py:function'")
    if is_file_spec(spec):
        path = Path(target).expanduser()
        found = [path] if path.is_absolute() else [d / path for d in dirs]
        for p in found:
            if p.is_file():
                return f"{p.resolve()}:{attr}"
        raise ValueError(f"task.reward={spec!r}: file {target!r} not found; looked in "
                         f"{' and '.join(str(d) for d in dirs)}")
    local = _find_module_file(target, dirs)
    if local is not None:
        return f"{local}:{attr}"
    if importlib.util.find_spec(target.split(".")[0]) is not None:
        return spec  # an installed package: imported by name
    raise ValueError(f"task.reward={spec!r}: cannot import module {target!r} (no "
                     f"{Path(*target.split('.')).with_suffix('.py')}); {_hint(spec, attr, dirs)}")


def _import_file(path: Path, spec: str):
    if not path.is_file():
        raise ValueError(f"task.reward={spec!r}: file {str(path)!r} does not exist")
    root, name = _package_root(path)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # its sibling modules import as they would from its folder
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) \
            and Path(sys.modules[name].__file__).resolve() == path.resolve():
        return sys.modules[name]
    if "." in name:
        return importlib.import_module(name)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def import_reward(spec: str, search_dirs: Iterable[str | os.PathLike] = ()) -> Callable:
    """The function a module or file spec names (see :func:`locate_reward`), signature checked."""
    located = locate_reward(spec, search_dirs)
    target, attr = split_spec(located)
    try:
        if is_file_spec(located):
            module = _import_file(Path(target), spec)
        else:
            module = importlib.import_module(target)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        where, tb = "", e.__traceback__
        while tb is not None:  # the last frame outside importlib: the user's line that failed
            name = tb.tb_frame.f_code.co_filename
            if not name.startswith("<frozen") and "importlib" not in name:
                where = f" (line {tb.tb_lineno} of {name})"
            tb = tb.tb_next
        if isinstance(e, SyntaxError):
            where = f" (line {e.lineno} of {e.filename})"
        hint = f"; {_hint(spec, attr, [])}" if isinstance(e, ModuleNotFoundError) and e.name == target.split(".")[0] \
            else ""
        raise ValueError(f"task.reward={spec!r}: importing {target!r} failed: {type(e).__name__}: {e}{where}{hint}"
                         ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ValueError(f"task.reward={spec!r}: {target!r} has no function {attr!r}"
                         + (f"; its functions: {names}" if names else ""))
    check_signature(fn, f"task.reward={spec!r}")
    return fn
