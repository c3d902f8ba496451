"""Opening a run folder (--out) for a run: locked, checked, cleaned, before any work.

Rank 0 does the file work (under torchrun the other ranks share its outcome through one
all-reduce, so a refusal ends every rank at once instead of leaving them at a barrier).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.consensus import all_ok
from fitgpt.train.lock import LOCK_NAME, RunLock


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


def _open(out: Path, resume: bool, overwrite: bool, note: Callable[[str], None]) -> RunLock:
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the run folder ({e.strerror})") from None
    try:
        lock = RunLock.acquire(out, note)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write its lock file ({e.strerror})") from None
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
    except OSError as e:
        lock.release()
        raise UserError(f"--out {out}: {e.strerror} ({e.filename})") from None
    except BaseException:
        lock.release()
        raise
    return lock


def close_run_dir(out: Path, lock: RunLock | None, failed: bool) -> None:
    """Release the lock; after a failure, remove the run folder if this run created it and
    wrote nothing in it (a refusal at start-up leaves no empty folder behind)."""
    if lock is None:
        return
    lock.release()
    if failed and lock.created:
        with contextlib.suppress(OSError):  # not empty: something was written, keep it
            out.rmdir()


def open_run_dir(out: Path, resume: bool, overwrite: bool, ctx: DistContext) -> RunLock | None:
    """Lock `out` for this run (rank 0), refuse to start over an existing run unless asked, and
    remove what killed saves left behind. The caller releases the lock when the run ends."""
    lock, error = None, None
    if ctx.is_main:
        try:
            lock = _open(out, resume, overwrite, lambda m: print(f"note: {m}", flush=True))
        except UserError as e:
            error = e
    if not all_ok(ctx, error is None, "open the run folder"):
        close_run_dir(out, lock, failed=True)
        error = error or UserError(f"--out {out}: rank 0 could not open it (see its message)")
        error.agreed = True
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
