"""A DeepSpeed JSON config read as fitgpt flags.

Users migrating from DeepSpeed have a ds_config.json. `map_deepspeed` turns the keys with a
fitgpt equivalent into config-field values (the same fields the flags set) and names every other
key, with the reason, in a note: every key of the file ends up in `mapped` (the flag it set, or
"as fitgpt does") or in `notes`. `apply_deepspeed_config` lets the flags typed on the command
line win over the file. The table of what maps where is in docs/interop.md.

"auto" values (the HF Trainer's placeholder, filled from its own arguments; fitgpt runs without
the Trainer) leave fitgpt's default or the flag given in place; each is named in a note saying
which default that is.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.train.config import TrainConfig

PARTS = ("train", "engine", "precision", "optim")  # the RunConfig parts a DeepSpeed file reaches
CONFIGS = {"train": TrainConfig, "engine": EngineConfig, "precision": PrecisionConfig}
CONFIGS["optim"] = OptimConfig

NOTES_FILE = "deepspeed_notes.txt"  # in the run folder: what the config set, and every note

# steps_per_print is DeepSpeed's own engine report (lr, loss scale, samples/s), not a training
# log; HF Trainer configs set it to 2000 to keep it quiet. As --log-every such a value would hide
# progress for the whole of most runs, so only values up to this are taken.
MAX_LOG_EVERY = 100


@dataclass(frozen=True)
class Note:
    """A key of the file that was ignored or cannot be honoured, and why."""

    key: str
    reason: str

    def line(self) -> str:
        return f"{self.key}: {self.reason}"


@dataclass
class DeepSpeedFlags:
    """Field values per RunConfig part ("train", "engine", "precision", "optim"), the keys that
    set them (or that fitgpt honours without a flag), and notes on every other key."""

    values: dict[str, dict[str, Any]] = field(default_factory=lambda: {p: {} for p in PARTS})
    notes: list[Note] = field(default_factory=list)
    mapped: dict[str, str] = field(default_factory=dict)  # key -> the flag it set, or why none
    auto: list[str] = field(default_factory=list)  # keys whose value was "auto"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def default_of(part: str, name: str) -> str:
    """`--flag VALUE`, fitgpt's own default for one config field, for the "auto" notes."""
    f = next(f for f in dataclasses.fields(CONFIGS[part]) if f.name == name)
    if f.default is None or f.default is dataclasses.MISSING:
        text = str(f.metadata.get("default_text", "worked out by fitgpt")).replace("%%", "%")
        return f"{flag(name)} {text.split(';')[0].split(':')[0]}"  # its first clause
    if name == "precision":  # auto: say what it resolves to, from the flag's own help
        help_ = str(f.metadata.get("help", ""))
        rule = help_.split("auto: ", 1)[-1].split(" (")[0] if "auto: " in help_ else ""
        return f"--precision {f.default}" + (f" ({rule})" if rule else "")
    return (
        f"{flag(name)} {f.default:g}"
        if isinstance(f.default, float)
        else f"{flag(name)} {f.default}"
    )


