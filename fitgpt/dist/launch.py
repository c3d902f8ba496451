"""`--gpus N`: start torchrun's launcher on this machine with the same command minus --gpus.

The one launcher of fitgpt: `train`, `probe`, `matmul`, the benchmark harness and the capacity
search all start their processes here, with the environment of `fitgpt.dist.env.child_env`.

For several machines, run `torchrun --nnodes M --node-rank i --rdzv-endpoint HOST:PORT ...
-m fitgpt train ...` on each machine instead; fitgpt joins whatever job torchrun sets up, and
every process sets itself up the same way (`fitgpt.dist.env.configure_process`).
"""

from __future__ import annotations

import subprocess
import sys

from fitgpt.dist.env import SAFE_ENV, child_env

__all__ = ["SAFE_ENV", "command", "relaunch", "strip_flag"]


def strip_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def command(nproc: int, module: str, argv: list[str], torchrun: bool | None = None) -> list[str]:
    """`python -m module argv` under torchrun with `nproc` processes on this machine (by default
    only when nproc > 1: one process needs no rendezvous)."""
    if not (nproc > 1 if torchrun is None else torchrun):
        return [sys.executable, "-m", module, *argv]
    return [
        sys.executable,
        "-m",
        "fitgpt.dist.torchrun",  # torchrun, minus its traceback after a refusal
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *argv,
    ]


def relaunch(
    nproc: int, argv: list[str], module: str = "fitgpt", env: dict[str, str] | None = None
) -> int:
    """Run `python -m fitgpt <argv>` under torchrun with nproc processes, `env` added to their
    environment (train's settled settings: cli/train.py launch); return its exit code."""
    cmd = command(nproc, module, argv, torchrun=True)
    return subprocess.call(cmd, env={**child_env(nproc), **(env or {})})
