"""Running `fitgpt` on bad input and checking the refusal: exit 2, one stderr line naming the
input, no traceback, and no file left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitgpt.cli import main


def files(root: Path) -> set[str]:
    """Every file under `root` (relative paths): compared before and after a refused command."""
    return {str(p.relative_to(root)) for p in Path(root).rglob("*") if not p.is_dir()}


def run_in_process(capsys, *argv: str) -> tuple[int, str]:
    """(exit code, stderr) of `fitgpt ARGV` in this process (~0.1 s; the CLI's own code path)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    return e.value.code, capsys.readouterr().err


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `fitgpt ARGV` in this process: for a command whose files
    or output a test reads, where the process boundary is not the test (its start is ~3 s)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code or 0, out, err


def run_process(
    *argv: str, cwd: Path | None = None, timeout: float = 120, env: dict | None = None, **kw
):
    """`python -m fitgpt ARGV` in a new process (~3 s: the CLI imports torch at start), with
    `env`'s variables added to this one's."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "fitgpt", *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        **kw,
    )


def assert_refused(code: int, err: str, *names: str) -> str:
    """Exit 2 and exactly one non-blank stderr line, which names every one of `names`."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit {code}: {err}"
    assert "Traceback" not in err and len(lines) == 1, err
    for name in names:
        assert str(name) in lines[0], f"{name!r} not in: {lines[0]}"
    return lines[0]