# Keys that only tune DeepSpeed's own machinery: fitgpt's engine has its own (or no) knob.
IGNORED_TOP = {
    "wall_clock_breakdown": "timing breakdown: fitgpt logs step time, tokens/s and MFU anyway",
    "memory_breakdown": "fitgpt logs memory per step anyway",
    "dump_state": "a DeepSpeed debugging aid",
    "flops_profiler": "fitgpt logs TFLOP/s and MFU every log line",
    "tensorboard": "fitgpt writes metrics.jsonl (fitgpt report plots it)",
    "wandb": "fitgpt writes metrics.jsonl (fitgpt report plots it)",
    "csv_monitor": "fitgpt writes metrics.jsonl (fitgpt report plots it)",
    "comet": "fitgpt writes metrics.jsonl (fitgpt report plots it)",
    "comms_logger": "a DeepSpeed profiling aid",
    "timers": "fitgpt logs step time anyway",
    "prescale_gradients": "fitgpt averages gradients in fp32 in its own order",
    "gradient_predivide_factor": "fitgpt averages gradients in fp32 in its own order",
    "communication_data_type": "fitgpt reduces gradients in its own precision",
    "grad_accum_dtype": "fitgpt accumulates gradients in fp32",
    "data_types": "fitgpt accumulates gradients in fp32",
    "zero_allow_untested_optimizer": "fitgpt always uses its AdamW",
    "zero_force_ds_cpu_optimizer": "fitgpt's host optimizer is torch's AdamW",
    "aio": "fitgpt's NVMe tier does its own I/O (--nvme-path)",
    "checkpoint": "fitgpt's checkpoints are its own (--save-every, --keep)",
    "load_universal_checkpoint": "fitgpt's checkpoints load on any world size and stage anyway",
    "use_node_local_storage": "fitgpt's checkpoints are its own (--save-every, --keep)",
    "nebula": "fitgpt's checkpoints are its own (--save-every, --keep)",
    "seed": "pass --seed",
    "sparse_gradients": "fitgpt has no sparse embeddings",
    "dataloader_drop_last": "fitgpt's loader samples fixed-length windows, never a short batch",
    "disable_allgather": "fitgpt's engine chooses its own collectives",
    "compile": "pass --compile",
    "torch_autocast": "fitgpt chooses its compute dtype by --precision",
}
CANNOT_TOP = {
    "pipeline": "fitgpt has no pipeline parallelism",
    "amp": "apex AMP: use --precision bf16 or fp16",
    "elasticity": "fitgpt has no elastic batch sizing",
    "compression_training": "fitgpt trains no compressed models",
    "quantize_training": "fitgpt trains no quantized models",
    "weight_quantization": "fitgpt trains no quantized models",
    "autotuning": "use --plan auto (fitgpt's planner) instead",
    "sequence_parallel_size": "fitgpt has no Ulysses sequence parallelism",
    "curriculum_learning": "fitgpt has no curriculum learning",
    "data_efficiency": "fitgpt has no data-efficiency pipeline",
    "hybrid_engine": "fitgpt has no RLHF hybrid engine",
    "eigenvalue": "fitgpt computes no Hessian eigenvalues",
    "progressive_layer_drop": "fitgpt has no progressive layer dropping",
    "moe": "DeepSpeed's MoE layers are its own; fitgpt's experts are the model's (--init-from a "
    "qwen3_moe, mixtral or gpt_oss folder), spread over GPUs by --expert-parallel",
}
ZERO_IGNORED = {
    "overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
    "allgather_partitions", "allgather_bucket_size", "round_robin_gradients", "sub_group_size",
    "elastic_checkpoint", "load_from_fp32_weights", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
    "memory_efficient_linear", "use_multi_rank_bucket_allreduce",
    "offload_optimizer.pin_memory", "offload_param.pin_memory", "pipeline_loading_checkpoint",
    "override_module_apply", "log_trace_cache_warnings", "module_granularity_threshold",
}  # fmt: skip
ZERO_CANNOT = {
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "mics_shard_size", "mics_hierarchical_params_gather",
}  # fmt: skip


