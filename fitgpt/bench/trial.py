"""One benchmark trial: one system, one model size, in its own process (or torchrun job).

Run by the sweep as `python -m fitgpt.bench.trial SPEC.json RESULT.json`. Each rank writes
RESULT.json.rank{r}; the sweep merges them. Timing: warm-up steps, then the median of the timed
optimizer steps, each ending in a device synchronisation. Memory: torch.cuda.max_memory_allocated
(max over ranks) and the process's peak RSS (max over ranks, and their sum).

Rank 0 prints `PROGRESS` lines as it builds and steps (`fitgpt capacity` shows them while a
trial runs: a CPU trial of a large model takes minutes). The trial's run folder is a temporary
folder beside RESULT.json, removed when it ends; the trial dies with the process that started
it, even one killed by SIGKILL (fitgpt/procs.py die_with_parent), so neither outlives its sweep.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from fitgpt.bench.config import BenchConfig
from fitgpt.bench.systems import get_system
from fitgpt.data.source import BatchLoader
from fitgpt.data.synthetic import UniformSource
from fitgpt.dist import init_distributed
from fitgpt.dist.env import configure_process
from fitgpt.errors import UserError
from fitgpt.plan.fixed import Fixed
from fitgpt.plan.memory import tokens_per_step
from fitgpt.procs import die_with_parent
from fitgpt.train.metrics import peak_flops
from fitgpt.train.setup import OutOfMemory


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def versions() -> dict:
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
    }
    try:
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
    except Exception:
        pass
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


class OverCap(MemoryError):
    """The trial held more than the memory cap it was given (capacity searches under a budget)."""


def apply_cap(cap: int, device: torch.device) -> None:
    """A real allocator cap on GPUs: allocations past `cap` bytes raise CUDA OOM."""
    if cap and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)


def check_cap(cap: int, runner, device: torch.device) -> None:
    """On CPUs, the cap applies to the bytes of state the engine reports holding."""
    if cap and device.type == "cpu" and hasattr(runner, "engine"):
        held = sum(v for kinds in runner.engine.memory_report().values() for v in kinds.values())
        if held > cap:
            raise OverCap(f"the engine holds {held:,} bytes of state, over the cap of {cap:,}")


def classify(exc: BaseException) -> tuple[str, str]:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    if isinstance(exc, OverCap):
        return "oom-cap", text
    if isinstance(exc, OutOfMemory):
        return f"oom-{exc.where}", text
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in str(exc):
        return "oom-gpu", text
    if isinstance(exc, MemoryError) or "host RAM" in str(exc):
        return "oom-host", text
    if isinstance(exc, UserError):
        return "refused", text
    return "error", text


def compile_record(engine) -> dict:
    """`compiled` (whether regions ran compiled) and, if so, `compile_s` and dynamo's counts
    (engine/transforms/compile.py). The compile happens in the first step, a warm-up step unless
    --warmup 0: step_s is then the steady-state speed and compile_s the one-off cost."""
    report = engine.compile_report() if hasattr(engine, "compile_report") else None
    if not report or not report["regions"]:
        return {"compiled": False}
    return {
        "compiled": True,
        "compile_s": report["compile_s"],
        "compile_regions": report["regions"],
        "compile_eager": report["eager"],  # regions that failed to compile and ran eagerly
        "compile_graph_breaks": report["graph_breaks"],
        "compile_recompiles": report["recompiles"],
    }


# The start of the lines a trial prints for its parent to show (cli/capacity.py forwards them),
# and the longest silence between two of them while steps run (a step line is printed at the
# first step, the last, and when this long has passed since the last line).
PROGRESS = "trial progress: "
PROGRESS_EVERY_S = 20.0


class Progress:
    """Rank 0's progress lines: building, then steps (not every one of a fast trial)."""

    def __init__(self, show: bool, steps: int) -> None:
        self.show, self.steps, self.last = show, steps, time.perf_counter()

    def say(self, what: str) -> None:
        if self.show:
            print(PROGRESS + what, flush=True)
            self.last = time.perf_counter()

    def step(self, i: int, seconds: float, loss: float) -> None:
        now = time.perf_counter()
        if i == 0 or i + 1 == self.steps or now - self.last >= PROGRESS_EVERY_S:
            self.say(f"step {i + 1} of {self.steps}: {seconds:.1f} s, loss {float(loss):.3f}")


@contextlib.contextmanager
def temp_root(folder: str | None) -> Iterator[None]:
    """tempfile's default folder is `folder` inside the block (the trainer's run folder of a
    trial is a mkdtemp, bench/systems.py), and what it was after it."""
    before = tempfile.tempdir
    tempfile.tempdir = folder or before
    try:
        yield
    finally:
        tempfile.tempdir = before


