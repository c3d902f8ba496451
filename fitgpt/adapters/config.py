"""AdapterConfig: a run's LoRA adapters as the --lora-* flags ask for them (a RunConfig part,
saved in every checkpoint). Each field is checked here; the targets against the model's family
where the run is settled (plan/adapter.py, through targets.py)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from fitgpt.errors import UserError

ALL_LINEAR = "all-linear"
PEFT_CONFIG_FILE = "adapter_config.json"  # a PEFT folder's adapter, read by peft.py
BASE_FORMATS = ("fp32", "bf16", "int8", "nf4")  # engine/formats/frozen_base.py holds them
# where the frozen base lives and in what format: the run's placement, free to change on a resume
PLACEMENT = (
    "base_format",
    "base_host_blocks",
    "base_disk_blocks",
    "base_sharded",
    "checkpointing_planned",
    "keep_planned",
)
# a Hugging Face module name or the end of one: layers.0.self_attn.q_proj, c_attn
_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA as PEFT defines it (fitgpt/adapters/__init__.py); off unless --lora-rank (or
    --lora-from) is given."""

    lora_rank: int | None = field(
        default=None,
        metadata={
            "help": "train LoRA adapters of rank R on the frozen --init-from model instead of "
            "the whole model: each targeted linear W gets W + (alpha/R)·B·A, A [R, in] and "
            "B [out, R] trained, W never changed (docs/adapters.md)"
        },
    )
    lora_alpha: float | None = field(
        default=None,
        metadata={
            "help": "LoRA's alpha: the update B·A is scaled by alpha/R",
            "default_text": "2 × --lora-rank",
        },
    )
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "dropout on each adapter's input, in [0, 1) (the base sees none)"},
    )
    lora_targets: str = field(
        default=ALL_LINEAR,
        metadata={
            "help": "the linears adapted, by their Hugging Face module names as PEFT's "
            "target_modules: all-linear (every linear of the blocks), or names such as "
            "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (GPT-2: c_attn,c_proj,"
            "c_fc); a name matches a module it ends"
        },
    )
    lora_rslora: bool = field(
        default=False,
        metadata={"help": "rank-stabilised LoRA: scale by alpha/sqrt(R) instead of alpha/R"},
    )
    lora_from: str = field(
        default="",
        metadata={
            "help": "a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) "
            "of the --init-from model to go on training: its rank, alpha, targets and rsLoRA "
            "are the folder's"
        },
    )
    base_format: str = field(
        default="auto",
        metadata={
            "help": "how the frozen base's blocks are held: fp32, bf16, int8 (per-row absmax) "
            "or nf4 (QLoRA's NormalFloat4, double-quantised, bitsandbytes' bytes); each block "
            "is unpacked to the compute dtype while it runs. auto: bf16 under bf16/fp16 "
            "precision, fp32 under fp32",
        },
    )
    base_host_blocks: int | None = field(
        default=None,
        metadata={
            "help": "how many of the frozen base's blocks (the last ones) live in pinned host "
            "RAM and are streamed to the GPU block by block, copies overlapped with compute; "
            "default: the planner's choice (none if the base fits on the GPU)",
            "default_text": "planned",
        },
    )
    base_disk_blocks: int | None = field(
        default=None,
        metadata={
            "help": "of the blocks in host RAM (--base-host-blocks), how many (the last ones) "
            "live in files under --nvme-path instead, read ahead into pinned staging buffers "
            "and streamed the same way (for capacity: a disk reads ~2 GB/s); default: the "
            "planner's choice (none unless host RAM is short and --nvme-path is given)",
            "default_text": "planned",
        },
    )
    base_sharded: bool | None = field(
        default=None,
        metadata={
            "help": "shard the frozen base's blocks over the data-parallel ranks, each holding "
            "1/N of every block's bytes (on its tier) and all-gathering a block as it runs; "
            "default: the planner's choice (only where the whole base per rank does not fit)",
            "default_text": "planned",
        },
    )
    # whether the base's planner may turn activation checkpointing on (--checkpointing not
    # given under --plan auto): set where the run is settled (plan/adapter.py adapter_placement)
    checkpointing_planned: bool = field(default=False, metadata={"cli": False})
    # whether it may choose --keep-activations under checkpointing full (the flag not given)
    keep_planned: bool = field(default=False, metadata={"cli": False})

    def __post_init__(self) -> None:
        r = self.lora_rank
        if r is None:
            given = [f.name for f in fields(self) if getattr(self, f.name) != f.default]
            if given:
                raise UserError(
                    f"{flag(given[0])} sets a LoRA adapter, and LoRA is off: add --lora-rank R "
                    "(or --lora-from a PEFT adapter folder)"
                )
            return
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise UserError(f"--lora-rank {r!r} must be a whole number >= 1, e.g. 16")
        a = self.lora_alpha
        if a is not None and (isinstance(a, bool) or not math.isfinite(a) or a <= 0):
            raise UserError(f"--lora-alpha {a!r} must be a positive number, e.g. {2 * r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise UserError(f"--lora-dropout {self.lora_dropout!r} must lie in [0, 1)")
        names = self.lora_targets.split(",")
        bad = [n for n in names if n != ALL_LINEAR and not _NAME.fullmatch(n)]
        if bad or (ALL_LINEAR in names and len(names) > 1):
            what = f"{bad[0]!r} is no module name" if bad else f"{ALL_LINEAR} stands alone"
            raise UserError(
                f"--lora-targets {self.lora_targets!r}: {what}; pass {ALL_LINEAR}, or module "
                "names separated by commas (q_proj,v_proj)"
            )
        if self.base_format not in ("auto", *BASE_FORMATS):
            raise UserError(
                f"--base-format {self.base_format!r}: use auto, {', '.join(BASE_FORMATS)}"
            )
        for name in ("base_host_blocks", "base_disk_blocks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise UserError(f"{flag(name)} {v!r} must be a whole number >= 0")

    @property
    def active(self) -> bool:
        """Whether the run trains adapters (a frozen base) rather than the whole model."""
        return self.lora_rank is not None

    @property
    def alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def scale(self) -> float:
        """s in W + s·B·A: alpha/r, or alpha/sqrt(r) (rsLoRA), as PEFT computes it."""
        r = self.lora_rank
        return self.alpha / math.sqrt(r) if self.lora_rslora else self.alpha / r

    @property
    def targets_given_by(self) -> str:
        """Where the target names come from, for a line refusing one: the flag, or the
        --lora-from folder's adapter_config.json."""
        if self.lora_from:
            return f"{Path(self.lora_from) / PEFT_CONFIG_FILE}: target_modules"
        return "--lora-targets"

    @property
    def target_names(self) -> tuple[str, ...] | None:
        """The module names asked for; None: all-linear."""
        return None if self.lora_targets == ALL_LINEAR else tuple(self.lora_targets.split(","))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def same(name: str, a, b) -> bool:
    """Two values of field `name` that ask for the same adapter (targets in any order)."""
    if name == "lora_targets" and isinstance(a, str) and isinstance(b, str):
        return set(a.split(",")) == set(b.split(","))
    return a == b


def resumed_adapter(saved: dict, asked: dict, ckpt: Path) -> AdapterConfig:
    """The adapter of a resumed run: the checkpoint's; a flag given again must agree, except
    --lora-dropout (a training choice). The checkpoint holds the adapters themselves, so
    --lora-from is refused, as is an adapter asked of a run that trained the whole model."""
    known = {f.name for f in fields(AdapterConfig)}
    old = AdapterConfig(**{k: v for k, v in saved.items() if k in known})
    if "lora_from" in asked:
        raise UserError(
            f"--resume: {ckpt} holds its adapters; drop --lora-from (a new run starts from a "
            "PEFT folder with --init-from and --lora-from)"
        )
    for name, value in asked.items():
        had = old.alpha if name == "lora_alpha" and old.active else getattr(old, name)
        if name != "lora_dropout" and name not in PLACEMENT and not same(name, value, had):
            what = f"with {flag(name)} {had}" if old.active else "the whole model, no adapters"
            raise UserError(
                f"--resume: {ckpt} was trained {what}, this command asks {flag(name)} {value}; "
                "drop the flag to continue that run, or start a new run with another --out"
            )
    if "lora_dropout" in asked and not old.active:
        raise UserError(f"--resume: {ckpt} trained the whole model: drop --lora-dropout")
    # the base's format is the checkpoint's unless asked (the adapters trained on its values);
    # its tiers are placed again for this machine (plan/adapter.py). A shape field asked again
    # agrees (checked above): the checkpoint's spelling is kept (--lora-alpha 8 at rank 4 is
    # its unset alpha), so the resume's line of changes (train/resume.py) does not name it.
    kept = {k: getattr(old, k) for k in known if k not in PLACEMENT[1:]}
    changeable = {k: v for k, v in asked.items() if k == "lora_dropout" or k in PLACEMENT}
    return AdapterConfig(**{**kept, **changeable})