class _Reader:
    """Typed access to the file's values: each wrong type is one UserError naming file and key."""

    def __init__(self, source: str, world: int) -> None:
        self.source, self.world, self.out = source, world, DeepSpeedFlags()

    def fail(self, key: str, what: str, v: Any) -> UserError:
        return UserError(f"{self.source}: {key}: expected {what}, got {v!r}; fix the file")

    def block(self, cfg: dict, key: str, path: str | None = None) -> dict:
        v = cfg.get(key, {})
        if not isinstance(v, dict):
            raise self.fail(path or key, "a JSON object", v)
        return v

    def is_auto(self, v: Any, key: str, fitgpt: str) -> bool:
        """True for "auto", which is then named with `fitgpt`, the default that applies."""
        if v == "auto":
            self.out.auto.append(key)
            self.note(
                key, f'"auto" (an HF Trainer placeholder): your flag or fitgpt\'s default, {fitgpt}'
            )
            return True
        return False

    def int_(self, v: Any, key: str, minimum: int = 1) -> int:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise self.fail(key, f"an integer >= {minimum}", v)
        return v

    def num(self, v: Any, key: str) -> float:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise self.fail(key, "a number >= 0", v)
        return float(v)

    def bool_(self, v: Any, key: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(key, "true or false", v)
        return v

    def set(self, part: str, name: str, value: Any, key: str) -> None:
        """Field `name` of `part` takes `value`, from the file's `key`."""
        self.out.values[part][name] = value
        said = f"{flag(name)} {value}"
        prev = self.out.mapped.get(key)
        self.out.mapped[key] = (
            said if prev is None or prev.startswith("as fitgpt") else f"{prev} {said}"
        )

    def same(self, key: str, why: str) -> None:
        """`key` asks for what fitgpt does anyway: honoured without a flag."""
        self.out.mapped.setdefault(key, f"as fitgpt does: {why}")

    def note(self, key: str, reason: str) -> None:
        self.out.notes.append(Note(key, reason))


# ---- the sections ------------------------------------------------------------------------------
BATCH_KEYS = {
    "train_micro_batch_size_per_gpu": "micro_batch",
    "gradient_accumulation_steps": "grad_accum",
}


def _batch(r: _Reader, cfg: dict, explicit: dict[str, dict]) -> None:
    """micro × accum × world = train_batch_size, as DeepSpeed defines it; missing ones derived."""
    keys = (*BATCH_KEYS, "train_batch_size")
    fitgpt = {k: default_of("train", n) for k, n in BATCH_KEYS.items()}
    fitgpt["train_batch_size"] = "--micro-batch x --grad-accum x ranks"
    got = {k: cfg[k] for k in keys if k in cfg and not r.is_auto(cfg[k], k, fitgpt[k])}
    micro = r.int_(got[keys[0]], keys[0]) if keys[0] in got else None
    accum = r.int_(got[keys[1]], keys[1]) if keys[1] in got else None
    total = r.int_(got[keys[2]], keys[2]) if keys[2] in got else None
    if total is not None:
        if micro is not None and accum is not None and micro * accum * r.world != total:
            raise UserError(
                f"{r.source}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} "
                f"x gradient_accumulation_steps {accum} x {r.world} ranks; fix the file"
            )
        micro = explicit["train"].get("micro_batch", micro)
        accum = explicit["train"].get("grad_accum", accum)
        micro, accum = _derive(r, total, micro, accum)
        r.same("train_batch_size", f"{micro} x {accum} x {r.world} ranks")
    if micro is not None:
        r.set("train", "micro_batch", micro, keys[0])
    if accum is not None:
        r.set("train", "grad_accum", accum, keys[1])


def _derive(r: _Reader, total: int, micro: int | None, accum: int | None) -> tuple[int, int]:
    """The missing one of micro batch and accumulation, from train_batch_size."""
    w = r.world
    if micro is not None and accum is not None:
        if micro * accum * w != total:
            r.note(
                "train_batch_size",
                f"{total} no longer holds with your flags: {micro} x {accum} x {w} ranks "
                f"= {micro * accum * w} sequences per step",
            )
        return micro, accum
    if micro is None and accum is None:
        accum = 1  # DeepSpeed's rule: train_batch_size alone means no accumulation
    if micro is not None:
        known, name = micro, "train_micro_batch_size_per_gpu"
    else:
        known, name = accum, "gradient_accumulation_steps"
    if total % (known * w):
        raise UserError(
            f"{r.source}: train_batch_size {total} is not a multiple of {name} {known} x "
            f"{w} ranks; fix the file"
        )
    other = total // (known * w)
    return (micro, other) if micro is not None else (other, accum)


def _precision(r: _Reader, cfg: dict) -> None:
    """fp16/bf16 (or its older name bfloat16) enabled -> --precision. "auto" on either leaves
    --precision auto; a file whose blocks are all explicitly off asks for fp32."""
    blocks = {n: r.block(cfg, n) for n in ("fp16", "bf16", "bfloat16") if n in cfg}
    auto = default_of("precision", "precision")
    on: dict[str, bool] = {}  # explicit values only: a missing block says nothing
    for name, blk in blocks.items():
        key = f"{name}.enabled"
        v = blk.get("enabled", False)
        if not r.is_auto(v, key, auto):
            on[name] = r.bool_(v, key)
    bf16 = on.get("bf16") or on.get("bfloat16")
    if on.get("fp16") and bf16:
        raise UserError(f"{r.source}: fp16.enabled and bf16.enabled are both true; choose one")
    for name, enabled in on.items():
        if enabled:
            r.set("precision", "precision", "fp16" if name == "fp16" else "bf16", f"{name}.enabled")
        elif on.get("fp16") or bf16:
            r.same(f"{name}.enabled", "false")  # the other one is on
        elif len(on) < len(blocks):
            r.same(f"{name}.enabled", 'false; another block is "auto"')
        else:
            r.note(
                f"{name}.enabled",
                f"false, and no block is enabled: DeepSpeed would train in fp32; fitgpt's "
                f"{auto} applies, pass --precision fp32 to match",
            )
    fp16 = blocks.get("fp16", {})
    _loss_scale(r, fp16, live=on.get("fp16", True))  # the scaler's keys matter unless off
    for name in ("bf16", "bfloat16"):
        for k in blocks.get(name, {}):
            if k != "enabled":
                r.note(f"{name}.{k}", "ignored: fitgpt's bf16 keeps fp32 master weights and grads")


SCALE_KEYS = {  # fp16.KEY -> the PrecisionConfig field it sets
    "initial_scale_power": "initial_scale",
    "loss_scale_window": "growth_interval",
    "hysteresis": "hysteresis",
    "min_loss_scale": "min_scale",
}


def _loss_scale(r: _Reader, fp16: dict, live: bool) -> None:
    for k, v in fp16.items():
        key = f"fp16.{k}"
        if k == "enabled":
            continue
        if not live:
            r.note(key, "ignored: fp16 is off")
            continue
        field_ = SCALE_KEYS.get(k, "initial_scale" if k == "loss_scale" else None)
        if field_ is not None and r.is_auto(v, key, default_of("precision", field_)):
            continue
        if k == "initial_scale_power":
            r.set("precision", "initial_scale", 2.0 ** r.int_(v, key, 0), key)
        elif k in ("loss_scale_window", "hysteresis"):
            r.set("precision", SCALE_KEYS[k], r.int_(v, key), key)
        elif k == "min_loss_scale":
            r.set("precision", "min_scale", r.num(v, key), key)
        elif k == "loss_scale" and r.num(v, key) > 0:
            r.set("precision", "initial_scale", float(v), key)
            r.note(key, f"a static scale {v}: fitgpt's scale is dynamic, starting at {v}")
        elif k == "loss_scale":
            r.same(key, "0 means a dynamic scale")
        elif k == "consecutive_hysteresis":
            r.note(key, "ignored: fitgpt refills the hysteresis when the scale grows")
        else:
            r.note(key, "ignored: no fitgpt equivalent")


def _zero(r: _Reader, cfg: dict) -> None:
    z = r.block(cfg, "zero_optimization")
    if "stage" in z:
        stage = r.int_(z["stage"], "zero_optimization.stage", 0)
        if stage > 3:
            raise r.fail("zero_optimization.stage", "0, 1, 2 or 3", stage)
        r.set("engine", "engine", "zero", "zero_optimization.stage")
        r.set("engine", "zero_stage", stage, "zero_optimization.stage")
    for name in ("offload_optimizer", "offload_param"):
        path = f"zero_optimization.{name}"
        _offload(r, r.block(z, name, path), name)
    _legacy_offload(r, z)
    for k in z:
        key = f"zero_optimization.{k}"
        if k in ZERO_IGNORED:
            r.note(key, "ignored: fitgpt's chunked engine sizes its own buckets (one per block)")
        elif k in ZERO_CANNOT:
            r.note(key, "cannot honour: fitgpt has no such ZeRO variant")
        elif k not in ("stage", "offload_optimizer", "offload_param", *LEGACY_OFFLOAD):
            r.note(key, "unknown key: ignored")
    eng = r.out.values["engine"]
    if eng.get("offload_params") == "cpu" and eng.get("offload_optimizer", "none") == "none":
        eng["offload_optimizer"] = "cpu"
        r.note(
            "zero_optimization.offload_param",
            "fitgpt streams weights only of blocks whose optimizer state is offloaded: "
            "--offload-optimizer cpu added",
        )


# DeepSpeed's older booleans (before the offload_* blocks): the block they stand for.
LEGACY_OFFLOAD = {
    "cpu_offload": "offload_optimizer",
    "cpu_offload_params": "offload_param",
    "cpu_offload_use_pin_memory": "pin_memory",
}


def _legacy_offload(r: _Reader, z: dict) -> None:
    """cpu_offload / cpu_offload_params: true means the block's device cpu; the newer block
    wins where both are given (DeepSpeed reads the older keys only without it)."""
    for old, block in LEGACY_OFFLOAD.items():
        if old not in z:
            continue
        key = f"zero_optimization.{old}"
        on = r.bool_(z[old], key)
        if block == "pin_memory":
            r.note(key, "ignored: fitgpt pins and sizes its own buffers")
            continue
        if block in z:
            r.note(key, f"the older spelling of {block}, which the file also has and which wins")
            continue
        target = "offload_optimizer" if block == "offload_optimizer" else "offload_params"
        if on:
            r.set("engine", target, "cpu", key)
        else:
            r.same(key, f"false: no {block}")


def _offload(r: _Reader, blk: dict, name: str) -> None:
    """offload_optimizer -> --offload-optimizer, offload_param -> --offload-params."""
    if not blk:
        return
    path = f"zero_optimization.{name}"
    dev = blk.get("device", "none")
    if dev not in ("none", "cpu", "nvme"):
        raise r.fail(f"{path}.device", "none, cpu or nvme", dev)
    target = "offload_optimizer" if name == "offload_optimizer" else "offload_params"
    if name == "offload_param" and dev == "nvme":
        r.note(f"{path}.device", "nvme: fitgpt streams weights from host RAM: cpu")
        dev = "cpu"
    r.set("engine", target, dev, f"{path}.device")
    for k, v in blk.items():
        key = f"{path}.{k}"
        if k == "device":
            continue
        if k == "nvme_path" and dev == "nvme":
            if not isinstance(v, str) or not v:
                raise r.fail(key, "a folder path", v)
            r.set("engine", "nvme_path", v, key)
        elif k == "nvme_path":
            r.note(key, f"ignored: the device is {dev}, not nvme")
        elif k == "ratio" and name == "offload_optimizer":
            if r.is_auto(v, key, "every block's optimizer state offloaded, or the planner's share"):
                continue
            share = r.num(v, key)
            if share > 1:
                raise r.fail(key, "a fraction in [0, 1]", v)
            r.set("engine", "offload_fraction", share, key)
        elif k == "ratio":
            r.note(key, "cannot honour: fitgpt offloads whole blocks (--offload-fraction)")
        else:
            r.note(key, "ignored: fitgpt pins and sizes its own buffers")


# DeepSpeed's Adam is AdamW unless adam_w_mode is false (noted below): fitgpt's optimizer.
ADAM_TYPES = {"adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam", "torch_adam"}
OPTIM_FIELDS = {"eps": "eps", "weight_decay": "weight_decay"}


def _optimizer(r: _Reader, cfg: dict) -> None:
    opt = r.block(cfg, "optimizer")
    if not opt:
        return
    for k in set(opt) - {"type", "params"}:
        r.note(f"optimizer.{k}", "unknown key: ignored")
    kind = opt.get("type", "")
    params = r.block(opt, "params", "optimizer.params")
    if not isinstance(kind, str) or kind.lower() not in ADAM_TYPES:
        r.note("optimizer.type", f"{kind!r} cannot be honoured: fitgpt trains with AdamW")
        if params:
            r.note("optimizer.params", f"ignored with {kind!r}")
        return
    r.same("optimizer.type", "AdamW")
    for k, v in params.items():
        _adam_param(r, k, v, f"optimizer.params.{k}")


def _adam_param(r: _Reader, k: str, v: Any, key: str) -> None:
    if k == "lr":
        if not r.is_auto(v, key, default_of("train", "lr")):
            r.set("train", "lr", r.num(v, key), key)
    elif k == "betas":
        betas = f"{default_of('optim', 'beta1')} {default_of('optim', 'beta2')}"
        if r.is_auto(v, key, betas):
            return
        if not (isinstance(v, list) and len(v) == 2):
            raise r.fail(key, "[beta1, beta2]", v)
        r.set("optim", "beta1", r.num(v[0], key), key)
        r.set("optim", "beta2", r.num(v[1], key), key)
    elif k in OPTIM_FIELDS:
        if not r.is_auto(v, key, default_of("optim", OPTIM_FIELDS[k])):
            r.set("optim", OPTIM_FIELDS[k], r.num(v, key), key)
    elif k == "adam_w_mode":
        if r.bool_(v, key):
            r.same(key, "true, decoupled weight decay")
        else:
            r.note(key, "false (L2 in the gradient) cannot be honoured: fitgpt decays decoupled")
    elif k == "bias_correction":
        if r.bool_(v, key):
            r.same(key, "true, bias correction")
        else:
            r.note(key, "false is not supported: fitgpt's AdamW always corrects bias")
    elif k == "amsgrad" and v:
        r.note(key, "true is not supported: fitgpt's AdamW has no AMSGrad")
    elif k == "amsgrad":
        r.same(key, "false, no AMSGrad")
    elif k in ("torch_adam", "fused", "foreach", "set_grad_none", "fp32_optimizer_states"):
        r.note(key, "ignored: fitgpt's AdamW is torch's fused one, with fp32 state")
    else:
        r.note(key, "unknown AdamW parameter: ignored")


SCHEDULER_PARAMS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
    "WarmupDecayLR": {
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
    },
    "WarmupCosineLR": {
        "total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
    },
}  # fmt: skip


