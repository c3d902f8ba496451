"""A DeepSpeed JSON config read as fitgpt flags.

Users migrating from DeepSpeed have a ds_config.json. `map_deepspeed` turns the keys with a
fitgpt equivalent into config-field values (the same fields the flags set) and names every other
key, with the reason, in a note; `apply_deepspeed_config` lets the flags typed on the command
line win over the file. The table of what maps where is in docs/interop.md.

"auto" values (the HF Trainer fills them from its own arguments) are left to fitgpt's defaults
or the flags given, and named in one note.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitgpt.errors import UserError

PARTS = ("train", "engine", "precision", "optim")  # the RunConfig parts a DeepSpeed file reaches


@dataclass(frozen=True)
class Note:
    """A key of the file that was ignored or cannot be honoured, and why."""

    key: str
    reason: str

    def line(self) -> str:
        return f"{self.key}: {self.reason}"


@dataclass
class DeepSpeedFlags:
    """Field values per RunConfig part ("train", "engine", "precision", "optim"), and notes."""

    values: dict[str, dict[str, Any]] = field(default_factory=lambda: {p: {} for p in PARTS})
    notes: list[Note] = field(default_factory=list)
    auto: list[str] = field(default_factory=list)  # keys whose value was "auto"


# Keys that only tune DeepSpeed's own machinery: fitgpt's engine has its own (or no) knob.
IGNORED_TOP = {
    "wall_clock_breakdown": "timing breakdown: fitgpt logs step time, tokens/s and MFU anyway",
    "memory_breakdown": "fitgpt logs memory per step anyway",
    "dump_state": "a DeepSpeed debugging aid",
    "flops_profiler": "fitgpt logs TFLOP/s and MFU every log line",
    "tensorboard": "fitgpt writes metrics.jsonl (fitgpt report plots it)",
    "wandb": "fitgpt writes metrics.jsonl (fitgpt report plots it)",
    "csv_monitor": "fitgpt writes metrics.jsonl (fitgpt report plots it)",
    "comms_logger": "a DeepSpeed profiling aid",
    "prescale_gradients": "fitgpt averages gradients in fp32 in its own order",
    "gradient_predivide_factor": "fitgpt averages gradients in fp32 in its own order",
    "communication_data_type": "fitgpt reduces gradients in its own precision",
    "zero_allow_untested_optimizer": "fitgpt always uses its AdamW",
    "zero_force_ds_cpu_optimizer": "fitgpt's host optimizer is torch's AdamW",
    "aio": "fitgpt's NVMe tier does its own I/O (--nvme-path)",
    "checkpoint": "fitgpt's checkpoints are its own (--save-every, --keep)",
    "data_types": "fitgpt accumulates gradients in fp32",
    "seed": "pass --seed",
    "sparse_gradients": "fitgpt has no sparse embeddings",
}
CANNOT_TOP = {
    "pipeline": "fitgpt has no pipeline parallelism",
    "amp": "apex AMP: use --precision bf16 or fp16",
    "elasticity": "fitgpt has no elastic batch sizing",
    "compression_training": "fitgpt trains no compressed models",
    "quantize_training": "fitgpt trains no quantized models",
    "autotuning": "use --plan auto (fitgpt's planner) instead",
    "sequence_parallel_size": "fitgpt has no sequence parallelism",
    "curriculum_learning": "fitgpt has no curriculum learning",
    "data_efficiency": "fitgpt has no data-efficiency pipeline",
    "hybrid_engine": "fitgpt has no RLHF hybrid engine",
}
ZERO_IGNORED = {
    "overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
    "allgather_partitions", "allgather_bucket_size", "round_robin_gradients", "sub_group_size",
    "elastic_checkpoint", "load_from_fp32_weights", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
    "memory_efficient_linear", "cpu_offload", "use_multi_rank_bucket_allreduce",
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

    def block(self, cfg: dict, key: str) -> dict:
        v = cfg.get(key, {})
        if not isinstance(v, dict):
            raise self.fail(key, "a JSON object", v)
        return v

    def is_auto(self, v: Any, key: str) -> bool:
        if v == "auto":
            self.out.auto.append(key)
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

    def set(self, part: str, name: str, value: Any) -> None:
        self.out.values[part][name] = value

    def note(self, key: str, reason: str) -> None:
        self.out.notes.append(Note(key, reason))


# ---- the sections ------------------------------------------------------------------------------
def _batch(r: _Reader, cfg: dict, explicit: dict[str, dict]) -> None:
    """micro × accum × world = train_batch_size, as DeepSpeed defines it; missing ones derived."""
    keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    got = {k: cfg[k] for k in keys if k in cfg and not r.is_auto(cfg[k], k)}
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
    if micro is not None:
        r.set("train", "micro_batch", micro)
    if accum is not None:
        r.set("train", "grad_accum", accum)


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
    fp16, bf16 = r.block(cfg, "fp16"), r.block(cfg, "bf16") or r.block(cfg, "bfloat16")
    on = {}  # only the blocks the file has: a file without either says nothing about precision
    for name, blk in (("fp16", fp16), ("bf16", bf16)):
        v = blk.get("enabled", False)
        if blk and not r.is_auto(v, f"{name}.enabled"):
            on[name] = r.bool_(v, f"{name}.enabled")
    if on.get("fp16") and on.get("bf16"):
        raise UserError(f"{r.source}: fp16.enabled and bf16.enabled are both true; choose one")
    if on.get("fp16") or on.get("bf16"):
        r.set("precision", "precision", "fp16" if on.get("fp16") else "bf16")
    elif on:
        r.note(
            "fp16/bf16",
            "neither enabled: DeepSpeed would train in fp32; fitgpt's --precision auto (bf16 "
            "on GPUs) applies, pass --precision fp32 to match",
        )
    if on.get("fp16", True):  # the scaler's keys matter when fp16 is on, or "auto"
        _loss_scale(r, fp16)
    for k in bf16:
        if k != "enabled":
            r.note(f"bf16.{k}", "ignored: fitgpt's bf16 keeps fp32 master weights and gradients")


def _loss_scale(r: _Reader, fp16: dict) -> None:
    for k, v in fp16.items():
        key = f"fp16.{k}"
        if k == "enabled" or r.is_auto(v, key):
            continue
        if k == "initial_scale_power":
            r.set("precision", "initial_scale", 2.0 ** r.int_(v, key, 0))
        elif k == "loss_scale_window":
            r.set("precision", "growth_interval", r.int_(v, key))
        elif k == "hysteresis":
            r.set("precision", "hysteresis", r.int_(v, key))
        elif k == "min_loss_scale":
            r.set("precision", "min_scale", r.num(v, key))
        elif k == "loss_scale" and r.num(v, key) > 0:
            r.set("precision", "initial_scale", float(v))
            r.note(key, f"a static scale {v}: fitgpt's scale is dynamic, starting at {v}")
        elif k == "loss_scale":
            continue  # 0 means dynamic, which is what fitgpt does
        elif k == "consecutive_hysteresis":
            r.note(key, "ignored: fitgpt refills the hysteresis when the scale grows")
        else:
            r.note(key, "ignored: no fitgpt equivalent")


def _zero(r: _Reader, cfg: dict) -> None:
    z = r.block(cfg, "zero_optimization")
    if "stage" in z:
        r.set("engine", "engine", "zero")
        stage = r.int_(z["stage"], "zero_optimization.stage", 0)
        if stage > 3:
            raise r.fail("zero_optimization.stage", "0, 1, 2 or 3", stage)
        r.set("engine", "zero_stage", stage)
    _offload(r, r.block(z, "offload_optimizer"), "offload_optimizer")
    _offload(r, r.block(z, "offload_param"), "offload_param")
    for k in z:
        key = f"zero_optimization.{k}"
        if k in ZERO_IGNORED:
            r.note(key, "ignored: fitgpt's chunked engine sizes its own buckets (one per block)")
        elif k in ZERO_CANNOT:
            r.note(key, "cannot honour: fitgpt has no such ZeRO variant")
        elif k not in ("stage", "offload_optimizer", "offload_param"):
            r.note(key, "unknown key: ignored")
    eng = r.out.values["engine"]
    if eng.get("offload_params") == "cpu" and eng.get("offload_optimizer", "none") == "none":
        eng["offload_optimizer"] = "cpu"
        r.note(
            "offload_param",
            "fitgpt streams weights only of blocks whose optimizer state is offloaded: "
            "--offload-optimizer cpu added",
        )


def _offload(r: _Reader, blk: dict, name: str) -> None:
    """offload_optimizer -> --offload-optimizer, offload_param -> --offload-params."""
    if not blk:
        return
    dev = blk.get("device", "none")
    if dev not in ("none", "cpu", "nvme"):
        raise r.fail(f"zero_optimization.{name}.device", "none, cpu or nvme", dev)
    target = "offload_optimizer" if name == "offload_optimizer" else "offload_params"
    if name == "offload_param" and dev == "nvme":
        r.note(
            f"zero_optimization.{name}.device", "nvme: fitgpt streams weights from host RAM: cpu"
        )
        dev = "cpu"
    r.set("engine", target, dev)
    for k, v in blk.items():
        key = f"zero_optimization.{name}.{k}"
        if k == "nvme_path" and dev == "nvme":
            if not isinstance(v, str) or not v:
                raise r.fail(key, "a folder path", v)
            r.set("engine", "nvme_path", v)
        elif k == "ratio" and name == "offload_optimizer" and not r.is_auto(v, key):
            share = r.num(v, key)
            if share > 1:
                raise r.fail(key, "a fraction in [0, 1]", v)
            r.set("engine", "offload_fraction", share)
        elif k == "ratio":
            r.note(key, "cannot honour: fitgpt offloads whole blocks (--offload-fraction)")
        elif k not in ("device", "nvme_path"):
            r.note(key, "ignored: fitgpt pins and sizes its own buffers")


# DeepSpeed's Adam is AdamW unless adam_w_mode is false (noted below): fitgpt's optimizer.
ADAM_TYPES = {"adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam", "torch_adam"}


def _optimizer(r: _Reader, cfg: dict) -> None:
    opt = r.block(cfg, "optimizer")
    if not opt:
        return
    kind = opt.get("type", "")
    if not isinstance(kind, str) or kind.lower() not in ADAM_TYPES:
        r.note("optimizer.type", f"{kind!r} cannot be honoured: fitgpt trains with AdamW")
        return
    params = r.block(opt, "params")
    for k, v in params.items():
        key = f"optimizer.params.{k}"
        if r.is_auto(v, key):
            continue
        if k == "lr":
            r.set("train", "lr", r.num(v, key))
        elif k == "betas":
            if not (isinstance(v, list) and len(v) == 2):
                raise r.fail(key, "[beta1, beta2]", v)
            r.set("optim", "beta1", r.num(v[0], key))
            r.set("optim", "beta2", r.num(v[1], key))
        elif k == "eps":
            r.set("optim", "eps", r.num(v, key))
        elif k == "weight_decay":
            r.set("optim", "weight_decay", r.num(v, key))
        elif k == "adam_w_mode" and v is False:
            r.note(key, "false (L2 in the gradient) cannot be honoured: fitgpt decays decoupled")
        else:
            r.note(key, "ignored: fitgpt's AdamW is torch's fused one")


def _scheduler(r: _Reader, cfg: dict, explicit: dict[str, dict]) -> None:
    sch = r.block(cfg, "scheduler")
    if not sch:
        return
    kind, p = sch.get("type"), r.block(sch, "params")
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        r.note("scheduler.type", f"{kind!r} cannot be honoured: fitgpt warms up, then cosine")
        return
    got = {k: v for k, v in p.items() if not r.is_auto(v, f"scheduler.params.{k}")}
    if "warmup_num_steps" in got:
        r.set(
            "train",
            "warmup",
            r.int_(got["warmup_num_steps"], "scheduler.params.warmup_num_steps", 0),
        )
    if got.get("warmup_type", "log") != "linear":
        r.note(
            "scheduler.params.warmup_type", "log (DeepSpeed's default): fitgpt warms up linearly"
        )
    if "total_num_steps" in got:
        r.set("train", "steps", r.int_(got["total_num_steps"], "scheduler.params.total_num_steps"))
    if kind == "WarmupCosineLR":
        _cosine(r, got, explicit)
    else:
        _warmup_lr(r, kind, got, explicit)
    known = {"warmup_num_steps", "warmup_type", "total_num_steps", "warmup_min_lr"}
    known |= {"warmup_max_lr", "warmup_min_ratio", "cos_min_ratio", "last_batch_iteration"}
    for k in set(p) - known:
        r.note(f"scheduler.params.{k}", "unknown key: ignored")


def _warmup_lr(r: _Reader, kind: str, got: dict, explicit: dict[str, dict]) -> None:
    """WarmupLR: warm up, then constant (min_lr = lr); WarmupDecayLR: then down to the min."""
    if "warmup_max_lr" in got:
        r.set("train", "lr", r.num(got["warmup_max_lr"], "scheduler.params.warmup_max_lr"))
    lr = explicit["train"].get("lr", r.out.values["train"].get("lr"))
    low = r.num(got.get("warmup_min_lr", 0.0), "scheduler.params.warmup_min_lr")
    if low > 0:
        r.note("scheduler.params.warmup_min_lr", f"{low}: fitgpt warms up from 0")
    if kind == "WarmupLR":
        if lr is not None:
            r.set("train", "min_lr", lr)  # a cosine from lr to lr: constant after the warm-up
        else:
            r.note("scheduler.type", "WarmupLR (constant): set --min-lr equal to --lr")
        return
    r.set("train", "min_lr", low)
    r.note("scheduler.type", "WarmupDecayLR decays linearly; fitgpt decays by a cosine")


def _cosine(r: _Reader, got: dict, explicit: dict[str, dict]) -> None:
    """WarmupCosineLR: ratios of the optimizer's lr; the cosine ends at cos_min_ratio · lr."""
    lr = explicit["train"].get("lr", r.out.values["train"].get("lr"))
    ratio = r.num(got.get("cos_min_ratio", 1e-4), "scheduler.params.cos_min_ratio")
    if lr is not None:
        r.set("train", "min_lr", ratio * lr)
    else:
        r.note("scheduler.params.cos_min_ratio", f"{ratio}: set --min-lr to {ratio} x --lr")
    if r.num(got.get("warmup_min_ratio", 0.0), "scheduler.params.warmup_min_ratio") > 0:
        r.note("scheduler.params.warmup_min_ratio", "fitgpt warms up from 0")


