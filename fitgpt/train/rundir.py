"""Opening a run folder (--out) for a run: locked, checked, cleaned, recorded, before any work.

Rank 0 does the file work (under torchrun the other ranks share its outcome through one
all-reduce, so a refusal ends every rank at once instead of leaving them at a barrier).

A run that starts in a folder without a checkpoint records itself there first (RUN/run.json:
its config with absolute paths, its --init-from source, the checkpoint it resumes from, if
any), so a run killed before its first checkpoint is restarted by `--resume` as the same run
(cli/train.py), not as whatever the resuming command's flags default to. The first checkpoint
replaces the record (train/checkpoint.py). A run refused at start-up puts back what was there.
"""

from __future__ import annotations

import contextlib
import json
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
        lock.release()
        raise UserError(f"--out {out}: {e.strerror} ({e.filename})") from None
    except BaseException:
        lock.release()
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
    out: Path, resume: bool, overwrite: bool, ctx: DistContext, record: dict | None = None
) -> RunLock | None:
    """Lock `out` for this run (rank 0), refuse to start over an existing run unless asked,
    remove what killed saves left behind, and, where no checkpoint says what the run is yet,
    write `record` (train/resume.py run_record). The caller releases the lock when the run
    ends (close_run_dir)."""
    lock, error = None, None
    if ctx.is_main:
        try:
            lock = _open(out, resume, overwrite, lambda m: print(f"note: {m}", flush=True), record)
        except UserError as e:
            error = e
    if not all_ok(ctx, error is None, "open the run folder"):
        close_run_dir(out, lock, failed=True, started=False)
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