def _scheduler(r: _Reader, cfg: dict, explicit: dict[str, dict]) -> None:
    sch = r.block(cfg, "scheduler")
    if not sch:
        return
    for k in set(sch) - {"type", "params"}:
        r.note(f"scheduler.{k}", "unknown key: ignored")
    kind, p = sch.get("type"), r.block(sch, "params", "scheduler.params")
    if kind not in SCHEDULER_PARAMS:
        r.note("scheduler.type", f"{kind!r} cannot be honoured: fitgpt warms up, then cosine")
        if p:
            r.note("scheduler.params", f"ignored with {kind!r}")
        return
    r.same("scheduler.type", kind)
    got = {k: v for k, v in p.items() if not _scheduler_auto(r, k, v)}
    if "warmup_num_steps" in got:
        key = "scheduler.params.warmup_num_steps"
        r.set("train", "warmup", r.int_(got["warmup_num_steps"], key, 0), key)
    if got.get("warmup_type", "log") != "linear":
        r.note(
            "scheduler.params.warmup_type",
            f"{got.get('warmup_type', 'log (DeepSpeed default)')}: fitgpt warms up linearly",
        )
    elif "warmup_type" in got:
        r.same("scheduler.params.warmup_type", "linear")
    if "total_num_steps" in got:
        key = "scheduler.params.total_num_steps"
        r.set("train", "steps", r.int_(got["total_num_steps"], key), key)
    if kind == "WarmupCosineLR":
        _cosine(r, got, explicit)
    else:
        _warmup_lr(r, kind, got, explicit)
    for k in set(p) - SCHEDULER_PARAMS[kind]:
        key = f"scheduler.params.{k}"
        if k == "last_batch_iteration":
            r.note(key, "ignored: a resumed fitgpt run takes its step from the checkpoint")
        else:
            r.note(key, f"not a {kind} parameter: ignored")


