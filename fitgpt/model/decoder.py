"""The shape every model family shares: embedding → N identical blocks → head.

A family's network subclasses DecoderLM and fills in the hooks below; the engine, tensor
parallelism (parallel/layers.py), compile, activation checkpointing, generation and checkpoints
drive any family through this class alone. Its children, in execution order, are what the engine
chunks (engine/layout.py): what comes before `blocks` is the embedding chunk, each block a chunk,
what comes after the head chunk.

The hooks:
  embed_rest(x, start)   after the token embedding: positions (start is the first token's, or
                         packed rows' [B, T] positions of every token), norms, dropout. Tensor
                         parallelism calls it on its slice of the tokens.
  block_aux(T, past, device, packing)
                         what every block takes besides the stream and the cache (ALiBi's bias,
                         rotary tables; with packed samples, model/packing.py's Packing, which
                         keeps each sample's attention to itself), computed once per forward;
                         None if nothing
  final_norm(x), head_weight()
                         the norm before the head, and the [V, H] matrix of the head (the
                         embedding's when tied)
  init_std(name)         the initial standard deviation of parameter `name` (None: ones for a
                         norm's weight, zeros for a bias)
  split_heads(rank, tp)  tensor parallelism kept 1/tp of every attention's heads: the modules'
                         head counts and per-head buffers follow
  materialize_buffers(device)
                         the buffers a model built on the meta device lacks, made on `device`

Shape legend: B batch, T tokens in this call, H hidden, V padded vocabulary, P positions already
in the KV cache, K key/value heads, D head dimension.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fitgpt.model.loss import loss_pieces, pieces_cross_entropy
from fitgpt.model.packing import Packing

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig


class KVCache:
    """Keys and values of every layer for incremental decoding: [B, K, S, D] per layer (K the
    key/value heads: grouped-query attention caches K heads, not N)."""

    def __init__(
        self, cfg: ModelConfig, batch: int, device, dtype, length: int | None = None
    ) -> None:
        # `length` positions (default: the whole context), zeroed here: K·D·length per layer
        shape = (batch, cfg.kv_heads, length or cfg.seq_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.length = 0  # P: positions filled so far, the same for every layer

    def append(self, layer: int, k_BKTD: Tensor, v_BKTD: Tensor) -> tuple[Tensor, Tensor]:
        """Store this call's keys/values; return all keys/values so far, [B, K, P+T, D]."""
        t0, t1 = self.length, self.length + k_BKTD.shape[2]
        self.k[layer][:, :, t0:t1] = k_BKTD
        self.v[layer][:, :, t0:t1] = v_BKTD
        return self.k[layer][:, :, :t1], self.v[layer][:, :, :t1]


def embedding(rows: int, width: int) -> nn.Embedding:
    """nn.Embedding(rows, width), without its default N(0, 1) fill when built on the meta
    device (the planner's layouts, every model before the engine materialises it): on meta that
    fill goes through torch's Python reference kernels, whose first use imports torch._dynamo,
    1-2 s of every fitgpt command that plans. A meta tensor holds no values, so nothing else
    changes; on a real device the fill stays."""
    if torch.empty(0).is_meta:  # under `with torch.device("meta")`
        return nn.Embedding(rows, width, _weight=torch.empty(rows, width))
    return nn.Embedding(rows, width)


class DecoderLM(nn.Module, ABC):
    """Base of every family's network: `wte` (the token embedding), `blocks`, the head."""

    # the family's Family (model/family.py): set on the class by its folder's family.py, and on
    # each network build_model makes (model/families/__init__.py), since one network may serve
    # several families (families/llama/model.py serves four)
    family: ClassVar
    wte: nn.Embedding
    blocks: nn.ModuleList

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg

    # ---- the family's hooks ---------------------------------------------------------------
    @abstractmethod
    def embed_rest(self, x_BTH: Tensor, start: int | Tensor) -> Tensor: ...

    def block_aux(self, T: int, past: int, device, packing: Packing | None = None):
        return packing

    @abstractmethod
    def final_norm(self, x_BTH: Tensor) -> Tensor: ...

    @abstractmethod
    def head_weight(self) -> Tensor: ...

    @abstractmethod
    def init_std(self, name: str) -> float | None: ...

    @abstractmethod
    def split_heads(self, rank: int, tp: int) -> None: ...

    def materialize_buffers(self, device) -> None:
        return None

    # ---- shared by every family -------------------------------------------------------------
    def num_params(self) -> int:
        """Exact count of distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

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

    def embed(self, idx_BT: Tensor, past: int | Tensor = 0) -> Tensor:
        """`past`: the first token's position, or every token's ([B, T], packed rows)."""
        return self.embed_rest(self.wte(idx_BT), past)

    def head(self, x_BTH: Tensor) -> Tensor:
        logits = F.linear(self.final_norm(x_BTH), self.head_weight())  # [B, T, V]
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

    def forward(
        self,
        idx_BT: Tensor,
        targets_BT: Tensor | None = None,
        cache=None,
        segments_BT: Tensor | None = None,
    ) -> Tensor:
        """Mean next-token cross-entropy if targets are given (-1 targets ignored), else logits.

        With a cache, only the logits of the last position are returned: [B, 1, V]. With
        segments (packed samples, int64 [B, T]) each sample attends only to itself and takes
        positions from 0 (model/packing.py); without, the row is one sequence.
        """
        past = cache.length if cache is not None else 0
        if idx_BT.shape[1] + past > self.cfg.seq_len:
            raise ValueError(
                f"{idx_BT.shape[1] + past} tokens exceed the context of {self.cfg.seq_len}"
            )
        packing = None
        drop = self.cfg.dropout if self.training else 0.0
        if segments_BT is not None:
            if cache is not None:
                raise ValueError("packed segments are for training; decode without them")
            packing = Packing.of(segments_BT, self.cfg, drop, self.family.flex_attention)
        elif cache is None:  # a sliding window on CUDA: FlexAttention (model/packing.py)
            flex = self.family.flex_attention
            packing = Packing.window(idx_BT.shape[1], self.cfg, idx_BT.device, drop, flex)
        aux = self.block_aux(idx_BT.shape[1], past, idx_BT.device, packing)
        x = self.embed(idx_BT, past if packing is None else packing.positions_BT)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i, aux)
        if cache is not None:
            cache.length += idx_BT.shape[1]
            return self.head(x[:, -1:])
        if targets_BT is None:
            return self.head(x)
        return self.head_loss(x, targets_BT)

    def head_loss(self, x_BTH: Tensor, targets_BT: Tensor) -> Tensor:
        """Final norm, head and mean cross-entropy (-1 targets ignored): one method, so the
        [B, T, V] logits are a transient inside it (a compiler may fuse the three whole). Past
        one piece of logits (model/loss.py loss_pieces) the loss goes a piece of rows at a time
        and the whole [B·T, V] is never made."""
        rows = loss_pieces(targets_BT.numel(), self.head_weight().shape[0])
        if rows:
            x_NH = self.final_norm(x_BTH).reshape(-1, x_BTH.shape[-1])
            return pieces_cross_entropy(
                x_NH, self.head_weight(), targets_BT.reshape(-1), rows, self.cfg.vocab_size
            )
        logits = self.head(x_BTH)
        # fp32 softmax: bf16 log-probabilities lose the small differences the loss is made of.
        return F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets_BT.reshape(-1), ignore_index=-1
        )
