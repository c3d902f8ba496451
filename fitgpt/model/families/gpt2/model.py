"""GPT-2's network: the architecture and nothing else.

Sharding, offload, activation checkpointing and mixed precision are applied to this model from
outside (fitgpt/engine/); this file only says what the network computes. What the rest of fitgpt
needs to know of it is family.py's GPT2Family (model/family.py says what that is).

Shape legend: B batch, T tokens in this call, S max context, H hidden, N heads, D head dim,
V padded vocabulary, P positions already in the KV cache.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fitgpt.model.decoder import DecoderLM, KVCache, embedding
from fitgpt.model.packing import Packing
from fitgpt.model.pieces import along_tokens

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig

# ALiBi adds a float bias to the scores, so its attention is SDPA with an [N, S, S] bias built
# once per forward in fp32 (GPT.alibi_bias) and cast to the compute dtype in every block: 6·N·S²
# bytes at the least under bf16 (at 128 k tokens and 12 heads, 1.1 TiB). Past this much no GPU
# holds it beside a model: such a config is refused when it is made (family.py
# GPT2Family.check). The causal rule alone (learned positions, the Llama families) builds no
# S×S tensor.
ALIBI_BIAS_MAX_BYTES = 16 * 2**30


def alibi_slopes(n_head: int) -> Tensor:
    """ALiBi's per-head slopes: a geometric sequence starting at 2^(-8/n) (Press et al.)."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_head).is_integer():
        return torch.tensor(power_of_2(n_head))
    closest = 2 ** math.floor(math.log2(n_head))
    extra = power_of_2(2 * closest)[0::2][: n_head - closest]
    return torch.tensor(power_of_2(closest) + extra)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.alibi = cfg.position == "alibi"

    def forward(
        self,
        x_BTH: Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        aux: Tensor | Packing | None = None,
    ) -> Tensor:
        """`aux`: GPT.block_aux's, ALiBi's bias, or with packed samples a Packing (model/packing.py,
        ALiBi's bias folded into its mask)."""
        qkv = self.qkv(x_BTH)
        # q, k, v of this module's n_head heads (all of them, or 1/T under fitgpt/parallel, whose
        # sequence parallelism gathers the tokens of x inside qkv: T is the output's)
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        past = cache.length if cache is not None else 0
        if cache is not None:
            k, v = cache.append(layer, k, v)
        drop = self.dropout if self.training else 0.0
        if isinstance(aux, Packing):
            y = aux.attend(q, k, v, drop)
        elif aux is not None:
            alibi_NTT = aux
            # ALiBi adds a float bias, so flash attention (boolean-causal only) is not used.
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=alibi_NTT.to(q.dtype), dropout_p=drop
            )
        elif past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        elif T == 1:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop)  # one new token sees all
        else:
            mask_TK = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_TK, dropout_p=drop)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return F.dropout(self.proj(y), drop, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.width = 4 * cfg.n_embd  # F of the whole model, also under TP: what pieces decide on

    def forward(self, x: Tensor) -> Tensor:
        """A piece of tokens at a time past model/pieces.py's MLP_PIECE_ELEMS."""
        return along_tokens(self.whole, x, self.width)

    def whole(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc(x), approximate="tanh")
        return F.dropout(self.proj(h), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        aux: Tensor | Packing | None = None,
    ) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, aux)
        return x + self.mlp(self.ln_2(x))


class GPT(DecoderLM):
    """Children in execution order: embeddings, `blocks`, final norm and head (the engine's
    chunks: model/decoder.py). Learned positions or ALiBi, an optional embedding LayerNorm, a
    tied or untied head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        V, H = cfg.padded_vocab_size, cfg.n_embd
        self.wte = embedding(V, H)
        self.wpe = embedding(cfg.positions, H) if cfg.position == "learned" else None
        self.emb_ln = nn.LayerNorm(H, bias=cfg.bias) if cfg.embed_norm else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(H, bias=cfg.bias)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(H, V, bias=False)
        self.heads = (0, cfg.n_head)  # the heads this model holds: all, or a TP rank's
        if cfg.position == "alibi":
            self.register_buffer("alibi_slopes_N", alibi_slopes(cfg.n_head), persistent=False)

    def init_std(self, name: str) -> float | None:
        """GPT-2's scheme at a std set by the width (ModelConfig.weight_std): N(0, std) weights
        and embeddings, the residual projections std/sqrt(2L); None means a LayerNorm weight
        (ones) or a bias (zeros). Every engine initialises through this (init_parameter_)."""
        if name.endswith(".bias") or ".ln_" in name or name.startswith(("ln_f", "emb_ln")):
            return None
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            return self.cfg.residual_std()
        return self.cfg.weight_std()

    def embed_rest(self, x_BTH: Tensor, start: int | Tensor) -> Tensor:
        if self.wpe is not None:
            if isinstance(start, Tensor):  # packed samples: each token's position in its own
                x_BTH = x_BTH + self.wpe(start)
            else:
                x_BTH = x_BTH + self.wpe(
                    torch.arange(start, start + x_BTH.shape[1], device=x_BTH.device)
                )
        if self.emb_ln is not None:
            x_BTH = self.emb_ln(x_BTH)
        return F.dropout(x_BTH, self.cfg.dropout, self.training)

    def block_aux(self, T: int, past: int, device, packing: Packing | None = None):
        """ALiBi's bias, or None; packed samples: the Packing, ALiBi's bias folded in (its
        distances are within a sample already: no position shift needed)."""
        bias = self.alibi_bias(T, past, device) if self.cfg.position == "alibi" else None
        if packing is None or bias is None:
            return bias if packing is None else packing
        return packing.with_bias(bias)

    def final_norm(self, x_BTH: Tensor) -> Tensor:
        return self.ln_f(x_BTH)

    def head_weight(self) -> Tensor:
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def split_heads(self, rank: int, tp: int) -> None:
        per = self.cfg.n_head // tp
        self.heads = (rank * per, (rank + 1) * per)
        for block in self.blocks:
            block.attn.n_head = per
        if self.cfg.position == "alibi":  # this rank's heads' slopes
            dev = self.alibi_slopes_N.device
            self.register_buffer("alibi_slopes_N", self._slopes(dev), persistent=False)

    def materialize_buffers(self, device) -> None:
        if self.cfg.position == "alibi":
            self.register_buffer("alibi_slopes_N", self._slopes(device), persistent=False)

    def _slopes(self, device) -> Tensor:
        lo, hi = self.heads
        return alibi_slopes(self.cfg.n_head)[lo:hi].to(device)

    def alibi_bias(self, T: int, past: int, device) -> Tensor:
        """[N, T, P+T] additive bias: -slope·distance on and below the diagonal, -inf above."""
        q = torch.arange(past, past + T, device=device)[:, None]
        k = torch.arange(past + T, device=device)[None, :]
        dist = (q - k).float()
        bias = -self.alibi_slopes_N.to(device)[:, None, None] * dist
        return bias.masked_fill(dist < 0, float("-inf"))