def _scheduler_auto(r: _Reader, k: str, v: Any) -> bool:
    key = f"scheduler.params.{k}"
    fitgpt = {
        "warmup_num_steps": default_of("train", "warmup"),
        "total_num_steps": default_of("train", "steps"),
        "warmup_max_lr": default_of("train", "lr"),
        "warmup_min_lr": "a warm-up from 0",
        "warmup_min_ratio": "a warm-up from 0",
        "cos_min_ratio": default_of("train", "min_lr"),
        "warmup_type": "a linear warm-up",
    }.get(k, "none")
    return r.is_auto(v, key, fitgpt)


def _warmup_lr(r: _Reader, kind: str, got: dict, explicit: dict[str, dict]) -> None:
    """WarmupLR: warm up, then constant (min_lr = lr); WarmupDecayLR: then down to the min."""
    if "warmup_max_lr" in got:
        key = "scheduler.params.warmup_max_lr"
        r.set("train", "lr", r.num(got["warmup_max_lr"], key), key)
    lr = explicit["train"].get("lr", r.out.values["train"].get("lr"))
    key = "scheduler.params.warmup_min_lr"
    low = r.num(got.get("warmup_min_lr", 0.0), key)
    if low > 0:
        r.note(key, f"{low}: fitgpt warms up from 0")
    elif "warmup_min_lr" in got:
        r.same(key, "0: fitgpt warms up from 0")
    if kind == "WarmupLR":
        if lr is not None:
            r.set("train", "min_lr", lr, "scheduler.type")  # a cosine from lr to lr: constant
        else:
            r.note("scheduler.type", "WarmupLR (constant): set --min-lr equal to --lr")
        return
    r.set("train", "min_lr", low, key)
    r.note("scheduler.type", "WarmupDecayLR decays linearly; fitgpt decays by a cosine")


