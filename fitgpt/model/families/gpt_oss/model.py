"""gpt-oss's network: the mixture-of-experts Llama of ../qwen3_moe/ (RMSNorm, YaRN rotary
positions, grouped-query attention, a router and E experts in every layer, the load-balancing
loss) with what transformers' GptOssForCausalLM (5.23) computes differently:

  attention  biases on q, k, v and o; a learned logit per query head, the sink, in every
             softmax's denominator: p_j = exp(s_j) / (exp(sink) + Σ_i exp(s_i)), so a head may
             attend to nothing; layers sliding a window of the last `sliding_window` keys or
             attending fully, as ModelConfig.layer_types says (its default: sliding in the even
             layers, full in the odd, as GptOssConfig's).
  router     a linear with a bias; the k largest logits, their softmax the weights (the same
             weights as a softmax over all E renormalised over the k, computed as transformers
             does).
  experts    a bias on both projections; gate and up interleaved in one [H, 2F] matrix per
             expert (gate the even columns, up the odd, transformers' layout: x @ W, not
             F.linear's W^T); the clamped SwiGLU
               g = min(gate, limit), u = clamp(up, -limit, limit), out = (u + 1) · g·σ(α·g)
             with α = swiglu_alpha (1.702) and limit = swiglu_limit (7.0).

Two kernels for the sinks, chosen per call in one place (SinkMasks.for_layer):
  flex   training and evaluation forwards on CUDA without dropout (flex_sink_attention):
         FlexAttention without the sink, asked for its softmax normaliser (log-sum-exp, L,
         differentiable), then y · σ(L − sink): Σ_i exp(s_i) / (exp(sink) + Σ_i exp(s_i)) is
         σ(L − sink), so this is exactly the softmax with the sink in its denominator. No T×T
         tensor: a BlockMask per kind of layer (causal, or causal within the window, or within
         each packed sample), and the kernel skips the blocks outside them (a sliding layer
         costs T·window, not T²/2). Its cost: one [B, N, T] fp32 factor per layer, and the
         compile of flex_attention once per shape (model/packing.py). FlexAttention has no CPU
         backward and no dropout.
  mask   elsewhere (the CPU, the KV cache of generation, dropout; the reference, tested against
         transformers): SDPA with the sink as one more key (sink_attention): each query gains
         one coordinate holding sink/scale, a key in front of the keys has 1 there and 0
         elsewhere, and its value is zero; that key then scores exactly the sink, its weight
         joins the denominator and adds nothing to the output. The cost: copies of q, k and v
         one key and 8 coordinates larger, a boolean mask over the keys and the sink ([T, 1+P+T],
         or [B, 1, T, 1+T] packed: T² bytes, made once per forward for each kind of layer), and
         with grouped kv heads SDPA's math kernel, which holds the [B, N, T, 1+T] weights.
The family says flex_attention = False: model/packing.py's Packing makes no mask of its own for
it (only its segments and positions are read; the masks are SinkMasks').

Parameters beyond the Llama network's (E experts, F one expert's width, H hidden, N heads):
`attn.proj.bias` [H], `attn.sinks` [N], `mlp.router.bias` [E], and the experts as transformers
holds them (three-dimensional: an HF tensor is a fitgpt parameter, hf.py):
`mlp.experts.gate_up` [E, H, 2F], `gate_up_bias` [E, 2F], `down` [E, F, H], `down_bias` [E, H].

Shape legend: B batch, T tokens in this call, P positions already cached, S = P + T keys,
H hidden, N query heads, K key/value heads, D head dim, E experts, K' = k experts per token,
N' = B·T tokens, M = N'·K' (token, expert) assignments, F one expert's width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fitgpt.model.decoder import KVCache
from fitgpt.model.families.llama.model import LlamaBlock, rope_tables, rotate
from fitgpt.model.families.qwen3_moe.model import (
    MoeLlama,
    SparseMoe,
    expert_matmul,
    sort_by_expert,
)
from fitgpt.model.packing import (
    Packing,
    block_mask,
    flex_attention_fn,
    flex_serves,
    keep_mask,
    window_block_mask,
)

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig

SINK_PAD = 8  # coordinates added to q and k: the sink's, then zeros to keep D a multiple of 8


def default_layer_types(n_layer: int) -> tuple[str, ...]:
    """GptOssConfig's pattern where config.json gives none: sliding, full, sliding, ..."""
    return tuple("full_attention" if i % 2 else "sliding_attention" for i in range(n_layer))


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """Each layer's attention: cfg.layer_types, else GptOssConfig's default pattern."""
    return cfg.layer_types or default_layer_types(cfg.n_layer)


