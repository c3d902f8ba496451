"""The parts of a run that are worked out from its data, its device or its length: the model's
vocabulary (the data's tokenizer's), the precision, and --compile where nothing plans it; and a
run that runs out of memory, said in one line. train/assemble.py settles a run with them, once,
before the planner prices it:

    resolve_run (vocabulary, precision) ─> check_settings ─> plan_engine, or unplanned_compile

so the planner prices exactly the model the engine builds. Before this, the trainer swapped the
tokenizer's vocabulary in after planning: a 38-layer model with GPT-2's 50,304-row embedding was
planned with the tiny preset's 256 rows and ran out of GPU memory at its first forward.
"""

from __future__ import annotations

import dataclasses
import traceback

import torch

from fitgpt.data.config import model_for_data
from fitgpt.dist import DistContext
from fitgpt.engine.transforms.compile import ASSUMED_MFU, SCOPES, compile_scope
from fitgpt.errors import UserError
from fitgpt.model.families import family_of
from fitgpt.plan.memory import tokens_per_step


class OutOfMemory(UserError):
    """A run ran out of GPU or host memory; the message names what, where, and what would fit."""

    def __init__(self, msg: str, where: str) -> None:
        super().__init__(msg)
        self.where = where  # "gpu" or "host"


def resolve_run(run, device_type: str):
    """`run` with what changes the model settled: the vocabulary (data/config.py
    model_for_data; a fine-tune
    keeps its model's rows) and the precision for this device. --compile is the placement's
    (train/assemble.py placed)."""
    precision = run.precision.resolved(device_type)
    model = model_for_data(run.model, run.data, keep_rows=run.train.finetune)  # data/config.py
    return dataclasses.replace(run, model=model, precision=precision)


def unplanned_compile(run, device_type: str, world: int) -> str:
    """--compile of a run that is not planned (--plan off, or a RunConfig trained directly):
    the planner's rule (engine/transforms/compile.py compile_scope) applied to the engine config as given,
    the run's length estimated from its FLOPs (estimated_run_s) instead of a priced step."""
    from fitgpt.plan.apply import workload_of
    from fitgpt.plan.memory import layout_of, placement_of

    e = run.engine
    if e.compile in SCOPES:  # a scope given is the scope
        return e.compile
    resident = True
    if e.engine == "zero":
        work = workload_of(run, world, device_type)
        resident = placement_of(work, e, layout_of(run.model)).resident
    return compile_scope(
        e.compile, e.engine, device_type, run.model.n_embd, world, resident, e.checkpointing,
        estimated_run_s(run, device_type), family_of(run.model).compiled_checkpointed,
    )  # fmt: skip


def estimated_run_s(run, device_type: str) -> float:
    """Seconds of training steps `run` takes on one GPU, estimated from its model FLOPs at
    ASSUMED_MFU of the GPU's bf16 peak (the fastest known GPU's if unknown); 0 on CPUs. Only
    an unplanned --compile auto reads it: compiling is worth it when the run is long
    (engine/transforms/compile.py)."""
    if device_type != "cuda":
        return 0.0
    from fitgpt.train.metrics import PEAK_BF16, peak_flops

    t = run.train
    tokens = tokens_per_step(t.micro_batch, t.grad_accum, run.model.seq_len)  # one rank's share
    peak = peak_flops(torch.device("cuda")) or max(PEAK_BF16.values())
    return t.steps * run.flops_per_token() * tokens / (ASSUMED_MFU * peak)


# ---- out of memory ---------------------------------------------------------------------------
def is_oom(e: BaseException) -> str | None:
    """'gpu', 'host' or None: whether an exception is running out of memory, and of which."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "gpu"
    text = str(e)
    if isinstance(e, MemoryError) or "can't allocate memory" in text:
        return "host"
    if isinstance(e, RuntimeError) and "CUDA error: out of memory" in text:
        return "gpu"
    return None


def phase_of(e: BaseException, default: str) -> str:
    """Which part of a step failed, read from the frames the exception passed through."""
    names = [f.name for f in traceback.extract_tb(e.__traceback__)]
    for key, phase in (
        ("_update", "the optimizer update"),
        ("backward", "the backward pass"),
        ("forward", "the forward pass"),
        ("save", "the checkpoint write"),
        ("__init__", "building the engine"),
    ):
        if any(key in n for n in reversed(names)):
            return f"{phase} ({default})"
    return default


def gpu_held(e: BaseException, device: torch.device) -> str:
    """What torch's allocator held when the GPU ran out: allocated then, the run's peak, and
    the request that failed (from torch's message), so a plan's miss can be sized."""
    import re

    GiB = 2**30
    asked = re.search(r"Tried to allocate ([0-9.]+ [KMGT]iB)", str(e))
    held = torch.cuda.memory_allocated(device) / GiB
    peak = torch.cuda.max_memory_allocated(device) / GiB
    more = f", asking {asked.group(1)} more" if asked else ""
    return f" (torch held {held:.1f} GiB, peak {peak:.1f}{more})"


def oom_message(run, ctx: DistContext, where: str, phase: str, held: str = "") -> str:
    """One line: what ran out, at which phase (`held`: gpu_held's figures), the plan's
    prediction, and a plan that would fit."""
    from fitgpt.plan import hardware, rates
    from fitgpt.plan.apply import plan_run, workload_of
    from fitgpt.plan.fixed import Fixed
    from fitgpt.plan.memory import GiB, estimate

    est = estimate(workload_of(run, ctx.world, ctx.device.type), run.engine)
    if where == "gpu":
        predicted = f"the plan predicted {est.compute_total / GiB:.1f} GiB per GPU"
    else:
        predicted = f"the plan predicted {est.host_total / GiB:.1f} GiB of host RAM per rank"
    hw = hardware.for_run(run.engine, ctx.world, ctx.device.type)  # RAM: one node's
    # what the planner picks when what ran out holds 15% less than the plan predicted it needs
    if where == "gpu" and est.compute:
        hw = dataclasses.replace(hw, gpu_mem=int(0.85 * min(hw.gpu_mem, est.compute_total)))
    else:
        need = est.host_total * hw.gpus  # this node's ranks
        hw = dataclasses.replace(hw, cpu_mem=int(0.85 * min(hw.cpu_mem or need, need)))
    plans = plan_run(run, hw, rates.for_run(hw.gpu_name, run.engine), Fixed())
    if plans.fits:
        advice = f"a plan that needs 15% less: {engine_flags(plans.best.ecfg)}"
    else:
        advice = (
            "no plan needs 15% less at this size: train fewer layers or a smaller --micro-batch"
        )
    what = "GPU memory" if where == "gpu" else "host RAM"
    return f"ran out of {what} during {phase}{held}; {predicted}; {advice}"


def engine_flags(ecfg) -> str:
    """The command-line flags that select this engine config (the fields off their defaults)."""
    from fitgpt.engine.config import EngineConfig

    base = EngineConfig()
    out = []
    for f in dataclasses.fields(EngineConfig):
        v = getattr(ecfg, f.name)
        if v == getattr(base, f.name) and f.name not in ("engine", "zero_stage"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else f"--no-{flag[2:]}")
        else:
            out.append(f"{flag} {round(v, 4) if isinstance(v, float) else v}")
    return " ".join(out)