def _cosine(r: _Reader, got: dict, explicit: dict[str, dict]) -> None:
    """WarmupCosineLR: ratios of the optimizer's lr; the cosine ends at cos_min_ratio · lr."""
    lr = explicit["train"].get("lr", r.out.values["train"].get("lr"))
    key = "scheduler.params.cos_min_ratio"
    ratio = r.num(got.get("cos_min_ratio", 1e-4), key)
    if lr is not None:
        r.set("train", "min_lr", ratio * lr, key)
    else:
        r.note(key, f"{ratio}: set --min-lr to {ratio} x --lr")
    key = "scheduler.params.warmup_min_ratio"
    if r.num(got.get("warmup_min_ratio", 0.0), key) > 0:
        r.note(key, "fitgpt warms up from 0")
    elif "warmup_min_ratio" in got:
        r.same(key, "0: fitgpt warms up from 0")


def _misc(r: _Reader, cfg: dict) -> None:
    key = "gradient_clipping"
    if key in cfg and not r.is_auto(cfg[key], key, default_of("optim", "grad_clip")):
        r.set("optim", "grad_clip", r.num(cfg[key], key), key)
    if "steps_per_print" in cfg:
        every = r.int_(cfg["steps_per_print"], "steps_per_print")
        if every <= MAX_LOG_EVERY:
            r.set("train", "log_every", every, "steps_per_print")
        else:
            r.note(
                "steps_per_print",
                f"{every} not taken as --log-every (above {MAX_LOG_EVERY}, it would hide "
                f"progress): fitgpt's {default_of('train', 'log_every')} applies; pass "
                "--log-every to change it",
            )
    ac = r.block(cfg, "activation_checkpointing")
    if "activation_checkpointing" in cfg:
        key = "activation_checkpointing.cpu_checkpointing"
        cpu = r.bool_(ac.get("cpu_checkpointing", False), key)
        r.set("engine", "checkpointing", "cpu" if cpu else "full", "activation_checkpointing")
        for k in set(ac) - {"cpu_checkpointing"}:
            r.note(f"activation_checkpointing.{k}", "ignored: fitgpt checkpoints every block")