def layer_windows(cfg: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's window: cfg.sliding_window for a sliding layer, None for a full one."""
    return tuple(cfg.sliding_window if t == "sliding_attention" else None for t in layer_kinds(cfg))


# ---- attention with sinks ---------------------------------------------------------------------
def sink_keep(
    T: int, past: int, window: int | None, device, segments_BT: Tensor | None = None
) -> Tensor:
    """Which keys each query sees, the sink first: [T, 1+P+T] bool (query i is position
    past+i; key j+1 position j: j <= past+i, and within a window j > past+i-window), or with
    packed samples [B, 1, T, 1+T] (model/packing.py keep_mask: its own sample only). The sink
    column is True everywhere."""
    if segments_BT is not None:
        keep = keep_mask(segments_BT, window)
    else:
        i = torch.arange(past, past + T, device=device)[:, None]
        j = torch.arange(past + T, device=device)[None, :]
        keep = j <= i
        if window is not None:
            keep = keep & (j > i - window)
    sink = torch.ones(*keep.shape[:-1], 1, dtype=torch.bool, device=device)
    return torch.cat((sink, keep), dim=-1)


def sink_attention(
    q_BNTD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, sinks_N: Tensor, keep: Tensor, drop: float
) -> Tensor:
    """softmax([q·k^T / sqrt(D), sink]) over the keys `keep` allows, the sink's column dropped,
    times v: [B, N, T, D] (module docstring: the sink as one more key). Dropout, as
    transformers', falls on the weights normalised with the sink."""
    B, N, T, D = q_BNTD.shape
    K = k_BKSD.shape[1]
    scale = D**-0.5
    sink = (sinks_N / scale).to(q_BNTD.dtype).view(1, N, 1, 1).expand(B, N, T, 1)
    q = torch.cat((q_BNTD, sink, q_BNTD.new_zeros(B, N, T, SINK_PAD - 1)), dim=-1)
    unit = torch.zeros(D + SINK_PAD, dtype=k_BKSD.dtype, device=k_BKSD.device)
    unit[D] = 1.0  # the sink's key: 1 in q's sink coordinate, 0 elsewhere
    k = torch.cat((unit.expand(B, K, 1, D + SINK_PAD), F.pad(k_BKSD, (0, SINK_PAD))), dim=2)
    v = F.pad(v_BKSD, (0, SINK_PAD, 1, 0))  # the sink's value zero; v as wide as q and k
    gqa = {"enable_gqa": True} if K != N else {}
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=drop, scale=scale, **gqa)
    return y[..., :D]  # [B, N, T, D]: the padding's coordinates are zeros


def flex_sink_attention(
    q_BNTD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, sinks_N: Tensor, mask: Any, attend=None
) -> Tensor:
    """sink_attention's result through FlexAttention (module docstring, "flex"): the
    attention without the sink over the BlockMask `mask`, scaled per query by σ(L − sink), L
    its log-sum-exp (fp32, natural log). The factor is cast to the output's dtype before the
    product: one rounding, as the reference's weights are rounded in the working dtype.
    `attend`: flex_attention itself (the compiled one by default; the CPU's Inductor takes no
    return_lse, so the CPU test hands in the eager one)."""
    gqa = k_BKSD.shape[1] != q_BNTD.shape[1]
    y, lse_BNT = (attend or flex_attention_fn())(
        q_BNTD, k_BKSD, v_BKSD, block_mask=mask, enable_gqa=gqa, return_lse=True
    )
    keep_BNT = torch.sigmoid(lse_BNT - sinks_N.float().view(1, -1, 1))
    return y * keep_BNT.unsqueeze(-1).to(y.dtype)


class SinkMasks:
    """One forward's masks, shared by the layers of each kind (the one place the sink kernel is
    chosen, module docstring): for_layer(window, dropout, cached) gives ("flex", BlockMask) or
    ("mask", sink_keep's boolean). The BlockMasks a forward without a past may take are made
    here, when the forward starts, for each of the layers' `windows` (outside the blocks, which
    --compile compiles: making one inside a compiled block would be traced); the boolean masks
    on first use."""

    def __init__(
        self, cfg: ModelConfig, T: int, past: int, device, seg: Tensor | None, windows
    ) -> None:
        self.cfg, self.T, self.past, self.device, self.seg = cfg, T, past, device, seg
        self._made: dict[tuple[str, int | None], Any] = {}
        if past == 0 and flex_serves(torch.device(device), cfg, 0.0):
            for w in windows:
                m = block_mask(seg, w) if seg is not None else window_block_mask(T, w, device)
                self._made[("flex", w)] = m  # seg: packed samples (no Packing.window here)

    def for_layer(self, window: int | None, dropout: float, cached: bool) -> tuple[str, Any]:
        flex = not cached and flex_serves(torch.device(self.device), self.cfg, dropout)
        if flex and ("flex", window) in self._made:
            return "flex", self._made[("flex", window)]
        if ("mask", window) not in self._made:
            self._made[("mask", window)] = sink_keep(
                self.T, self.past, window, self.device, self.seg
            )
        return "mask", self._made[("mask", window)]


