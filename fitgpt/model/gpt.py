"""GPT-2: the architecture and nothing else.

Sharding, offload, activation checkpointing and mixed precision are applied to this model from
outside (fitgpt/engine/); this file only says what the network computes.

Shape legend: B batch, T tokens in this call, S max context, H hidden, N heads, D head dim,
V padded vocabulary, P positions already in the KV cache.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fitgpt.model.config import ModelConfig


class KVCache:
    """Keys and values of every layer for incremental decoding: [B, N, S, D] per layer."""

    def __init__(self, cfg: ModelConfig, batch: int, device, dtype) -> None:
        shape = (batch, cfg.n_head, cfg.seq_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.length = 0  # P: positions filled so far, the same for every layer

    def append(self, layer: int, k_BNTD: Tensor, v_BNTD: Tensor) -> tuple[Tensor, Tensor]:
        """Store this call's keys/values; return all keys/values so far, [B, N, P+T, D]."""
        t0, t1 = self.length, self.length + k_BNTD.shape[2]
        self.k[layer][:, :, t0:t1] = k_BNTD
        self.v[layer][:, :, t0:t1] = v_BNTD
        return self.k[layer][:, :, :t1], self.v[layer][:, :, :t1]


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
        alibi_NTT: Tensor | None = None,
    ) -> Tensor:
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
        if alibi_NTT is not None:
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

    def forward(self, x: Tensor) -> Tensor:
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
        alibi_NTT: Tensor | None = None,
    ) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, alibi_NTT)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Children in execution order: embeddings, `blocks`, final norm and head.

    The engine relies on this order: what comes before `blocks` is the embedding chunk, each
    block is a chunk, and what comes after is the head chunk.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        V, H = cfg.padded_vocab_size, cfg.n_embd
        self.wte = nn.Embedding(V, H)
        self.wpe = nn.Embedding(cfg.seq_len, H) if cfg.position == "learned" else None
        self.emb_ln = nn.LayerNorm(H, bias=cfg.bias) if cfg.embed_norm else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(H, bias=cfg.bias)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(H, V, bias=False)
        if cfg.position == "alibi":
            self.register_buffer("alibi_slopes_N", alibi_slopes(cfg.n_head), persistent=False)

    def num_params(self) -> int:
        """Exact count of distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    # ---- initialisation -------------------------------------------------------------------
    def init_std(self, name: str) -> float | None:
        """GPT-2's scheme at a std set by the width (ModelConfig.weight_std): N(0, std) weights
        and embeddings, the residual projections std/sqrt(2L); None means a LayerNorm weight
        (ones) or a bias (zeros). Every engine initialises through this (init_parameter_)."""
        if name.endswith(".bias") or ".ln_" in name or name.startswith(("ln_f", "emb_ln")):
            return None
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            return self.cfg.residual_std()
        return self.cfg.weight_std()

    def init_parameter_(self, name: str, t: Tensor, seed: int) -> None:
        """Fill `t` in place as parameter `name`, from a generator seeded by (seed, name).

        Seeding by name makes the values independent of how the engine shards or places the
        parameters, so every engine starts from the same weights on a given device type.
        """
        std = self.init_std(name)
        with torch.no_grad():
            if std is None:
                t.fill_(1.0 if name.endswith(".weight") else 0.0)
                return
            gen = torch.Generator(device=t.device)
            gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            t.normal_(0.0, std, generator=gen)

    def reset_parameters(self, seed: int = 0) -> None:
        for name, p in self.named_parameters():
            self.init_parameter_(name, p, seed)

    # ---- forward ----------------------------------------------------------------------------
    def embed(self, idx_BT: Tensor, past: int = 0) -> Tensor:
        x = self.wte(idx_BT)
        if self.wpe is not None:
            pos = torch.arange(past, past + idx_BT.shape[1], device=idx_BT.device)
            x = x + self.wpe(pos)
        if self.emb_ln is not None:
            x = self.emb_ln(x)
        return F.dropout(x, self.cfg.dropout, self.training)

    def head(self, x_BTH: Tensor) -> Tensor:
        x = self.ln_f(x_BTH)
        w = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, w)  # [B, T, V]: the matmul keeps the tensor-core friendly width
        real = self.cfg.vocab_size
        if logits.shape[-1] > real:
            # The padded rows are no tokens: -inf keeps them out of the softmax and out of
            # sampling. Without it, imported weights (padded rows zero) give those rows logit 0,
            # above every real token of a pretrained GPT-2 (whose logits are far below 0). Written
            # in place outside autograd: it costs B·T·(V - vocab) writes, not a pass over the
            # logits; the linear's backward needs only its inputs, and the gradient reaching
            # these entries is 0 anyway (their softmax probability is 0, no target is there).
            with torch.no_grad():
                logits[..., real:] = float("-inf")
        return logits

    def alibi_bias(self, T: int, past: int, device) -> Tensor:
        """[N, T, P+T] additive bias: -slope·distance on and below the diagonal, -inf above."""
        q = torch.arange(past, past + T, device=device)[:, None]
        k = torch.arange(past + T, device=device)[None, :]
        dist = (q - k).float()
        bias = -self.alibi_slopes_N.to(device)[:, None, None] * dist
        return bias.masked_fill(dist < 0, float("-inf"))

    def forward(
        self, idx_BT: Tensor, targets_BT: Tensor | None = None, cache: KVCache | None = None
    ) -> Tensor:
        """Mean next-token cross-entropy if targets are given (-1 targets ignored), else logits.

        With a cache, only the logits of the last position are returned: [B, 1, V].
        """
        past = cache.length if cache is not None else 0
        if idx_BT.shape[1] + past > self.cfg.seq_len:
            raise ValueError(
                f"{idx_BT.shape[1] + past} tokens exceed the context of {self.cfg.seq_len}"
            )
        alibi = None
        if self.cfg.position == "alibi":
            alibi = self.alibi_bias(idx_BT.shape[1], past, idx_BT.device)
        x = self.embed(idx_BT, past)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i, alibi)
        if cache is not None:
            cache.length += idx_BT.shape[1]
            return self.head(x[:, -1:])
        if targets_BT is None:
            return self.head(x)
        return self.head_loss(x, targets_BT)

    def head_loss(self, x_BTH: Tensor, targets_BT: Tensor) -> Tensor:
        """Final norm, head and mean cross-entropy (-1 targets ignored): one method, so the
        [B, T, V] logits are a transient inside it (a compiler may fuse the three whole)."""
        logits = self.head(x_BTH)
        # fp32 softmax: bf16 log-probabilities lose the small differences the loss is made of.
        return F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets_BT.reshape(-1), ignore_index=-1
        )
