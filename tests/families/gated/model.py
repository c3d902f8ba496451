"""The gated family's network: GPT-2's attention, RMSNorm, a gated MLP, an untied head."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from fitgpt.model import DecoderLM, ModelConfig
from fitgpt.model.families.gpt2.model import CausalSelfAttention


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        f = 3 * cfg.n_embd
        self.gate = nn.Linear(cfg.n_embd, f, bias=False)
        self.up = nn.Linear(cfg.n_embd, f, bias=False)
        self.down = nn.Linear(f, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GatedBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_1 = nn.RMSNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)  # bias=False in its configs: no biases anywhere
        self.norm_2 = nn.RMSNorm(cfg.n_embd)
        self.mlp = GatedMLP(cfg)

    def forward(self, x: Tensor, cache=None, layer: int = 0, aux=None) -> Tensor:
        x = x + self.attn(self.norm_1(x), cache, layer, aux)
        return x + self.mlp(self.norm_2(x))


class GatedLM(DecoderLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(GatedBlock(cfg) for _ in range(cfg.n_layer))
        self.norm_f = nn.RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)

    def embed_rest(self, x: Tensor, start: int) -> Tensor:
        return x  # no positions: causal attention alone orders the tokens

    def final_norm(self, x: Tensor) -> Tensor:
        return self.norm_f(x)

    def head_weight(self) -> Tensor:
        return self.lm_head.weight

    def init_std(self, name: str) -> float | None:
        if ".norm" in name or name.startswith("norm_f"):
            return None
        return 0.01 if name.endswith(("down.weight", "attn.proj.weight")) else 0.03

    def split_heads(self, rank: int, tp: int) -> None:
        for block in self.blocks:
            block.attn.n_head = self.cfg.n_head // tp
