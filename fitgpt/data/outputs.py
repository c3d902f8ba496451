"""Output locations, checked before any work: one line naming the path, not a traceback after
minutes of tokenizing.

A check creates nothing that stays: writability is tested by creating and removing a probe file
in the nearest existing directory (a permission test that also holds for root and read-only
mounts, where os.access does not).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fitgpt.data.indexed import SIDECAR_SUFFIX
from fitgpt.errors import UserError

PAIR_SUFFIXES = (".bin", ".idx", SIDECAR_SUFFIX)


def check_prefix(prefix: str, flag: str = "--output-prefix") -> None:
    """PREFIX.bin/.idx/.fitgpt.json can be written: the prefix names files, not a directory."""
    if not prefix or prefix.endswith(("/", os.sep)) or Path(prefix).name in ("", ".", ".."):
        raise UserError(
            f"{flag} {prefix!r} ends in a directory; a prefix needs a file name, "
            f"e.g. {flag} {prefix.rstrip('/' + os.sep) or '.'}/corpus"
        )
    if Path(prefix).is_dir():
        raise UserError(
            f"{flag} {prefix} is a directory; a prefix needs a file name, e.g. {flag} {prefix}/corpus"
        )
    for suffix in PAIR_SUFFIXES:
        if Path(prefix + suffix).is_dir():
            raise UserError(
                f"{flag} {prefix}: {prefix}{suffix} is a directory; pick another prefix"
            )
    _check_writable(Path(prefix).parent, flag, prefix)


def check_dir(directory: str, flag: str, files: tuple[str, ...] = ()) -> None:
    """`directory` is or can become a writable directory, and `files` in it are not directories."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise UserError(f"{flag} {directory} is a file, not a directory; pick a directory")
    for name in files:
        if (d / name).is_dir():
            raise UserError(f"{flag} {directory}: {d / name} is a directory; remove it")
    _check_writable(d, flag, directory)


def _check_writable(directory: Path, flag: str, shown: str) -> None:
    existing = directory if str(directory) else Path(".")
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # created by the writer later (mkdir -p)
    if not existing.is_dir():
        raise UserError(f"{flag} {shown}: {existing} is a file, not a directory; pick another path")
    try:
        # an unnamed file (O_TMPFILE where the filesystem has it, else one unlinked as it is
        # made): a Ctrl-C here leaves nothing in the user's folder, where a named probe stayed
        with tempfile.TemporaryFile(prefix=".fitgpt-probe-", dir=existing):
            pass
    except OSError as e:
        raise UserError(
            f"{flag} {shown}: cannot write in {existing} ({e.strerror or e}); pick a writable place"
        ) from e