def run_trial(spec: dict, scratch: str | None = None) -> dict:
    """The trial's record; its run folder is made under `scratch` when given (main's temporary
    folder, removed when the trial ends)."""
    bench = BenchConfig(**spec["bench"])
    system = get_system(spec["system"])
    bench = BenchConfig(**{**bench.to_dict(), **system.bench_changes})
    model = bench.model(spec["layers"])
    threads = configure_process()  # as `fitgpt train` does, before CUDA and process groups
    ctx = init_distributed(spec.get("device", "auto"), timeout_s=spec.get("dist_timeout", 300))
    rec = {
        # torch's threads per rank: on a loaded CPU box they decide the step time (issue 33)
        "cpu_threads": threads,
        "system": system.name,
        "layers": spec["layers"],
        "hidden": bench.hidden,
        "params": model.num_params(),
        "world": ctx.world,
        "bench": bench.to_dict(),
        "device": device_name(ctx.device),
        "versions": versions(),
        "date": datetime.date.today().isoformat(),
        "status": "ok",
        "reason": "",
    }
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    source = UniformSource(bench.seq_len, bench.vocab_size, bench.seed)
    # --tensor-parallel T: the T ranks of a TP group (consecutive ranks, dist/mesh.py) take the
    # same micro-batches; the batch is sharded over the world/T data-parallel ranks
    # (--context-parallel C the same for the C ranks of a CP group, each its slice of the rows)
    fixed = system.plan_fixed(bench) or Fixed()
    tp, cp = max(1, fixed.tensor_parallel), fixed.context_parallel
    rec["tensor_parallel"], rec["context_parallel"] = tp, cp
    loader = BatchLoader(
        source,
        bench.micro_batch,
        ctx.rank // (tp * cp),
        ctx.world // (tp * cp),
        0,
        (ctx.rank // tp) % cp,  # the DP index's place in its CP group (dist/mesh.py cp_ranks)
        cp,
    )
    runner = None
    progress = Progress(ctx.is_main, bench.warmup + bench.steps)
    try:
        cap = int(spec.get("cap_bytes", 0))
        apply_cap(cap, ctx.device)
        t0 = time.perf_counter()
        progress.say(f"building {spec['layers']} layers ({model.num_params():,} parameters)")
        with temp_root(scratch):
            runner = system.build(model, bench, ctx)
        rec["init_s"] = time.perf_counter() - t0
        progress.say(f"built in {rec['init_s']:.1f} s")
        check_cap(cap, runner, ctx.device)
        if hasattr(runner, "record"):  # fitgpt's engines: the plan they run and its prediction
            rec.update(runner.record())
        times, losses, phases = [], [], []
        engine = getattr(runner, "engine", None)
        for i in range(bench.warmup + bench.steps):
            micro = [loader.next() for _ in range(bench.grad_accum)]
            t0 = time.perf_counter()
            losses.append(runner.step(micro))
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            dt = time.perf_counter() - t0  # the step's time, before the progress line's I/O
            progress.step(i, dt, losses[-1])
            if i >= bench.warmup:
                times.append(dt)
                if hasattr(engine, "breakdown"):
                    phases.append(engine.breakdown())
        tokens = tokens_per_step(
            bench.micro_batch, bench.grad_accum, bench.seq_len, ctx.world // (tp * cp)
        )
        med = statistics.median(times)
        rec.update(
            {
                "step_s": med,
                "step_s_min": min(times),
                "step_s_max": max(times),
                "tokens_per_s": tokens / med,
                "samples_per_s": tokens / bench.seq_len / med,
                "loss_first": losses[0],
                "loss_last": losses[-1],
                "losses": losses,
            }
        )
        if phases:
            # phases of timed steps (each read one step late), and the host optimizer's totals
            keys = [k for k in phases[-1] if not k.endswith("_total")]
            rec["breakdown_s"] = {
                k: statistics.median(p[k] for p in phases if k in p) for k in keys
            }
            for k in phases[-1]:
                if k.endswith("_total"):
                    rec["breakdown_s"][k] = phases[-1][k]
                    if len(phases) > 1:  # the counters' growth over one timed step
                        per = (phases[-1][k] - phases[0][k]) / (len(phases) - 1)
                        rec["breakdown_s"][k.removesuffix("_total") + "_per_step"] = per
        rec.update(compile_record(engine))
        flops = model.flops_per_token() * tokens / med / ctx.world  # per GPU, recompute not counted
        rec["tflops"] = flops / 1e12
        peak = peak_flops(ctx.device)
        if peak:
            rec["mfu"] = flops / peak
        if not all(np.isfinite(losses)):
            rec.update(status="error", reason=f"non-finite loss {losses}")
    except BaseException as e:  # the trial's whole point is to record how it failed
        rec["status"], rec["reason"] = classify(e)
        if rec["status"] == "error":
            rec["traceback"] = traceback.format_exc()[-3000:]
    finally:
        # main() ends in os._exit, which skips exit hooks: remove the nvme tier's files here
        engine = getattr(runner, "engine", None)
        if engine is not None and hasattr(engine, "close"):
            engine.close()
    if ctx.device.type == "cuda":
        rec["gpu_peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    rec["host_rss_peak_gib"] = peak_rss_bytes() / 2**30
    rec["rank"] = ctx.rank
    return rec


def main() -> None:
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    die_with_parent(os.getppid())  # the sweep or `fitgpt capacity` (or torchrun) that started it
    spec = json.loads(spec_path.read_text())
    # beside the result: removed below, and if the trial is killed first, by the parent that
    # removes its own temporary folder (cli/capacity.py)
    scratch = tempfile.mkdtemp(prefix="fitgpt-trial-", dir=out_path.parent)
    try:
        rec = run_trial(spec, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rank = rec["rank"]
    tmp = out_path.with_name(f"{out_path.name}.rank{rank}.tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, out_path.with_name(f"{out_path.name}.rank{rank}"))
    # hard exit: a peer or a half-failed collective can leave threads that block a clean one
    sys.stdout.flush()
    os._exit(0 if rec["status"] == "ok" else 3)


if __name__ == "__main__":
    main()
