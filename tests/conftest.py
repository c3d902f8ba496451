"""Shared test helpers: real multi-process gloo groups on the CPU."""

from __future__ import annotations

import os
import socket
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fitgpt.dist.context import exit_process

# Keep two test processes from fighting over the two cores. The variable also tells fitgpt the
# count is the user's: a CPU run then never re-times it (dist/threads.py ThreadTuner), so the
# tests' losses do not depend on the machine's load.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The workers fork from one server process that imported these once per test session
# (multiprocessing's forkserver): a spawned worker imported torch and fitgpt itself, ~3 s of CPU
# each, for ~65 workers in the suite. The server runs nothing but imports, so no thread of torch
# is running when it forks (what makes fork after `import torch` unsafe).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "fitgpt.dist", "fitgpt.model",
           "fitgpt.engine.factory", "fitgpt.train.loop"]  # fmt: skip


def _worker(rank: int, world: int, port: int, env: dict, fn, args, errq) -> None:
    # the server's environment is the one it started with: this test's is the parent's now, as
    # a spawned worker's was
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    code = 1
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        code = 0
    except BaseException:
        errq.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # gloo's threads outlive the group and can abort the interpreter's teardown: exit as the
    # fitgpt command does (fitgpt.dist.context.exit_process)
    exit_process(code)


def run_gloo(world: int, fn, *args) -> None:
    """Run fn(rank, world, *args) in `world` real processes joined by gloo; re-raise failures.

    fn must be importable (a module-level function): the workers import its module.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call
    errq = ctx.SimpleQueue()
    port, env = free_port(), dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, env, fn, args, errq))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    for p in procs:
        if p.is_alive():
            p.kill()
            errors.append((-1, "a worker hung past 300 s"))
    if errors or any(p.exitcode for p in procs):
        msg = (
            "\n".join(f"rank {r}:\n{tb}" for r, tb in errors)
            or f"exit codes {[p.exitcode for p in procs]}"
        )
        pytest.fail(msg, pytrace=False)


@pytest.fixture
def gloo():
    return run_gloo


sys.path.insert(0, os.path.dirname(__file__))
