"""Making a run ready: the one path from a RunConfig to the run that is planned and built.

`fitgpt train` (however it is launched) and the benchmark harness both go through `setup_run`:

    configure_process ─> resolve_run (vocabulary, precision) ─> plan_engine (placement,
    --compile) ─> Trainer

so the planner prices exactly the model the engine builds. Before this, the trainer swapped the
tokenizer's vocabulary in after planning: a 38-layer model with GPT-2's 50,304-row embedding was
planned with the tiny preset's 256 rows and ran out of GPU memory at its first forward.
"""

from __future__ import annotations

import dataclasses
import traceback

import torch

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


def model_for_data(model, data, keep_rows: bool = False, whose: str = "the model"):
    """The model config with the vocabulary of the data's tokenizer (synthetic data keeps the
    model's own); see vocab_for."""
    from fitgpt.data.config import data_tokenizer

    return vocab_for(model, data_tokenizer(data), keep_rows, whose)


def vocab_for(model, tok, keep_rows: bool = False, whose: str = "the model"):
    """`model` sized for tokenizer `tok` (None: no tokenizer, the model's own vocabulary).

    A model trained from scratch gets the tokenizer's vocabulary. A model whose embedding comes
    from weights (`keep_rows`: a run's train.finetune, set by --init-from) keeps its rows: they
    are the model's, and a released model often has more rows than its tokenizer has ids
    (Qwen2.5: 152,064 for 151,665; Qwen3: 151,936 for 151,669), which HF computes logits for as
    for any row, so the fine-tune and its export keep them. The rule there is that the data's
    ids lie below the rows: a tokenizer of more ids is refused in one line."""
    if tok is None:
        return model
    if not keep_rows and tok.vocab_size != model.vocab_size:
        return model.replace(vocab_size=tok.vocab_size)
    if keep_rows and tok.vocab_size > model.vocab_size:
        raise UserError(
            f"{whose} has {model.vocab_size} embedding rows, the data's tokenizer {tok.name} "
            f"{tok.vocab_size} ids: its ids must lie below the rows; train on data made with "
            "the model's own tokenizer (fitgpt data preprocess --tokenizer)"
        )
    return model


def resolve_run(run, device_type: str, world: int = 1, settle_compile: bool = True):
    """`run` with everything that changes the model settled: the vocabulary (model_for_data;
    a fine-tune keeps its model's rows), the precision for this device, and, unless
    `settle_compile` is False or it is settled already, --compile (unplanned_compile). A
    planned run's --compile is the planner's."""
    run = dataclasses.replace(
        run,
        model=model_for_data(run.model, run.data, keep_rows=run.train.finetune),
        precision=run.precision.resolved(device_type),
    )
    if run.engine.compile in SCOPES or not settle_compile:
        return run
    scope = unplanned_compile(run, device_type, world)
    return dataclasses.replace(run, engine=dataclasses.replace(run.engine, compile=scope))


def unplanned_compile(run, device_type: str, world: int) -> str:
    """--compile of a run that is not planned (--plan off, or a RunConfig trained directly):
    the planner's rule (engine/transforms/compile.py compile_scope) applied to the engine config as given,
    the run's length estimated from its FLOPs (estimated_run_s) instead of a priced step."""
    from fitgpt.plan.apply import workload_of
    from fitgpt.plan.memory import layout_of, placement_of

    e = run.engine
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
    return t.steps * run.model.flops_per_token() * tokens / (ASSUMED_MFU * peak)


def setup_run(run, ctx: DistContext, fixed, force: bool = False, log=print):
    """The run as it will be built: resolved, then planned (`fixed`: the engine fields the user
    set, a plan.fixed.Fixed; None: no planning, the engine config is used as given)."""
    run = resolve_run(run, ctx.device.type, ctx.world, settle_compile=False)
    # the one validation of a run's settings (plan/validate.py), on the model as built (its
    # vocabulary is the tokenizer's now): what the CLI checked, and the benchmark harness's runs
    from fitgpt.plan.validate import check_settings

    check_settings(run.model, run.engine, run.precision, ctx.world, ctx.device.type, fixed)
    if fixed is None:  # --plan off: the engine config as given, --compile settled on it
        return resolve_run(run, ctx.device.type, ctx.world)
    from fitgpt.plan.apply import plan_engine

    # the planner settles --compile with the rest of the plan, and priced what it chose
    return plan_engine(run, ctx, fixed, force, log)


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


def oom_message(run, ctx: DistContext, where: str, phase: str) -> str:
    """One line: what ran out, at which phase, the plan's prediction, and a plan that would fit."""
    from fitgpt.plan import hardware, rates
    from fitgpt.plan.apply import plan_run, workload_of
    from fitgpt.plan.fixed import Fixed
    from fitgpt.plan.memory import GiB, estimate

    est = estimate(workload_of(run, ctx.world, ctx.device.type), run.engine)
    if where == "gpu":
        predicted = f"the plan predicted {est.compute_total / GiB:.1f} GiB per GPU"
    else:
        predicted = f"the plan predicted {est.host_total / GiB:.1f} GiB of host RAM per rank"
    hw = hardware.detect(gpus=ctx.world, device=ctx.device.type, cpu_mem=run.engine.cpu_mem)
    # what the planner picks when what ran out holds 15% less than the plan predicted it needs
    if where == "gpu" and est.compute:
        hw = dataclasses.replace(hw, gpu_mem=int(0.85 * min(hw.gpu_mem, est.compute_total)))
    else:
        need = est.host_total * (hw.gpus if hw.device == "cuda" else ctx.world)
        hw = dataclasses.replace(hw, cpu_mem=int(0.85 * min(hw.cpu_mem or need, need)))
    plans = plan_run(run, hw, rates.load(hw.gpu_name), Fixed())
    if plans.fits:
        advice = f"a plan that needs 15% less: {engine_flags(plans.best.ecfg)}"
    else:
        advice = (
            "no plan needs 15% less at this size: train fewer layers or a smaller --micro-batch"
        )
    what = "GPU memory" if where == "gpu" else "host RAM"
    return f"ran out of {what} during {phase}; {predicted}; {advice}"


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