def _misc(r: _Reader, cfg: dict) -> None:
    if "gradient_clipping" in cfg and not r.is_auto(cfg["gradient_clipping"], "gradient_clipping"):
        r.set("optim", "grad_clip", r.num(cfg["gradient_clipping"], "gradient_clipping"))
    if "steps_per_print" in cfg:
        r.set("train", "log_every", r.int_(cfg["steps_per_print"], "steps_per_print"))
    ac = r.block(cfg, "activation_checkpointing")
    if "activation_checkpointing" in cfg:
        cpu = r.bool_(
            ac.get("cpu_checkpointing", False), "activation_checkpointing.cpu_checkpointing"
        )
        r.set("engine", "checkpointing", "cpu" if cpu else "full")
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
    if r.out.auto:
        r.note(
            ", ".join(r.out.auto),
            '"auto" (filled by the HF Trainer from its arguments): fitgpt\'s defaults or your '
            "flags apply",
        )
    return r.out


def read_deepspeed_config(path: Path) -> dict:
    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"--deepspeed-config {path}: cannot read it ({e.strerror})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"--deepspeed-config {path}: not valid JSON ({e}); fix the file") from e
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
    for part, values in flags.values.items():
        for name, value in values.items():
            typed = explicit_flags.get(part, {})
            if name in typed:
                if typed[name] != value:
                    flag = "--" + name.replace("_", "-")
                    notes.append(f"{flag}: yours ({typed[name]}) wins over the file's ({value})")
                continue
            changes[part][name] = value
    return changes, notes
