"""The process environment of a run, set up the same way whoever starts it.

A run can be started by `fitgpt train`, by `fitgpt train --gpus N` (our launcher), by a user's own
`torchrun ... -m fitgpt train`, or by the benchmark harness. Whatever makes one of them fast or
safe must hold for all of them, so it lives here, in two halves:

- `child_env(nproc)`: what a launcher puts in the environment of the processes it starts.
- `configure_process(cpu_threads)`: what every training process sets for itself before CUDA,
  NCCL or the first parallel CPU kernel initialises, so a user's own torchrun launch gets it too.

Host threads matter for the offloaded optimizer: torchrun sets OMP_NUM_THREADS=1 in every rank
it starts, which leaves the host AdamW of each rank on one core (measured on 2×H200 at 20 B:
14.4 s per step against 6.2 s with the cores shared out).
"""

from __future__ import annotations

import os

import torch

from fitgpt.dist.threads import ThreadTuner, busy_cores, cores_available, cpu_threads

# NVLink multicast (NVLS, symmetric-memory multicast) stays off: on shared GPU hosts a program
# that uses it can take the GPUs out of service. The collectives fitgpt issues barely use it.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Expandable segments let the caching allocator grow blocks in place, which cuts the reserved-
# but-unused memory that makes a run near the GPU's limit fail; the memory model's fragmentation
# margin (plan/memory.py) was measured with it on.
ALLOC_CONF = "expandable_segments:True"


def local_ranks() -> int:
    """Processes of this job on this machine (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def threads_per_rank(requested: int = 0, device_type: str = "cuda") -> int:
    """Torch's intra-op threads for one rank: `requested` if given; else OMP_NUM_THREADS when a
    user set it outside torchrun (inside torchrun it may be torchrun's own 1); else this machine's
    cores shared out between its ranks."""
    if requested > 0:
        return requested
    user = _user_threads()
    if user:
        return user
    if device_type == "cpu":  # CPU compute: the cores other programs leave idle (threads.py)
        return cpu_threads(local_ranks(), busy_cores())
    return max(1, cores_available() // local_ranks())


def _user_threads() -> int:
    """OMP_NUM_THREADS as a user set it outside torchrun (inside, it may be torchrun's own 1);
    0 if not set."""
    user = os.environ.get("OMP_NUM_THREADS", "")
    if user.isdigit() and int(user) > 0 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return int(user)
    return 0


def thread_tuner(requested: int, device_type: str):
    """The ThreadTuner of a run whose process configure_process set up: it re-times the thread
    count while a CPU run trains, where fitgpt chose the count (no --cpu-threads, no user
    OMP_NUM_THREADS); otherwise it never changes anything."""
    active = device_type == "cpu" and requested <= 0 and not _user_threads()
    most = max(1, cores_available() // local_ranks())
    return ThreadTuner(torch.get_num_threads(), most, active)


def child_env(nproc: int) -> dict[str, str]:
    """The environment for `nproc` processes a fitgpt launcher starts on this machine."""
    env = dict(os.environ)
    for k, v in {**SAFE_ENV, "PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF}.items():
        env.setdefault(k, v)
    # without it torchrun would put 1 here; the child sizes itself again in configure_process
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores_available() // max(1, nproc))))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def configure_process(cpu_threads: int = 0, device: str = "auto") -> int:
    """Set this process up for training on `device` (auto, cpu, cuda); call before the first
    CUDA allocation or collective. Returns the number of torch threads it chose."""
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)  # read by NCCL when the process group starts
    # read by the CUDA caching allocator at its first allocation, not at import
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    threads = threads_per_rank(cpu_threads, "cuda" if gpu else "cpu")
    # New threads (the host optimizer's worker) take this value at their first parallel kernel.
    torch.set_num_threads(threads)
    return threads
