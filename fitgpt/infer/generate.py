"""Sampling from a trained checkpoint: KV cache, temperature, top-k, top-p."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from fitgpt.data.tokenizer import Tokenizer, load_tokenizer
from fitgpt.engine.layout import chunk_layout
from fitgpt.engine.state_io import StateReader
from fitgpt.errors import UserError
from fitgpt.model import GPT, KVCache, ModelConfig
from fitgpt.train import checkpoint as ckpt_io


@dataclass(frozen=True)
class SampleConfig:
    max_new_tokens: int = field(default=200, metadata={"help": "tokens to generate"})
    temperature: float = field(default=0.8, metadata={"help": "0 = greedy"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens (0 = all)"})
    top_p: float = field(
        default=1.0, metadata={"help": "keep the smallest set with this much probability"}
    )
    seed: int = field(default=0, metadata={"help": "sampling seed"})

    def __post_init__(self) -> None:
        if (
            self.max_new_tokens < 1
            or self.temperature < 0
            or self.top_k < 0
            or not 0 < self.top_p <= 1
        ):
            raise UserError(
                "need --max-new-tokens >= 1, --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1"
            )


def load_model(path: Path, device: torch.device) -> tuple[GPT, dict]:
    """The checkpoint's weights in a plain GPT on `device` (bf16 on GPUs, fp32 on CPUs), read
    with the trainer's checks: checksums, sizes, the layout against the model's own, CRCs."""
    ckpt = ckpt_io.resolve(path)
    meta = ckpt_io.load_meta(ckpt)
    cfg = ModelConfig.from_dict(meta["config"]["model"])
    with torch.device("meta"):
        model = GPT(cfg)
    layout = chunk_layout(model)  # the model's own layout: a tampered one cannot load
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    with ckpt_io.pointing_back(ckpt), torch.no_grad():
        ckpt_io.check_layout(meta, layout, ckpt)
        reader = StateReader(ckpt)
        for c in layout:
            flat = reader.read(c.index, "master", 0, c.numel)
            for s in c.slots:
                params[s.name].copy_(flat[s.offset : s.offset + s.numel].view(s.shape))
    return model.eval(), meta


def tokenizer_for(meta: dict, override: str | None) -> Tokenizer:
    spec = override or meta.get("tokenizer")
    if spec is None:
        raise UserError(
            "this checkpoint was trained without a tokenizer (synthetic data); pass --tokenizer"
        )
    return load_tokenizer(spec)


def filter_logits(logits_BV: Tensor, top_k: int, top_p: float) -> Tensor:
    if top_k:
        kth = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1])).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_l, order = torch.sort(logits_BV, descending=True)
        cum = sorted_l.softmax(-1).cumsum(-1)
        drop = cum - sorted_l.softmax(-1) > top_p  # keep the token that crosses top_p
        sorted_l = sorted_l.masked_fill(drop, float("-inf"))
        logits_BV = torch.full_like(logits_BV, float("-inf")).scatter(-1, order, sorted_l)
    return logits_BV


def pick(logits_BV: Tensor, cfg: SampleConfig, gen: torch.Generator) -> Tensor:
    logits_BV = logits_BV.float()
    if cfg.temperature == 0:
        return logits_BV.argmax(-1, keepdim=True)
    probs = filter_logits(logits_BV / cfg.temperature, cfg.top_k, cfg.top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=gen)


@torch.no_grad()
def generate(model: GPT, idx_BT: Tensor, cfg: SampleConfig, use_cache: bool = True) -> Tensor:
    """Prompt plus new tokens, [B, T + new]. Generation stops at the model's context length."""
    S = model.cfg.seq_len
    if idx_BT.shape[1] >= S:
        idx_BT = idx_BT[:, -(S - 1) :]  # keep the end of a long prompt
    gen = torch.Generator(device=idx_BT.device).manual_seed(cfg.seed)
    steps = min(cfg.max_new_tokens, S - idx_BT.shape[1])
    if not use_cache:
        for _ in range(steps):
            nxt = pick(model(idx_BT)[:, -1], cfg, gen)
            idx_BT = torch.cat([idx_BT, nxt], dim=1)
        return idx_BT
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.cfg, idx_BT.shape[0], idx_BT.device, dtype)
    logits = model(idx_BT, cache=cache)[:, -1]
    for i in range(steps):
        nxt = pick(logits, cfg, gen)
        idx_BT = torch.cat([idx_BT, nxt], dim=1)
        if i + 1 < steps:
            logits = model(nxt, cache=cache)[:, -1]
    return idx_BT
