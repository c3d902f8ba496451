"""`fitgpt capacity`: the largest model of a width that really trains on this machine.

Each trial is a process of its own (bench/sweep.py run_one) in its own session, writing into a
temporary folder. While one runs, its progress lines are shown (`TrialProgress`): a CPU trial
of a large model takes minutes a step. SIGTERM is handled as Ctrl-C (fitgpt/procs.py
stop_on_sigterm), so either kills the running trial's process group and removes the temporary
folder before the command exits; a trial also dies with this process if it is killed outright.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from fitgpt import units
from fitgpt.bench.config import BenchConfig
from fitgpt.cli.args import add_config_args, config_from_args
from fitgpt.errors import UserError


def register(sub) -> None:
    p = sub.add_parser(
        "capacity",
        help="find the largest model that trains here, by real trials",
        description="Search over layer counts (at a fixed width) for the largest model that "
        "trains: every trial a short real training run in its own process, starting from the "
        "memory model's prediction. Reports the largest size that trained, its throughput, its "
        "measured peak memory and the prediction beside each trial.",
    )
    p.add_argument(
        "--system",
        default=None,
        help="a `fitgpt bench` system (default: fitgpt, the planner's choice)",
    )
    p.add_argument(
        "--engine",
        choices=["ddp", "zero"],
        default=None,
        help="shorthand: ddp, or zero with --zero-stage",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=None,
        help="with --engine zero: what each GPU keeps only its share of (see `fitgpt train "
        "--help`)",
    )
    p.add_argument(
        "--plan",
        choices=["auto"],
        default=None,
        help="auto: fitgpt's planner chooses (the default)",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs per trial (default: 1)")
    p.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="where to run: auto (a GPU if there is one), cuda or cpu (default: auto)",
    )
    p.add_argument(
        "--search",
        choices=["layers", "seq-len"],
        default="layers",
        help="what to search: the most layers at --hidden (default), or with seq-len the "
        "longest sequence that trains at --layers",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="with --search seq-len: the model's layer count"
    )
    p.add_argument(
        "--seq-step",
        type=int,
        default=1024,
        help="with --search seq-len: sequence lengths tried are multiples of this (default: 1024)",
    )
    p.add_argument(
        "--max-seq",
        type=int,
        default=1 << 20,
        help="with --search seq-len: the longest sequence tried (default: 1048576)",
    )
    p.add_argument(
        "--start",
        type=int,
        default=None,
        help="first layer count (or with --search seq-len, sequence length) to try (default: "
        "the prediction)",
    )
    p.add_argument("--max-trials", type=int, default=8, help="trials at most (default: 8)")
    p.add_argument(
        "--cap",
        default=None,
        help="memory budget per GPU (process), e.g. 40GB: a real allocator cap on "
        "GPUs; on CPUs a cap on the engine's state bytes (for tests)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="optimizer steps per trial before timing starts (default: 1)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=2,
        help="timed optimizer steps per trial (default: 2; 1 where a step takes minutes, as "
        "with optimizer state on the disk)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="the largest model a LoRA run of this rank trains here (every linear adapted), its "
        "frozen base placed by the planner (docs/adapters.md): predicted by the memory model, "
        "no trials",
    )
    p.add_argument(
        "--base-format",
        choices=["auto", "fp32", "bf16", "int8", "nf4"],
        default="auto",
        help="with --lora-rank: how the frozen base is held (default: auto, as `fitgpt train`)",
    )
    p.add_argument("--out", default=None, help="append every trial as a JSON line to this file")
    add_config_args(p, BenchConfig, skip=("steps", "warmup"))
    p.set_defaults(func=run)


def system_name(args: argparse.Namespace) -> str:
    if args.system:
        return args.system
    if args.engine == "ddp":
        return "ddp"
    if args.engine == "zero":
        if args.zero_stage is None:
            raise UserError("--engine zero needs --zero-stage 0..3 (or use --plan auto)")
        return f"zero{args.zero_stage}"
    return "fitgpt"


def check_args(args: argparse.Namespace) -> Path | None:
    """The numbers in range and --out writable, before the first trial; the --out path."""
    if args.gpus < 1:
        raise UserError(f"--gpus {args.gpus}: must be at least 1")
    if args.max_trials < 1:
        raise UserError(f"--max-trials {args.max_trials}: must be at least 1")
    if args.steps < 1 or args.warmup < 0:
        raise UserError(
            f"--steps {args.steps} --warmup {args.warmup}: steps at least 1, warmup 0 or more"
        )
    if args.nvme_path and not os.path.isdir(args.nvme_path):  # trials write their state there
        raise UserError(f"--nvme-path {args.nvme_path}: not a folder; pass an existing folder "
                        "on a fast disk")  # fmt: skip
    if args.start is not None and args.start < 1:
        raise UserError(f"--start {args.start}: a layer count, at least 1")
    if args.search == "seq-len":
        if args.layers is None or args.layers < 1:
            raise UserError(
                f"--search seq-len needs --layers N (at least 1), the model to lengthen; got "
                f"{args.layers}"
            )
        if args.seq_step < 1 or args.max_seq < args.seq_step:
            raise UserError(
                f"--seq-step {args.seq_step} --max-seq {args.max_seq}: a step of at least 1 "
                "and a longest sequence of at least one step"
            )
    if args.out is None:
        return None
    from fitgpt.paths import check_writable_file

    return check_writable_file(args.out, "--out")


def run(args: argparse.Namespace) -> int:
    from fitgpt.procs import stop_on_sigterm

    with stop_on_sigterm():  # `timeout`/`kill` must not orphan a running trial or leave its files
        return search(args)


def search(args: argparse.Namespace) -> int:
    from fitgpt.bench.sweep import SweepSpec, append_result, run_one
    from fitgpt.bench.systems import bench_run, check_trial, get_system
    from fitgpt.plan import rates
    from fitgpt.plan.capacity import (
        describe_formats,
        find_capacity,
        formats_of,
        predicted_largest,
        predicted_peak_gib,
        predicted_plan,
    )
    from fitgpt.plan.formats import FIELDS

    out = check_args(args)
    bench = dataclasses.replace(
        config_from_args(args, BenchConfig), warmup=args.warmup, steps=args.steps
    )
    system = get_system(system_name(args))
    bench = dataclasses.replace(bench, **system.bench_changes)
    hw, cap = capped_hardware(args)
    # what `fitgpt train` would refuse (a T the GPUs or heads do not divide...): one line, before
    # any trial or prediction
    layers = args.layers if args.search == "seq-len" else (args.start or 1)
    check_trial(system, bench, layers, args.gpus, hw.device)
    fixed = system.plan_fixed(bench)  # None: a peer (no memory model)
    r = rates.load(hw.gpu_name)
    if args.lora_rank is not None:
        return lora_capacity(args, bench, system, hw)
    if args.search == "seq-len":
        return run_seq_search(args, out, system, bench, hw, cap, fixed, r)

    def planned(layers: int):
        return bench_run(bench.model(layers), bench, system.precision, hw.device)

    def predicted(layers: int) -> float | None:
        return None if fixed is None else predicted_peak_gib(planned(layers), hw, r, fixed)

    start = args.start
    if start is None:
        if fixed is None:
            raise UserError(f"system {system.name} has no memory model: pass --start LAYERS")
        start = predicted_largest(planned(1), hw, r, fixed)
    state = ""
    if fixed is not None:
        e = predicted_plan(planned(start), hw, r, fixed).ecfg
        state = f", optimizer state: {describe_formats({k: getattr(e, k) for k in FIELDS})}"
    print(
        f"capacity of {system.name}: hidden {bench.hidden}, micro-batch {bench.micro_batch}, "
        f"{where(args, hw)}; predicted largest {start} layers "
        f"({units.params(bench.model(start).num_params())}){state}",
        flush=True,
    )
    spec = SweepSpec((system.name,), (), bench, args.gpus, args.device)
    with tempfile.TemporaryDirectory(prefix="fitgpt-capacity-") as tmp, stopped_says(out):
        shown = TrialProgress(Path(tmp))

        def trial(layers: int) -> dict:
            with shown:
                rec = run_one(spec, system.name, layers, Path(tmp), cap)
            if out:
                out.parent.mkdir(parents=True, exist_ok=True)
                append_result(out, {**rec, "predicted_peak_gib": predicted(layers)})
            return rec

        found = find_capacity(
            trial, start, args.max_trials, predicted, lambda m: print(m, flush=True)
        )
    best = found.best()
    if best is None:
        smallest = found.records[min(found.records)]
        print(f"no size trained ({len(found.result.trials)} trials); smallest tried failed: "
              f"{smallest['reason'][:200]}")  # fmt: skip
        return 1
    print(json.dumps(found.summary(system.name)))
    fail = found.result.first_fail
    per = "GPU" if hw.device == "cuda" else "process"
    rate = f" ({units.tflops(best['tflops'])} per {per})" if "tflops" in best else ""
    print(
        f"largest that trained: {found.result.largest_ok} layers = {units.params(best['params'])} "
        f"parameters{rate}" + ("" if fail is None else f"; {fail} layers failed")
    )
    state = describe_formats(formats_of(best))
    if state:
        print(f"its optimizer state: {state}")
    return 0


def lora_capacity(args, bench, system, hw) -> int:
    """`fitgpt capacity --lora-rank R`: the largest layer count at --hidden whose LoRA run fits,
    its base's format and tiers as `fitgpt train` would place them (plan/adapter.py)."""
    from fitgpt.adapters import AdapterConfig
    from fitgpt.bench.systems import bench_run
    from fitgpt.plan.adapter import largest_lora

    adapter = AdapterConfig(lora_rank=args.lora_rank, base_format=args.base_format)

    def run_at(layers: int):
        run = bench_run(bench.model(layers), bench, system.precision, hw.device)
        # the bench's --checkpointing, which a trial's system would apply (plan_fixed)
        engine = dataclasses.replace(run.engine, checkpointing=bench.checkpointing)
        return dataclasses.replace(run, engine=engine, adapter=adapter)

    found = largest_lora(run_at, hw)
    head = (
        f"LoRA rank {args.lora_rank} capacity: hidden {bench.hidden}, micro-batch "
        f"{bench.micro_batch}, seq {bench.seq_len}, checkpointing {bench.checkpointing}, "
        f"{where(args, hw)}"
    )
    if found is None:
        print(f"{head}; not even 1 layer fits")
        return 1
    layers, line = found
    params = units.params(bench.model(layers).num_params())
    print(f"{head}; predicted largest {layers} layers ({params}), {line}")
    print(json.dumps({"lora_rank": args.lora_rank, "layers": layers,
                      "params": bench.model(layers).num_params(), "plan": line}))  # fmt: skip
    return 0


