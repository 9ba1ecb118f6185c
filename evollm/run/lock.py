"""One writer per run directory: ``RUN/.lock`` names the process that writes it (pid, host, process
start time, command). A second ``evollm train`` or ``evollm resume`` on a live run is refused in one
line naming the holder; a lock left by a process that is gone (same host, pid dead or reused) is taken
over with a one-line note. The lock file is created whole (written aside, then hard-linked into place),
so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

LOCK = ".lock"


class RunLocked(ValueError):
    """The run directory is held by another live process."""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux ``/proc/PID/stat`` field 22), to tell a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def holder_description(info: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"pid {info.get('pid')} on host {info.get('host')} ({info.get('command', '?')}, since {since})"


class RunLock:
    """``with RunLock(run_dir):`` holds ``run_dir/.lock`` for this process (re-entrant in one process)."""

    _held: dict[str, int] = {}  # lock path -> how many holders in this process

    def __init__(self, directory: str | Path, command: str | None = None, log: Callable[[str], None] = print):
        self.directory = Path(directory)
        self.path = self.directory / LOCK
        self.command = command or " ".join(["evollm", *sys.argv[1:]])[:200]
        self.log = log
        self.acquired = False

    def _mine(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
                "since": time.time(), "command": self.command}

    def read(self) -> dict | None:
        try:
            info = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def is_stale(self, info: dict) -> bool:
        """Held by a process on this host that is gone (its pid dead, or reused by a younger process)."""
        if info.get("host") != socket.gethostname():
            return False
        pid = info.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            return True
        if not _alive(pid):
            return True
        start = info.get("start")
        return start is not None and _start_time(pid) not in (None, start)

    def acquire(self) -> "RunLock":
        self.directory.mkdir(parents=True, exist_ok=True)
        key = str(self.path.resolve())
        inside = [str(parent / LOCK) for parent in Path(key).parent.parents]
        held = next((k for k in [key, *inside] if RunLock._held.get(k)), None)
        if held is not None:  # this process already holds this directory or one above it
            self.key = held
            RunLock._held[held] += 1
            self.acquired = True
            return self
        for _ in range(5):
            tmp = self.directory / f".lock.{os.getpid()}.{time.monotonic_ns()}"
            tmp.write_text(json.dumps(self._mine()))
            try:
                os.link(tmp, self.path)  # atomic, and fails when a lock exists
                break
            except FileExistsError:
                info = self.read()
                if info is None:
                    continue  # released meanwhile: try again
                if info and info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
                    break  # left by this very process (a run that ended without releasing it)
                if not info or self.is_stale(info):
                    what = holder_description(info) if info else "an unreadable lock file"
                    self.log(f"evollm: taking over the lock of {self.directory} from {what}: that process is gone")
                    self.path.unlink(missing_ok=True)
                    continue
                raise RunLocked(f"run directory {self.directory} is in use by {holder_description(info)}; wait for "
                                f"it to end or stop it (kill -TERM {info.get('pid')}); if that process is gone, "
                                f"delete {self.path}") from None
            finally:
                tmp.unlink(missing_ok=True)
        else:
            raise RunLocked(f"could not take the lock {self.path} (other processes keep taking it)")
        RunLock._held[key] = 1
        self.key, self.acquired = key, True
        return self

    def release(self) -> None:
        if not self.acquired:
            return
        self.acquired = False
        key = self.key
        RunLock._held[key] = RunLock._held.get(key, 1) - 1
        if RunLock._held[key] > 0:
            return
        del RunLock._held[key]
        path = Path(key)
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if isinstance(info, dict) and info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
            path.unlink(missing_ok=True)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