class SinkAttention(nn.Module):
    """Grouped-query attention with biases on q, k, v and o and a sink per query head, over
    the window `window` (None: every key before). Its q, kv and proj are laid out as the
    Llama network's (llama/model.py GroupedQueryAttention: kv is k's rows then v's)."""

    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        H, N, K, D = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.n_head, self.n_kv, self.head_dim = N, K, D
        self.q = nn.Linear(H, N * D, bias=cfg.qkv_bias)
        self.kv = nn.Linear(H, 2 * K * D, bias=cfg.qkv_bias)
        self.proj = nn.Linear(N * D, H, bias=cfg.qkv_bias)  # transformers' attention_bias: all 4
        self.sinks = nn.Parameter(torch.zeros(N))
        self.window = window
        self.dropout = cfg.dropout

    def forward(self, x_BTH: Tensor, cache: KVCache | None, layer: int, aux) -> Tensor:
        """`aux`: GptOss.block_aux's (rotary tables, SinkMasks)."""
        rope_2TD, masks = aux
        B, T, _ = x_BTH.shape
        q_BTND = self.q(x_BTH).view(B, T, self.n_head, self.head_dim)
        k_BTKD, v_BTKD = self.kv(x_BTH).view(B, T, 2, self.n_kv, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q_BTND, k_BTKD, v_BTKD))
        q, k = rotate(q, rope_2TD), rotate(k, rope_2TD)
        if cache is not None:
            k, v = cache.append(layer, k, v)
        drop = self.dropout if self.training else 0.0
        kind, mask = masks.for_layer(self.window, drop, cache is not None)
        if kind == "flex":
            y = flex_sink_attention(q, k, v, self.sinks, mask)
        else:
            y = sink_attention(q, k, v, self.sinks, mask, drop)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return F.dropout(self.proj(y), drop, self.training)


