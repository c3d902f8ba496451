"""Paths checked before the work: outputs writable, inputs readable; OS errors told in one line.

It sits beside errors.py at the bottom of the layers: the CLI checks every command's paths with
it, and so do the configs below the CLI that name files (data/config.py, matmul/).

Every command that writes calls `check_writable_file` / `check_writable_dir` on its outputs
before any expensive work (a 20 s probe, a capacity trial, a matrix product), so a typo in a
path costs nothing. The check writes a probe file in the nearest existing folder of the path
and removes it: `os.access` says yes to root on paths root cannot write either (/proc, a
read-only mount), and the real write is the only test that is never wrong. It creates no
folder: a command that fails later leaves nothing behind.

`describe_os_error` is what the CLI's top level prints for an OSError that escaped a command:
one line naming the path and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

from fitgpt.errors import UserError


def _name(flag: str, path: str | Path) -> str:
    """How an error names the input: `--out runs/x`, or the bare path for a positional one."""
    return f"{flag} {path}" if flag else str(path)


def _why(e: OSError) -> str:
    return (e.strerror or str(e)).lower()


def _nearest_existing(path: Path) -> Path:
    """`path` itself or its closest ancestor that exists (a file or a folder)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe_write(folder: Path, flag: str, path: str | Path) -> None:
    """Create and remove a file in `folder`; a UserError naming `flag path` if that fails."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".fitgpt-write-check-")
    except OSError as e:
        raise UserError(
            f"{_name(flag, path)}: cannot write in {folder} ({_why(e)}); "
            "choose a location you can write"
        ) from None
    os.close(fd)
    os.unlink(name)


def _check_ancestors(path: Path, flag: str, shown: str | Path) -> None:
    """The folders above `path` exist or can be made, and the nearest existing one is writable."""
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise UserError(
            f"{_name(flag, shown)}: {base} is a file, not a folder; choose a path inside a folder"
        )
    _probe_write(base, flag, shown)


def check_writable_file(path: str | Path, flag: str) -> Path:
    """Refuse an output file that could not be written: a folder at the path, a file where a
    folder of the path should be, no permission. Its missing folders are allowed (the command
    creates them); nothing is created here."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{_name(flag, path)}: is a folder; name a file (inside it, or elsewhere)")
    if str(path).endswith(os.sep):
        raise UserError(f"{_name(flag, path)}: ends in {os.sep}; name a file, not a folder")
    _check_ancestors(p, flag, path)
    if p.exists():
        try:
            with open(p, "ab"):  # opens for writing, changes nothing
                pass
        except OSError as e:
            raise UserError(
                f"{_name(flag, path)}: cannot be written ({_why(e)}); choose another path"
            ) from None
    return p


