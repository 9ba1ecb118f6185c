"""The run-directory lock: one holder at a time, re-entrant in its process, stale holders detected."""

import json
import os
import socket

import pytest

from evollm.run.lock import RunLock, RunLocked


def _write(path, **info):
    path.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "since": 0, "command": "x",
                                **info}))


def test_the_lock_is_held_reentrantly_and_released(tmp_path):
    with RunLock(tmp_path / "run") as outer:
        info = json.loads(outer.path.read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
        with RunLock(tmp_path / "run" / "checkpoints"):  # inside a held directory: no second lock file
            assert not (tmp_path / "run" / "checkpoints" / ".lock").exists()
        assert outer.path.exists()
    assert not (tmp_path / "run" / ".lock").exists()


def test_live_other_host_and_reused_pid_holders(tmp_path):
    lock = tmp_path / ".lock"
    _write(lock)  # the parent process: alive
    with pytest.raises(RunLocked, match=f"in use by pid {os.getppid()} on host {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    _write(lock, host="elsewhere")  # another host: its pid cannot be checked from here, so it is respected
    with pytest.raises(RunLocked, match="on host elsewhere"):
        RunLock(tmp_path).acquire()
    _write(lock, start="1")  # the pid is alive but started at another time: reused, the holder is gone
    notes = []
    with RunLock(tmp_path, log=notes.append):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert len(notes) == 1 and "that process is gone" in notes[0]
    lock.write_text("{half")  # unreadable (not written by RunLock, which links a complete file into place)
    with RunLock(tmp_path, log=notes.append):
        pass
    assert "an unreadable lock file" in notes[-1]