def run_seq_search(args, out, system, bench, hw, cap, fixed, r) -> int:
    """`--search seq-len`: the longest sequence that trains at --layers, by real trials (each
    its own process, as the layer search), from the planner's prediction."""
    from fitgpt.bench.sweep import SweepSpec, append_result, run_one
    from fitgpt.bench.systems import bench_run
    from fitgpt.plan.capacity import find_longest_seq, predicted_longest_seq, predicted_peak_gib

    layers, q = args.layers, args.seq_step

    def at(seq: int):
        return dataclasses.replace(bench, seq_len=seq)

    def planned(seq: int):
        b = at(seq)
        return bench_run(b.model(layers), b, system.precision, hw.device)

    def predicted(seq: int) -> float | None:
        return None if fixed is None else predicted_peak_gib(planned(seq), hw, r, fixed)

    start = args.start
    if start is None:
        if fixed is None:
            raise UserError(f"system {system.name} has no memory model: pass --start SEQ_LEN")
        start = predicted_longest_seq(planned, hw, r, fixed, q, args.max_seq)
    print(
        f"longest sequence of {system.name}: {layers} layers of hidden {bench.hidden} "
        f"({units.params(bench.model(layers).num_params())} at seq {bench.seq_len}), micro-batch "
        f"{bench.micro_batch}, {where(args, hw)}; predicted longest seq {start}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="fitgpt-capacity-seq-") as tmp, stopped_says(out):
        shown = TrialProgress(Path(tmp))

        def trial(seq: int) -> dict:
            work = Path(tmp) / f"seq{seq}"  # every trial its own folder: the files name layers
            work.mkdir()
            spec = SweepSpec((system.name,), (), at(seq), args.gpus, args.device)
            with shown:
                rec = run_one(spec, system.name, layers, work, cap)
            if out:
                out.parent.mkdir(parents=True, exist_ok=True)
                append_result(out, {**rec, "seq_len": seq, "predicted_peak_gib": predicted(seq)})
            return rec

        found = find_longest_seq(
            trial,
            start,
            q,
            args.max_trials,
            predicted,
            args.max_seq,
            lambda m: print(m, flush=True),
        )
    best = found.best()
    if best is None:
        smallest = found.records[min(found.records)]
        print(f"no sequence length trained ({len(found.result.trials)} trials); shortest tried "
              f"failed: {smallest['reason'][:200]}")  # fmt: skip
        return 1
    summary = {
        "system": system.name,
        "layers": layers,
        "largest_seq_len": found.result.largest_ok,
        "predicted_seq_len": start,
        "first_fail": found.result.first_fail,
        "tokens_per_s": best.get("tokens_per_s"),
        "gpu_peak_gib": best.get("gpu_peak_gib"),
        "host_rss_peak_gib": best.get("host_rss_peak_gib"),
        "predicted_peak_gib": best.get("predicted_peak_gib"),
        "trials": len(found.result.trials),
    }
    print(json.dumps(summary))
    fail = found.result.first_fail
    print(
        f"longest that trained: seq {found.result.largest_ok} at {layers} layers, micro-batch "
        f"{bench.micro_batch} (predicted {start})"
        + ("" if fail is None else f"; seq {fail} failed")
    )
    return 0


def where(args: argparse.Namespace, hw) -> str:
    """Where the trials run, for the first line: "1 GPU(s)", or the CPU and why. A box without
    a GPU measures its CPU and host RAM (as `fitgpt train` trains there): a capacity of this
    machine, not of any GPU, and it says so."""
    if hw.device == "cuda":
        return f"{args.gpus} GPU(s)"
    procs = "one process" if args.gpus == 1 else f"{args.gpus} processes"
    why = "--device cpu" if args.device == "cpu" else "no GPU found"
    return f"measured on the CPU ({why}), {procs}, in host RAM"


class TrialProgress:
    """`with shown:` around one trial: its progress lines (bench/trial.py PROGRESS, printed by
    the trial into its log under `folder`) are shown as they come, indented, and a line after
    each STILL_S of silence says the trial is still running. Read offsets are kept from trial
    to trial, so each line is shown once. A thread polls once a second: the main thread is
    waiting on the trial's process."""

    STILL_S = 60.0

    def __init__(self, folder: Path) -> None:
        self.folder, self.read = folder, {}

    def __enter__(self) -> TrialProgress:
        self.stop = threading.Event()
        self.start = self.last = time.monotonic()
        self.thread = threading.Thread(target=self._watch, name="trial-progress", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self._show()  # the lines written as the trial ended

    def _watch(self) -> None:
        while not self.stop.wait(1.0):
            self._show()
            now = time.monotonic()
            if now - self.last >= self.STILL_S:
                self.last = now
                print(f"    still running ({now - self.start:.0f} s into the trial)", flush=True)

    def _show(self) -> None:
        from fitgpt.bench.trial import PROGRESS

        for log in sorted(self.folder.rglob("*.log")):
            try:
                with open(log, "rb") as f:
                    f.seek(self.read.get(log, 0))
                    data = f.read()
            except OSError:  # removed as the search ended
                continue
            whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits
            self.read[log] = self.read.get(log, 0) + len(whole)
            for line in whole.decode("utf-8", "replace").splitlines():
                if line.startswith(PROGRESS):
                    print("    " + line.removeprefix(PROGRESS), flush=True)
                    self.last = time.monotonic()


@contextlib.contextmanager
def stopped_says(out: Path | None) -> Iterator[None]:
    """Ctrl-C or SIGTERM during the search: a running trial is already killed (run_one) and the
    temporary folder goes as the enclosing `with` exits; the line printed says so."""
    try:
        yield
    except KeyboardInterrupt as e:
        kept = f"; the trials that ended are in {out}" if out else ""
        raise type(e)(
            f"{e or 'interrupted'}: any running trial was killed and the temporary files "
            f"removed{kept}"
        ) from None


def capped_hardware(args: argparse.Namespace):
    """(this machine as the planner sees it, the --cap in bytes or 0): with a cap, GPUs get it
    as their memory (a real allocator cap in each trial); CPUs count state bytes only, so the
    process baseline the memory model adds is granted on top of it."""
    import torch

    from fitgpt.plan import hardware
    from fitgpt.plan.hardware import parse_bytes
    from fitgpt.plan.memory import HOST_BASE

    cap = parse_bytes(args.cap, "--cap") if args.cap else 0
    if args.device == "cuda" and not torch.cuda.is_available():  # trials are real: no planned GPU
        raise UserError(
            "--device cuda: no GPU is visible here, and a capacity is measured by real trials; "
            "run it on the GPU machine, or pass --device cpu to measure this CPU"
        )
    # the disk tier counts where the trials may use it (--nvme-path), as `fitgpt train` plans
    hw = hardware.detect(args.gpus, None, None, args.nvme_path or None, args.device)
    if cap and hw.device == "cuda":
        hw = dataclasses.replace(hw, gpu_mem=cap)
    elif cap:
        hw = dataclasses.replace(hw, cpu_mem=cap + HOST_BASE["cpu"])
    return hw, cap