def check_writable_dir(path: str | Path, flag: str) -> Path:
    """Refuse an output folder that could not be filled: a file at the path or above it, no
    permission. A missing folder is allowed (the command creates it); nothing is created here."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{_name(flag, path)}: is a file, not a folder; name a folder")
    if p.is_dir():
        _probe_write(p, flag, path)
    else:
        _check_ancestors(p, flag, path)
    return p


# How an output lies against a path the user keeps: the words of the refusal.
_PLACED = {"is": "is", "inside": "lies inside", "holds": "holds"}


def overlap(path: str | Path, other: str | Path) -> str | None:
    """How `path` lies against `other`, both resolved as the kernel will (symlinks, `..`,
    relative parts, trailing slashes; the parts that do not exist yet are taken as written):
    "is" (the same path), "inside" (`path` lies under `other`), "holds" (`other` lies under
    `path`), or None (apart). The one place fitgpt decides whether writing to, or deleting,
    `path` can touch `other` (export's and train's --out against what the user keeps)."""
    a, b = os.path.realpath(path), os.path.realpath(other)
    if a == b:
        return "is"
    if a.startswith(b.rstrip(os.sep) + os.sep):
        return "inside"
    if b.startswith(a.rstrip(os.sep) + os.sep):
        return "holds"
    return None


def check_apart(flag: str, path: str | Path, kept: list[tuple[str, str | Path]], why: str) -> None:
    """Refuse, in one line, an output `path` that is, lies inside or holds one of `kept`
    ((what it is, its path): the run an export reads, the model a run starts from), before any
    work: writing there would change or delete it. `why` says what the command would do to it."""
    for what, keep in kept:
        placed = overlap(path, keep)
        if placed is not None:
            raise UserError(
                f"{flag} {path} {_PLACED[placed]} {what} ({keep}): {why}; choose an {flag} "
                "apart from it"
            )


def check_replaceable(flag: str, out: str | Path, marks: tuple[str, ...], what: str) -> None:
    """Refuse, before any work, --overwrite of a folder `out` that holds files but none that
    `marks` (glob patterns: what this command writes) match: --overwrite replaces or empties
    `out` whole, and `--out . --overwrite` in a project folder, or a typo naming a folder of
    one's own, would delete it all. No folder, an empty one or one this command wrote is
    taken. `what` names such a folder in the line ("a run folder")."""
    out = Path(out)
    if not out.is_dir():
        return
    names = sorted(p.name for p in out.iterdir())
    if not names or any(any(out.glob(m)) for m in marks):
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise UserError(
        f"{flag} {out} is not {what} (it holds {shown}; no {', '.join(marks)}) and --overwrite "
        f"would delete everything in it; name a new or empty folder, or {what}"
    )


def check_readable_file(
    path: str | Path, flag: str, what: str, *, allow_empty: bool = False
) -> Path:
    """An input file that exists, is a file, and (unless `allow_empty`) is not empty; `what` says
    what to pass instead. A folder is named as one: "does not exist" sends the user looking for
    a typo in a path that is there."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{_name(flag, path)}: is a folder; give a file ({what})")
    if not p.is_file():
        raise UserError(f"{_name(flag, path)}: no such file; pass {what}")
    if not allow_empty and p.stat().st_size == 0:
        raise UserError(f"{_name(flag, path)}: the file is empty; pass {what}")
    return p


