"""The run folder's lock: one `fitgpt train` at a time per --out.

RUN/run.lock holds the owner's pid, host, start time and command line (JSON), and the owner
holds an exclusive flock(2) on it for as long as it runs. The kernel drops a flock when its
process ends in any way (exit, exception, Ctrl-C, kill -9), so a lock left by a dead run is free
and the next run takes it over with a note naming the old owner. On a filesystem without flock
support the pid in the file decides: a live pid on this host, or any pid on another host, holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fitgpt.errors import UserError
from fitgpt.procs import pid_alive

LOCK_NAME = "run.lock"


def _owner(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        owner = json.loads(os.read(fd, 65536).decode("utf-8") or "{}")
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def describe(owner: dict) -> str:
    if not owner:
        return "an unknown owner"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return f"pid {owner.get('pid')} on {owner.get('host')}, started {started}"


class RunLock:
    """Held from acquire() until release() (or the end of the process)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd
        self.created = False  # whether the run that holds it created the run folder
        # (the run record it replaced, or None): set when this run wrote RUN/run.json
        self.record: tuple[bytes | None] | None = None

    @classmethod
    def acquire(cls, out: Path, note: Callable[[str], None]) -> RunLock:
        """Lock `out` (which must exist) or raise UserError naming the run that holds it."""
        path = out / LOCK_NAME
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                held = _flock(fd)
            except BaseException:
                os.close(fd)
                raise
            owner = _owner(fd)
            if held is False or (held is None and _held_by_pid(owner)):
                os.close(fd)
                raise UserError(
                    f"--out {out} is in use by another fitgpt run ({describe(owner)}); wait for "
                    f"it to end or stop it, or choose another --out (a stale lock: delete {path})"
                )
            # a releasing owner unlinks the file: the one we locked must still be the one there
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            os.close(fd)
        if owner:
            note(f"{path}: taking over the lock of {describe(owner)}, which is no longer running")
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": round(time.time(), 3),
            "command": sys.argv,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        return cls(path, fd)

    def release(self) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still held: a waiter that opened it re-checks the inode
        os.close(self.fd)  # drops the flock
        self.fd = -1


def _flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this filesystem has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP: some network filesystems
        return None


def _held_by_pid(owner: dict) -> bool:
    """Without flock, whether the recorded owner may still run (a pid on this host that lives,
    or any pid on another host, which cannot be checked from here)."""
    if not owner or owner.get("pid") == os.getpid():
        return False
    if owner.get("host") != socket.gethostname():
        return True
    return isinstance(owner.get("pid"), int) and pid_alive(owner["pid"])