HANDLED_TOP = {
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
    "fp16", "bf16", "bfloat16", "zero_optimization", "optimizer", "scheduler",
    "gradient_clipping", "steps_per_print", "activation_checkpointing",
}  # fmt: skip


def map_deepspeed(
    cfg: dict, source: str, world: int = 1, explicit: dict[str, dict] | None = None
) -> DeepSpeedFlags:
    """fitgpt field values for DeepSpeed config `cfg` (read from `source`), and the notes."""
    explicit = {p: dict((explicit or {}).get(p, {})) for p in PARTS}
    r = _Reader(source, world)
    _batch(r, cfg, explicit)
    _precision(r, cfg)
    _zero(r, cfg)
    _optimizer(r, cfg)
    _scheduler(r, cfg, explicit)
    _misc(r, cfg)
    for k in cfg:
        if k in IGNORED_TOP:
            r.note(k, f"ignored: {IGNORED_TOP[k]}")
        elif k in CANNOT_TOP:
            r.note(k, f"cannot honour: {CANNOT_TOP[k]}")
        elif k not in HANDLED_TOP:
            r.note(k, "unknown key: ignored")
    return r.out


def read_deepspeed_config(path: Path) -> dict:
    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"--deepspeed-config {path}: cannot read it ({e.strerror})") from e
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8 (ValueErrors), too deep
        raise UserError(f"--deepspeed-config {path}: not valid JSON ({e}); fix the file") from None
    if not isinstance(cfg, dict):
        raise UserError(f"--deepspeed-config {path}: expected a JSON object at the top level")
    return cfg


def apply_deepspeed_config(
    path: str | Path, explicit_flags: dict[str, dict], world: int | None = None
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(field values per RunConfig part that the flags did not set, note lines).

    `explicit_flags` maps a part ("train", "engine", "precision", "optim") to the fields the
    user typed; those win over the file, and each override is named in a note."""
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    flags = map_deepspeed(read_deepspeed_config(Path(path)), str(path), world, explicit_flags)
    changes: dict[str, dict[str, Any]] = {p: {} for p in PARTS}
    notes = [n.line() for n in flags.notes]
    same = [k for k, why in flags.mapped.items() if why.startswith("as fitgpt does")]
    if same:
        notes.append(f"{', '.join(same)}: as fitgpt does anyway, no flag needed")
    for part, values in flags.values.items():
        for name, value in values.items():
            typed = explicit_flags.get(part, {})
            if name in typed:
                if typed[name] != value:
                    notes.append(
                        f"{flag(name)}: yours ({typed[name]}) wins over the file's ({value})"
                    )
                continue
            changes[part][name] = value
    return changes, notes
