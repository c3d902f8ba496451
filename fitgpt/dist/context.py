"""The distributed context: an explicit object passed to whatever communicates (no globals).

Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR set) `init_distributed` joins the job's
process group: NCCL on GPUs, gloo on CPUs. Without torchrun it returns a one-process context.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fitgpt.dist.mesh import (
    ContextGroup,
    ExpertGroups,
    Mesh,
    build_context_group,
    build_expert_groups,
    build_mesh,
)
from fitgpt.errors import UserError, print_line

# A collective that waits longer than this ends the job with the rank and operation named,
# instead of hanging forever. Long enough for checkpoint writes and first-step compilation.
DEFAULT_TIMEOUT_S = 600.0


@dataclass
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None = None  # None: a single process, nothing to communicate
    # --tensor-parallel T > 1: the TP × DP layout (dist/mesh.py); None: every rank is
    # data-parallel, and the dp_* properties below are the whole job's
    mesh: Mesh | None = None
    # --context-parallel C > 1: this rank's CP group (dist/mesh.py ContextGroup); its C ranks
    # are data-parallel ranks for the engines (dp_*), and one data rank for the loader (data_*)
    cp: ContextGroup | None = None
    # --expert-parallel P > 1: this rank's EP and expert-replica groups (dist/mesh.py
    # ExpertGroups); every rank stays data-parallel for the dense parts and the data
    ep: ExpertGroups | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tp(self) -> int:
        return self.mesh.tp if self.mesh is not None else 1

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that take different micro-batches."""
        return self.mesh.dp_rank if self.mesh is not None else self.rank

    @property
    def dp_world(self) -> int:
        return self.mesh.dp if self.mesh is not None else self.world

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.dp_group if self.mesh is not None else self.group

    @property
    def cp_size(self) -> int:
        return self.cp.size if self.cp is not None else 1

    @property
    def data_rank(self) -> int:
        """Which rows this rank reads: the ranks of one CP group read the same rows (each
        keeps its slice of their tokens), as the ranks of one TP group do."""
        return self.dp_rank // self.cp_size

    @property
    def data_world(self) -> int:
        """How many ranks read different rows (dp_world / C)."""
        return self.dp_world // self.cp_size

    def with_context_parallel(self, cp: int) -> DistContext:
        """This context with C-rank context-parallel groups (collective: every rank calls it).
        C = 1, or a context that has them already, is returned as it is."""
        if cp == self.cp_size:
            return self
        if self.cp is not None:
            raise ValueError(f"this context is laid out for C={self.cp_size}, not {cp}")
        group = build_context_group(self.rank, self.world, cp, self.tp)  # after the TP layout
        return dataclasses.replace(self, cp=group)

    def with_tensor_parallel(self, tp: int) -> DistContext:
        """This context with a T-rank tensor-parallel layout (collective: every rank calls it).
        T = 1, or a context that has this layout already, is returned as it is."""
        if tp == self.tp:
            return self
        if self.mesh is not None:
            raise ValueError(f"this context is laid out for T={self.tp}, not {tp}")
        return dataclasses.replace(self, mesh=build_mesh(self.rank, self.world, tp))

    @property
    def ep_size(self) -> int:
        return self.ep.size if self.ep is not None else 1

    def with_expert_parallel(self, ep: int) -> DistContext:
        """This context with P-rank expert-parallel groups (collective: every rank calls it).
        P = 1, or a context that has them already, is returned as it is."""
        if ep == self.ep_size:
            return self
        if self.ep is not None:
            raise ValueError(f"this context is laid out for P={self.ep_size}, not {ep}")
        return dataclasses.replace(self, ep=build_expert_groups(self.rank, self.world, ep))

    def laid_out(self, tp: int, cp: int, ep: int = 1) -> DistContext:
        """This context with a run's mesh: T-rank tensor-parallel groups, then C-rank
        context-parallel groups, then P-rank expert-parallel groups (collective: every rank
        calls it). A run's is laid out once, by train/assemble.py; the trainer and the engines
        take it as given."""
        return self.with_tensor_parallel(tp).with_context_parallel(cp).with_expert_parallel(ep)

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


def device_type(device: str) -> str:
    """ "cuda" or "cpu": where `--device` (auto, cuda, cuda:N, cpu) puts the compute, decided
    here for pick_device and for everything that settles a run before CUDA starts (the planner,
    train/request.py), without starting CUDA."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def pick_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    if device == "auto":
        device = device_type(device)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        dev = torch.device("cuda", local_rank if device == "cuda" else torch.device(device).index)
        torch.cuda.set_device(dev)
        return dev
    if device != "cpu":
        raise UserError(f"--device {device!r}: use auto, cpu or cuda")
    return torch.device("cpu")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the torchrun job if there is one, else a single-process context."""
    if not under_torchrun():
        return DistContext(0, 1, 0, pick_device(device, 0), None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device, local_rank)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistContext(rank, world, local_rank, dev, dist.group.WORLD)


def shutdown(ctx: DistContext) -> None:
    if ctx.group is not None and dist.is_initialized():
        dist.destroy_process_group()


def gloo_threads_alive() -> bool:
    """Whether gloo's worker threads still run in this process (Linux: read from /proc)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for t in tasks:
        with contextlib.suppress(OSError), open(f"/proc/self/task/{t}/comm") as f:
            if f.read().startswith(("pt_gloo_runloop", "gloo_tcp_loop")):
                return True
    return False


def exit_process(code) -> None:
    """End this process with `code` (as sys.exit takes it).

    A gloo group outlives destroy_process_group() while torch still holds it, and its worker
    threads may still be releasing the tensors of the last collective when the interpreter
    tears down: they need the GIL of a dying interpreter and the process aborts ("terminate
    called without an active exception", signal 6; issue 33: one 2-process CPU run in 6-8 on
    a loaded 2-core box, a core file showing a gloo worker freeing an all-reduce inside
    Py_FinalizeEx). Where those threads run, the exit skips the teardown: the atexit handlers
    run (the host optimizer's worker stops, the disk tier's files go), the streams are
    flushed, then os._exit. Elsewhere it is a plain sys.exit."""
    if not gloo_threads_alive():
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # sys.exit("message") prints it, exits 1
        with contextlib.suppress(Exception):
            print_line(str(code))
        code = 1
    hard_exit(code or 0)


def hard_exit(code: int) -> None:
    """End the process now: the atexit handlers run (the host optimizer's worker stops, the disk
    tier's files go), the streams are flushed, then os._exit, skipping the interpreter's and the
    process group's teardown."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def decided_on_rank0(ctx: DistContext, decide):
    """decide() run on rank 0 alone and its result broadcast, so every rank of a job (also of
    several machines, whose free memory differs) goes on with the same decision; an exception
    raised there is raised on every rank (a UserError marked as every rank's, said once)."""
    from fitgpt.errors import UserError

    decision = [None]
    if ctx.is_main:
        try:
            decision[0] = (decide(), None)
        except Exception as e:  # a refusal must reach every rank, not only rank 0
            decision[0] = (None, e)
    if ctx.distributed:
        dist.broadcast_object_list(decision, src=0, group=ctx.group)
    value, err = decision[0]
    if err is not None:
        if isinstance(err, UserError):
            err.agreed = err.identical = ctx.distributed  # every rank raises rank 0's here
        raise err
    return value