# ---- the experts ------------------------------------------------------------------------------
def clamped_swiglu(h_MO: Tensor, alpha: float, limit: float) -> Tensor:
    """[M, F] from gate and up interleaved in [M, 2F], in transformers' order of operations."""
    gate, up = h_MO[..., ::2], h_MO[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class _RowBias(torch.autograd.Function):
    """bias_EO[expert_M]: each row's expert's bias, with the gradient summed per expert by a
    matmul, one_hot(expert_M)ᵀ · grad_MO, instead of autograd's index_put with accumulate.
    That kernel handles the rows of one index in sequence, and every row repeats one of E
    indices (M = tokens × k rows, E = 32 or 128): gpt-oss-20b's step on an H200 took 9.3 s of
    forward and backward where 5.5 s were priced (results/moe_sink_h200_2026-11-28), with a
    random router sending every row to 4 experts. The matmul is 2·M·E·O FLOPs (12 GFLOP a
    layer's bias at 8,192 tokens) and a [M, E] one-hot in the gradient's dtype (2 MB); its sums
    accumulate in fp32 inside the matmul."""

    @staticmethod
    def forward(ctx, bias_EO: Tensor, expert_M: Tensor) -> Tensor:
        ctx.save_for_backward(expert_M)
        ctx.experts = bias_EO.shape[0]
        return bias_EO[expert_M]

    @staticmethod
    def backward(ctx, grad_MO: Tensor):
        (expert_M,) = ctx.saved_tensors
        hot_ME = F.one_hot(expert_M, ctx.experts).to(grad_MO.dtype)
        # in the gradient's own dtype: a backward run under autocast would otherwise cast an
        # fp32 gradient to bf16 for the matmul
        with torch.autocast(grad_MO.device.type, enabled=False):
            return hot_ME.t() @ grad_MO, None


def row_bias(bias_EO: Tensor, expert_M: Tensor) -> Tensor:
    """[M, O]: bias_EO[expert_M], its gradient by _RowBias (a frozen bias: a plain gather)."""
    if not (bias_EO.requires_grad and torch.is_grad_enabled()):
        return bias_EO[expert_M]
    return _RowBias.apply(bias_EO, expert_M)


class ClampedExperts(nn.Module):
    """E experts with biases and the clamped SwiGLU, run over tokens sorted by expert (as
    ../qwen3_moe's Experts: one matmul per expert over its rows, or one grouped GEMM)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, F_ = cfg.num_experts, cfg.n_embd, cfg.moe_ffn_hidden
        self.n = E
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        std = cfg.weight_std()
        self.gate_up = nn.Parameter(torch.empty(E, H, 2 * F_).normal_(0.0, std))
        self.gate_up_bias = nn.Parameter(torch.zeros(E, 2 * F_))
        self.down = nn.Parameter(torch.empty(E, F_, H).normal_(0.0, cfg.residual_std()))
        self.down_bias = nn.Parameter(torch.zeros(E, H))
        self.exchange = None  # expert parallelism, as ../qwen3_moe's Experts

    def weights(self, H: int) -> tuple[Tensor, Tensor]:
        """Views in F.linear's [O, I] per expert, as expert_matmul takes them."""
        return self.gate_up.transpose(1, 2), self.down.transpose(1, 2)

    def run(self, x_MH: Tensor, count_E: Tensor, grouped: bool, expert_M: Tensor) -> Tensor:
        """[M, H]: each row through its expert (expert_M[m], the rows grouped by expert)."""
        up_EOI, down_EOI = self.weights(x_MH.shape[1])
        h = expert_matmul(x_MH, up_EOI, count_E, grouped) + row_bias(self.gate_up_bias, expert_M)
        a = clamped_swiglu(h, self.alpha, self.limit)
        return expert_matmul(a, down_EOI, count_E, grouped) + row_bias(self.down_bias, expert_M)

    def forward(self, x_NH: Tensor, idx_NK: Tensor, w_NK: Tensor) -> Tensor:
        """[N', H]: Σ_k w_NK[n, k] · expert_{idx_NK[n, k]}(x_NH[n])."""
        if self.exchange is not None:
            return self.exchange(self, x_NH, idx_NK, w_NK)
        up_EOI, _ = self.weights(x_NH.shape[1])
        order_M, token_M, count_E, grouped = sort_by_expert(idx_NK, self.n, x_NH, up_EOI)
        expert_M = idx_NK.reshape(-1)[order_M]  # each sorted row's expert, for its biases
        y_MH = self.run(x_NH[token_M], count_E, grouped, expert_M)
        y_MH = y_MH * w_NK.reshape(-1)[order_M, None]
        return torch.zeros_like(x_NH).index_add_(0, token_M, y_MH.to(x_NH.dtype))


class GptOssMoe(SparseMoe):
    """The router (with a bias) and the clamped experts; the load-balancing statistics as
    SparseMoe keeps them (transformers computes gpt-oss's aux loss as every MoE's)."""

    def __init__(self, cfg: ModelConfig) -> None:
        router = nn.Linear(cfg.n_embd, cfg.num_experts, bias=True)
        super().__init__(cfg, False, router, ClampedExperts(cfg))

    def forward(self, x_BTH: Tensor) -> Tensor:
        B, T, H = x_BTH.shape
        x_NH = x_BTH.reshape(-1, H)
        logits_NE = self.router(x_NH)
        top_NK, idx_NK = torch.topk(logits_NE, self.k, dim=-1)
        w_NK = F.softmax(top_NK, dim=-1, dtype=top_NK.dtype)
        if self.training:
            p_NE = F.softmax(logits_NE, dim=-1, dtype=torch.float32)
            self.route = self.route_stats(logits_NE, p_NE, torch.topk(p_NE, self.k).indices)
        return self.experts(x_NH, idx_NK, w_NK).view(B, T, H)


# ---- the network ------------------------------------------------------------------------------
class GptOss(MoeLlama):
    """MoeLlama (the aux loss, the router report) with gpt-oss's blocks: every layer sparse,
    its attention's window by layer_types."""

    def make_block(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return LlamaBlock(cfg, GptOssMoe(cfg), SinkAttention(cfg, layer_windows(cfg)[layer]))

    def init_std(self, name: str) -> float | None:
        """MoeLlama's, with zeros for the experts' biases and the residual spread for their
        down projections; the sinks N(0, weight_std) as transformers draws them."""
        if name.endswith("_bias"):
            return None
        if name.endswith("experts.down"):
            return self.cfg.residual_std()
        return super().init_std(name)

    def block_aux(self, T: int, past: int, device, packing: Packing | None = None):
        """(the rotary tables, at each token's position in its sample when packed; the
        forward's SinkMasks, one mask per kind of layer). Of a Packing only the segments and
        positions are read."""
        seg = packing.segments_BT if packing is not None else None
        pos = packing.positions_BT if packing is not None else None
        rope = rope_tables(self.cfg, T, past, device, pos)
        windows = {b.attn.window for b in self.blocks}
        return rope, SinkMasks(self.cfg, T, past, device, seg, windows)
