"""The benchmark protocol as a config (../shared/ANCHORS.md's unless a flag changes it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from fitgpt.errors import UserError
from fitgpt.model import ModelConfig


@dataclass(frozen=True)
class BenchConfig:
    hidden: int = field(default=4096, metadata={"help": "hidden size of every model in the sweep"})
    heads: int = field(default=32, metadata={"help": "attention heads"})
    seq_len: int = field(default=1024, metadata={"help": "tokens per sequence"})
    vocab_size: int = field(default=50257, metadata={"help": "vocabulary (padded to 50304)"})
    micro_batch: int = field(default=8, metadata={"help": "sequences per micro-batch per GPU"})
    grad_accum: int = field(default=4, metadata={"help": "micro-batches per optimizer step"})
    tie_embeddings: bool = field(
        default=False,
        metadata={
            "help": "share the input embedding with the output head (the benchmark protocol "
            "unties them)"
        },
    )
    checkpointing: str = field(
        default="full", metadata={"help": "activation checkpointing of every system: full or off"}
    )
    compile: Literal["auto", "on", "off", "blocks", "model"] = field(
        default="auto",
        metadata={
            "help": "fitgpt's systems: --compile of `fitgpt train` (compiled blocks and head); "
            "auto decides as train does, which for a sweep's few steps is off"
        },
    )
    warmup: int = field(default=2, metadata={"help": "optimizer steps before timing starts"})
    steps: int = field(default=4, metadata={"help": "timed optimizer steps (median reported)"})
    time_limit: float = field(
        default=900.0, metadata={"help": "seconds per trial before it is killed"}
    )
    seed: int = field(default=0, metadata={"help": "seed of weights and random tokens"})
    nvme_path: str = field(
        default="",
        metadata={
            "help": "folder on a fast disk for fitgpt's optimizer state in files (--offload-optimizer nvme)"
        },
    )

    def __post_init__(self) -> None:
        for k in ("hidden", "heads", "seq_len", "micro_batch", "grad_accum", "steps"):
            if getattr(self, k) < 1:
                raise UserError(f"--{k.replace('_', '-')} must be at least 1")
        if self.compile not in ("auto", "on", "off", "blocks", "model"):
            raise UserError(f"--compile {self.compile!r}: use auto, on, off, blocks or model")
        if self.checkpointing not in ("full", "off"):
            raise UserError(f"--checkpointing {self.checkpointing!r}: use full or off")
        if self.warmup < 0 or self.time_limit <= 0:
            raise UserError("--warmup must be >= 0 and --time-limit > 0")

    def model(self, layers: int) -> ModelConfig:
        return ModelConfig(
            n_layer=layers,
            n_embd=self.hidden,
            n_head=self.heads,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            tie_embeddings=self.tie_embeddings,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def parse_sizes(spec: str, cfg: BenchConfig) -> list[int]:
    """'1,4,8' layer counts, or '0.6b,2b,4.4b' parameter targets (the nearest layer count)."""
    out = []
    for tok in spec.split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        try:
            if tok.endswith(("b", "m")):
                target = float(tok[:-1]) * (1e9 if tok.endswith("b") else 1e6)
                per_layer = cfg.model(2).num_params() - cfg.model(1).num_params()
                fixed = cfg.model(1).num_params() - per_layer  # embeddings, head, final norm
                out.append(max(1, round((target - fixed) / per_layer)))
            else:
                out.append(int(tok))
        except ValueError as e:
            raise UserError(
                f"--sizes {spec!r}: {tok!r} is neither a layer count nor like 2.5b"
            ) from e
    if not out or min(out) < 1:
        raise UserError(f"--sizes {spec!r}: give positive layer counts or sizes like 0.6b,2b")
    return sorted(set(out))
