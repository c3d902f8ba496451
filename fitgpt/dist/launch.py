"""`--gpus N`: start torchrun's launcher on this machine with the same command minus --gpus.

For several machines, run `torchrun --nnodes M --node-rank i --rdzv-endpoint HOST:PORT ...
-m fitgpt train ...` on each machine instead; fitgpt joins whatever job torchrun sets up.
"""

from __future__ import annotations

import os
import subprocess
import sys

# NVLink multicast (NVLS) is kept off: on shared hosts a program using it can take the GPUs
# out of service. It costs little for the collectives fitgpt issues.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


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


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run `python -m fitgpt <argv>` under torchrun with nproc processes; return its exit code."""
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in SAFE_ENV.items()}}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--standalone",
        "-m",
        "fitgpt",
        *argv,
    ]
    return subprocess.call(cmd, env=env)
