"""`--gpus N`: start torchrun's launcher on this machine with the same command minus --gpus.

The one launcher of fitgpt: `train`, `probe`, `matmul`, the benchmark harness and the capacity
search all start their processes here, with the environment of `fitgpt.dist.env.child_env`.

For several machines, `fitgpt train --gpus G --nnodes N --node-rank R --master-addr A
--master-port P` on each starts torchrun's static rendezvous (dist/nodes.py); a user's own
`torchrun ... -m fitgpt train ...` works too: fitgpt joins whatever job torchrun sets up, and
every process sets itself up the same way (`fitgpt.dist.env.configure_process`).
"""

from __future__ import annotations

import subprocess
import sys

from fitgpt.dist.env import SAFE_ENV, child_env
from fitgpt.dist.nodes import Nodes

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


def command(
    nproc: int,
    module: str,
    argv: list[str],
    torchrun: bool | None = None,
    nodes: Nodes | None = None,
) -> list[str]:
    """`python -m module argv` under torchrun with `nproc` processes on this machine (by default
    only when nproc > 1: one process needs no rendezvous), this machine one of `nodes`."""
    if not (nproc > 1 if torchrun is None else torchrun):
        return [sys.executable, "-m", module, *argv]
    return [
        sys.executable,
        "-m",
        "fitgpt.dist.torchrun",  # torchrun, minus its traceback after a refusal
        *(nodes or Nodes()).torchrun_args(nproc),
        "-m",
        module,
        *argv,
    ]


def relaunch(
    nproc: int,
    argv: list[str],
    module: str = "fitgpt",
    env: dict[str, str] | None = None,
    nodes: Nodes | None = None,
) -> int:
    """Run `python -m fitgpt <argv>` under torchrun with nproc processes on this machine (one of
    `nodes`), `env` added to their environment (train's settled settings: cli/train.py launch);
    return its exit code."""
    cmd = command(nproc, module, argv, torchrun=True, nodes=nodes)
    return subprocess.call(cmd, env={**child_env(nproc), **(env or {})})
