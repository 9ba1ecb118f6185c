"""Crash-safe checkpoint folders: write into a temporary sibling, fsync, rename into place, and list
every file with its sha256 in ``manifest.json``, written last.

A folder without a valid manifest is never loaded: :func:`verify` says which file is missing or
does not match. A reader that sees a folder under its final name sees a complete one (``rename`` is
atomic on POSIX file systems); a kill at any moment leaves either the old folder, the new one, or a
``.tmp-*`` sibling that :func:`clean_temporaries` removes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

MANIFEST = "manifest.json"
FORMAT = "evollm-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded; the message names the folder and the file."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, kind: str, extra: dict | None = None) -> dict:
    """fsync every file of ``folder`` and write the manifest (sha256 + size per file) last."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        _fsync(path)
        files[path.relative_to(folder).as_posix()] = {"sha256": sha256(path), "bytes": path.stat().st_size}
    manifest = {"format": FORMAT, "kind": kind, "created": time.time(), "files": files, **(extra or {})}
    target = folder / MANIFEST
    target.write_text(json.dumps(manifest, indent=1))
    _fsync(target)
    for sub in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        _fsync(sub)
    return manifest


def verify(folder: str | Path, kind: str | None = None) -> dict:
    """The manifest of ``folder`` after checking every listed file; a :class:`CheckpointError` otherwise."""
    folder = Path(folder)
    if not folder.exists():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} is a file, not a checkpoint folder")
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}: it is incomplete (an interrupted save) or "
                              "was not written by evollm's checkpointing")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is unreadable ({e})") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} has format {manifest.get('format')!r}, "
                              f"expected {FORMAT!r}")
    if kind is not None and manifest.get("kind") != kind:
        raise CheckpointError(f"checkpoint {folder} holds a {manifest.get('kind')!r} checkpoint, not a {kind!r} one")
    for name, entry in files.items():
        target = folder / name
        if not target.is_file():
            raise CheckpointError(f"checkpoint {folder}: {name} is listed in {MANIFEST} but missing")
        if target.stat().st_size != entry["bytes"] or sha256(target) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {folder}: {name} does not match its sha256 in {MANIFEST} "
                                  "(changed or truncated after the save)")
    return manifest


@contextlib.contextmanager
def atomic_folder(final: str | Path, kind: str, extra: dict | None = None) -> Iterator[Path]:
    """``with atomic_folder(path, "population") as tmp:`` write files into ``tmp``; on success the manifest
    is written and ``tmp`` replaces ``path`` (an existing folder there is replaced whole)."""
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {final}: it is a file")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        yield tmp
        write_manifest(tmp, kind, extra)
        old = None
        if final.exists():
            old = final.parent / f".old-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_folder(folder: str | Path) -> None:
    """Delete a checkpoint folder so that a kill mid-way never leaves a half-deleted one under its name."""
    folder = Path(folder)
    trash = folder.parent / f".del-{folder.name}-{os.getpid()}-{time.monotonic_ns()}"
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clean_temporaries(parent: str | Path) -> None:
    """Remove ``.tmp-*`` / ``.old-*`` / ``.del-*`` folders left by saves and deletions that were killed."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for p in sorted(parent.iterdir()):
        if p.is_dir() and p.name.startswith(".old-"):
            final = parent / p.name[len(".old-"):].rsplit("-", 2)[0]
            if not final.exists():  # killed between the two renames: the old folder is still the good one
                os.rename(p, final)
                continue
        if p.is_dir() and p.name.startswith((".tmp-", ".old-", ".del-")):
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------- single files
@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """``with atomic_file(path) as tmp:`` write ``tmp``; on success it replaces ``path`` (a reader or a
    crash never sees half a file); on failure ``tmp`` is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON to ``path`` atomically (see :func:`jsonable` for the types)."""
    return write_text(path, json.dumps(data, indent=1, default=jsonable))


def jsonable(value: Any) -> Any:
    """The JSON form of what evollm records: dataclasses as dicts, tuples as lists, tensor/numpy
    scalars as Python numbers, NaN as ``null``; anything else as its ``str``."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# --------------------------------------------------------------------------- cache folders
def write_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp_folder)`` and rename the folder to ``target``: a half-written cache entry is
    never used, and two concurrent writers do not clash (the first rename wins)."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    os.chmod(tmp, 0o755)  # a shared cache: readable by every user of the machine
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent build: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------- tensor files
def save_tensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file``, with a failed write (a full disk, a file-size limit, a read-only
    folder) raised as an :class:`OSError` naming the file, like every other write."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        raise OSError(f"could not write {path}: {e}") from e