def check_input_prefix(prefix: str, flag: str) -> None:
    """An input PREFIX of a .bin/.idx pair that is a folder is refused as one, naming a pair
    inside it when there is one (what the user most likely meant). Anything else is left to
    the reader of the pair, which says which file is missing or damaged."""
    p = Path(prefix)
    stem, suffix = os.path.splitext(prefix)
    pair = Path(stem + ".bin").is_file() and Path(stem + ".idx").is_file()
    if suffix in (".bin", ".idx") and pair and not Path(prefix + ".bin").is_file():
        raise UserError(  # a file of the pair, as a shell's tab completion gives it
            f"{_name(flag, prefix)}: names a file of the pair; give its prefix, {stem} (the "
            f"path without {suffix})"
        )
    if not p.is_dir() or Path(prefix + ".bin").is_file():
        return
    pairs = sorted(i.with_suffix("") for i in p.glob("*.idx") if i.with_suffix(".bin").is_file())
    example = str(pairs[0]) if pairs else str(p / "corpus_text_document")
    raise UserError(
        f"{_name(flag, prefix)}: is a folder; give the prefix of a .bin/.idx pair (the path "
        f"without .bin), e.g. {example}"
    )


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(_nearest_existing(path)).free
    except OSError:
        return None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _output_of(path: str, outputs: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The (flag, value) whose path `path` is, lies under, or lies on the way to (a temporary
    file beside a prefix, the hidden folder an output is built in before its rename, e.g.
    export's `.OUT.export.tmp`, a file standing where its folder should be)."""
    p = os.path.abspath(path)
    for flag, value in outputs:
        if not value:
            continue
        v = os.path.abspath(value)
        hidden = os.path.join(os.path.dirname(v), "." + os.path.basename(v) + ".")
        if p == v or p.startswith(v) or p.startswith(hidden) or v.startswith(p + os.sep):
            return flag, value
    return None


def describe_os_error(e: OSError, outputs: list[tuple[str, str]]) -> str | None:
    """One line for an OSError a command let escape; None when it is not about a path (then it
    is a bug, and keeps its traceback). `outputs` are the command's output flags and values,
    named when the error carries no path itself (a write() on a full disk has none)."""
    path = str(e.filename) if e.filename is not None else None
    if e.errno in (errno.ENOSPC, errno.EDQUOT) and e.filename2 is not None:
        # a copy that fills the disk names both files (shutil.copyfile: the source first); the
        # disk that is full is the one written, the second
        path = str(e.filename2)
    where = path or (" ".join(outputs[0]).strip() if outputs else None)
    flag = _output_of(path, outputs) if path else None
    if flag is not None:  # the path belongs to an output the user named: name the flag too
        where = f"{' '.join(flag)}: {path}" if path != flag[1] else " ".join(flag)
    if isinstance(e, BrokenPipeError):
        return None  # the caller ends quietly
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on the disk" if e.errno == errno.ENOSPC else "disk quota exceeded"
        parts = [f"{where}: {what}" if where else what]
        needed = getattr(e, "needed_bytes", None)  # set by code that knows the size it wrote
        if needed:
            parts.append(f"needed {_size(needed)}")
        disk = path or (outputs[0][1] if outputs and outputs[0][1] else None)
        free = _free_bytes(Path(disk)) if disk else None
        if free is not None:
            parts.append(f"{_size(free)} free")
        return ", ".join(parts) + "; free some space or write to another disk"
    if path is None:
        return None  # not about a path: a bug, or something this line could not explain
    if e.errno == errno.EROFS:
        return f"{where}: the file system is read-only; choose a location on a writable disk"
    if isinstance(e, PermissionError):
        return f"{where}: permission denied; choose a path you may use, or fix its permissions"
    if isinstance(e, IsADirectoryError):
        return f"{where}: is a folder where a file is expected; name a file"
    if isinstance(e, NotADirectoryError):
        return f"{where}: part of this path is a file, not a folder; fix the path"
    if isinstance(e, FileExistsError):
        return f"{where}: already exists, as a file where a folder must go; choose another path"
    if isinstance(e, FileNotFoundError):
        return f"{where}: no such file or folder; check the path (create the folder first)"
    return f"{where}: {_why(e)}; check the path"


@contextlib.contextmanager
def folder_in_place(out: Path, what: str):
    """A fresh folder beside `out` (`.NAME.WHAT.tmp`; a crashed run's leftovers, never valid,
    are removed first) that becomes `out` once the body returns: an old `out` (--overwrite) is
    moved aside first and deleted after, so a failure at any point leaves what was there, and
    the temporary folder goes whatever happens. The one way an export or an import writes a
    folder."""
    tmp = out.parent / f".{out.name}.{what}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                _as_umask_says(f)
        old = out.parent / f".{out.name}.{what}.old"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def file_in_place(out: Path, what: str):
    """A temporary name beside `out` (`.NAME.WHAT.tmp`) that becomes `out` once the body
    returns, and is removed whatever else happens: a write that fails (a full disk, Ctrl-C)
    leaves `out` as it was and nothing beside it. folder_in_place's one-file twin."""
    tmp = out.parent / f".{out.name}.{what}.tmp"
    try:
        yield tmp
        _as_umask_says(tmp)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _as_umask_says(f: Path) -> None:
    """Give a written file the mode the user's umask gives new files (0644 under 022).
    safetensors 0.8 creates its files 0600, so an export another account serves (an inference
    server's user) could not be read, which transformers' own save_pretrained shares. One
    chmod a file."""
    mask = os.umask(0)  # the one way to read it; set straight back (no threads write here)
    os.umask(mask)
    os.chmod(f, 0o666 & ~mask)
