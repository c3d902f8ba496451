"""Opening a run folder (--out) for a run: locked, checked, cleaned, recorded, before any work.

Rank 0 does the file work (under torchrun the other ranks share its outcome through one
all-reduce, so a refusal ends every rank at once instead of leaving them at a barrier).

A run that starts in a folder without a checkpoint records itself there first (RUN/run.json:
its config with absolute paths, its --init-from source, the checkpoint it resumes from, if
any), so a run killed before its first checkpoint is restarted by `--resume` as the same run
(train/request.py), not as whatever the resuming command's flags default to. The first
checkpoint replaces the record (train/checkpoint.py). A run refused at start-up puts back what
was there.

The lock (RunLock): one `fitgpt train` at a time per --out. RUN/run.lock holds the owner's pid,
host, start time and command line (JSON), and the owner holds an exclusive flock(2) on it for
as long as it runs. The kernel drops a flock when its
process ends in any way (exit, exception, Ctrl-C, kill -9), so a lock left by a dead run is free
and the next run takes it over with a note naming the old owner. On a filesystem without flock
support the pid in the file decides: a live pid on this host, or any pid on another host, holds.

With --node-local-checkpoints (machines that share no disk) every machine's first rank does
all of this in its own --out: each machine's folder has its own lock and its own run record,
and a second run on any one machine with the same --out is refused there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fitgpt.dist import DistContext
from fitgpt.engine.comm import all_ok
from fitgpt.errors import UserError
from fitgpt.procs import pid_alive
from fitgpt.train import checkpoint as ckpt_io

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
        lock = cls(path, fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
        except BaseException:  # a stop (or a write error) here: the lock file goes too
            lock.release()
            raise
        return lock

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


def check_overwritable(out: Path) -> None:
    """--overwrite empties --out: refused, before any work, on a folder of other files
    (paths.py check_replaceable), one with a run's files or the lock taken."""
    from fitgpt.paths import check_replaceable

    marks = (ckpt_io.RECORD_NAME, "metrics.jsonl", LOCK_NAME, "step_*", ".step_*")
    check_replaceable("--out", out, marks, "a run folder")


def _clear(out: Path) -> None:
    """--overwrite: everything in `out` goes except the lock this run holds (deleting the lock
    file would let a second run lock a new one while this one runs)."""
    for p in out.iterdir():
        if p.name == LOCK_NAME:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def read_record(out: Path) -> dict | None:
    """The run `out` records (RUN/run.json), or None when it holds none; a damaged record is
    refused in one line (restarting from a guess is what the record exists to prevent)."""
    path = out / ckpt_io.RECORD_NAME
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(
            f"{path}: unreadable ({str(e)[:100]}); delete it to start a new run in {out}, or "
            "pass the run's flags again without --resume"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise UserError(
            f"{path}: not a run record (no config); delete it to start a new run in {out}"
        )
    return record


def _put_record(out: Path, text: bytes | None) -> bytes | None:
    """RUN/run.json made `text` (renamed into place whole; None: removed); what it held."""
    path = out / ckpt_io.RECORD_NAME
    try:
        before = path.read_bytes()
    except FileNotFoundError:
        before = None
    if text is None:
        path.unlink(missing_ok=True)
        return before
    tmp = out / f".{ckpt_io.RECORD_NAME}.tmp"
    tmp.write_bytes(text)
    os.replace(tmp, path)
    return before


def _open(
    out: Path,
    resume: bool,
    overwrite: bool,
    note: Callable[[str], None],
    record: dict | None = None,
) -> RunLock:
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the run folder ({e.strerror})") from None
    try:
        lock = RunLock.acquire(out, note)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write its lock file ({e.strerror})") from None
    except BaseException:  # a stop in start-up: a folder created here goes (if still empty)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    lock.created = created  # a run that fails before writing anything leaves no folder
    try:
        existing = ckpt_io.step_dirs(out)
        if existing and not resume and not overwrite:
            raise UserError(
                f"{out} already holds checkpoints ({existing[-1].name}); pass --resume to "
                "continue, --overwrite to start over, or another --out"
            )
        if overwrite and not resume:
            _clear(out)
        ckpt_io.clean_stale(out)
        if record is not None and not ckpt_io.step_dirs(out):  # no checkpoint says what it is
            lock.record = (_put_record(out, json.dumps(record, indent=1).encode()),)
    except OSError as e:
        close_run_dir(out, lock, failed=True, started=False)
        raise UserError(f"--out {out}: {e.strerror} ({e.filename})") from None
    except BaseException:
        close_run_dir(out, lock, failed=True, started=False)
        raise
    return lock


def close_run_dir(out: Path, lock: RunLock | None, failed: bool, started: bool = True) -> None:
    """Release the lock; after a failure at start-up (`started` False: before the trainer was
    built), put back the record this run replaced (or remove the one it wrote), and remove the
    run folder if this run created it and wrote nothing else in it (a refusal at start-up leaves
    no folder behind). A run that failed once started keeps its record, for --resume."""
    if lock is None:
        return
    if failed and not started and lock.record is not None:
        with contextlib.suppress(OSError):
            _put_record(out, lock.record[0])
    lock.release()
    if failed and lock.created:
        with contextlib.suppress(OSError):  # not empty: something was written, keep it
            out.rmdir()


def open_run_dir(
    out: Path,
    resume: bool,
    overwrite: bool,
    ctx: DistContext,
    record: dict | None = None,
    per_node: bool = False,
) -> RunLock | None:
    """Lock `out` for this run (rank 0; `per_node`, node-local checkpoints: each machine's first
    rank, its own --out, so each machine's folder is locked, checked and cleaned on its disk),
    refuse to start over an existing run unless asked, remove what killed saves left behind,
    and, where no checkpoint says what the run is yet, write `record` (train/resume.py
    run_record). The caller releases the lock when the run ends (close_run_dir)."""
    lock, error = None, None
    if ckpt_io.leads_folder(ctx, per_node):
        try:
            lock = _open(out, resume, overwrite, lambda m: print(f"note: {m}", flush=True), record)
        except UserError as e:
            error = e
    try:
        opened = all_ok(ctx, error is None, "open the run folder")
    except BaseException:  # a stop or a dead rank in the agreement: the folder as it was
        close_run_dir(out, lock, failed=True, started=False)
        raise
    if not opened:
        close_run_dir(out, lock, failed=True, started=False)
        who = "a machine's first rank" if per_node else "rank 0"
        own = error is not None
        error = error or UserError(f"--out {out}: {who} could not open it (see its message)")
        error.agreed = True
        # a rank that failed prints its own line; the others' stand-in is rank 0's to print
        # (when rank 0 is one of them): the job's refusal is the failed rank's one line
        error.identical = not own
        raise error
    return lock


def write_run_files(out: Path, files: dict[str, str]) -> None:
    """Small text files kept with the run (deepspeed_notes.txt), each renamed into place whole."""
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        try:
            tmp.write_text(text)
            os.replace(tmp, out / name)
        except OSError as e:
            raise UserError(f"--out {out}: cannot write {name} ({e.strerror})") from None
