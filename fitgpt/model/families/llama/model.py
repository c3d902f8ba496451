"""The Llama families' network: Llama 3, Qwen2/2.5, Qwen3 and Mistral, one network for all four.

What they share, and what sets them apart from GPT-2: RMSNorm without biases, rotary positions
(no position table; linear, Llama 3's or YaRN's frequency scaling when the config has it),
grouped-query attention (K key/value heads serve N query heads, K dividing N), a gated MLP
proj(silu(gate)·up), and no bias anywhere, tied or untied head. What sets them apart from each
other is a field of the config each (family.py's LlamaFamily.check refuses the others, so every
config exports to its Hugging Face class): Qwen2 biases on q, k and v; Qwen3 an RMSNorm over each
head of q and k before the rotation; Mistral a sliding window, applied only to sequences longer
than it: on CUDA by FlexAttention (model/packing.py Packing.window), on the CPU by a boolean mask
(mask below). Each of the four is a folder of its own (model/families/<name>/) holding its
Family, presets and Hugging Face map; this folder holds the network they share.

Like families/gpt2/model.py this file holds the architecture only: sharding, offload and mixed
precision are applied from outside.

Shape legend: B batch, T tokens in this call, H hidden, N query heads, K key/value heads,
D head dim, F MLP width, V padded vocabulary, P positions already in the KV cache.
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
    from fitgpt.model.config import ModelConfig, RopeScaling


# ---- rotary positions ------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig, device=None) -> Tensor:
    """[D/2] fp32 rotation frequencies theta^(-2i/D), stretched by the config's scaling
    (linear, Llama 3's or YaRN's) when it has one, in the order of operations transformers uses
    (so the tables agree to the last bit on the same device)."""
    D = cfg.head_dim
    exponent = torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D
    inv = 1.0 / (cfg.rope_theta**exponent)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.kind == "yarn":
        return yarn_inv_freq(rs, cfg.rope_theta**exponent, cfg.rope_theta, D)
    if rs.kind == "linear":  # position interpolation: every frequency slowed alike
        return inv / rs.factor
    # long wavelengths (past original/low_freq_factor) slowed by `factor`, short ones (under
    # original/high_freq_factor) kept, those between blended linearly in original/wavelength
    low_wavelen = rs.original_max_positions / rs.low_freq_factor
    high_wavelen = rs.original_max_positions / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_positions / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def yarn_inv_freq(rs: RopeScaling, pos_freqs: Tensor, theta: float, D: int) -> Tensor:
    """YaRN's frequencies (transformers' _compute_yarn_parameters, step for step): the
    dimensions i whose frequency turns fewer than beta_slow times over the original context
    take theta^(2i/D)·factor's (interpolated), more than beta_fast times theta^(2i/D)'s
    (kept), a linear ramp between, over dimension indices rounded outwards unless truncate is
    false. `pos_freqs`: theta^(2i/D), [D/2] fp32."""
    beta_fast, beta_slow = rs.beta_fast or 32, rs.beta_slow or 1
    orig = rs.original_max_positions

    def dim_of(turns: float) -> float:  # the dimension that turns `turns` times over orig
        return (D * math.log(orig / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rs.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).to(pos_freqs.device)  # 1: the frequency kept (extrapolated)
    return (1.0 / (rs.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention_factor (given, or
    0.1·ln(factor) + 1 as transformers derives it), 1 for every other rotation."""
    rs = cfg.rope_scaling
    if rs is None or rs.kind != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    return 1.0 if rs.factor <= 1 else 0.1 * math.log(rs.factor) + 1.0


def rope_tables(
    cfg: ModelConfig, T: int, past: int, device, positions_BT: Tensor | None = None
) -> Tensor:
    """[2, T, D] fp32: cos and sin of positions past..past+T-1 for each of a head's D
    dimensions (the frequencies repeated: dimension i pairs with i + D/2), times YaRN's
    attention factor when the config scales that way. Packed rows give every token's position
    instead: [2, B, 1, T, D] (B·T·D·8 bytes, shared by the blocks)."""
    inv = rope_inv_freq(cfg, device)
    if positions_BT is None:
        pos = torch.arange(past, past + T, device=device, dtype=torch.float32)
        angles = torch.outer(pos, inv)  # [T, D/2]
    else:
        angles = (positions_BT.float()[..., None] * inv)[:, None]  # [B, 1, T, D/2]
    angles = torch.cat((angles, angles), dim=-1)
    scale = rope_attention_factor(cfg)
    if scale != 1.0:  # YaRN: as transformers, cos·s and sin·s in fp32, before any cast
        return torch.stack((angles.cos() * scale, angles.sin() * scale))
    return torch.stack((angles.cos(), angles.sin()))


def rotate(x_BNTD: Tensor, rope_2TD: Tensor) -> Tensor:
    """x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1] of x's halves [x1, x2]; in x's
    dtype, as transformers does (the tables cast down, not x up)."""
    cos, sin = rope_2TD.to(x_BNTD.dtype).unbind(0)
    x1, x2 = x_BNTD.chunk(2, dim=-1)
    return x_BNTD * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---- the network ---------------------------------------------------------------------------
class GroupedQueryAttention(nn.Module):
    """Causal attention of N query heads over K key/value heads (query head i reads key/value
    head i // (N/K)). q and kv are separate linears: tensor parallelism cuts each by heads
    (kv's k and v on their own), so a rank keeps N/T query heads and their K/T key/value heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, N, K, D = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.n_head, self.n_kv, self.head_dim = N, K, D  # N and K: this rank's under TP
        self.q = nn.Linear(H, N * D, bias=cfg.qkv_bias)
        self.kv = nn.Linear(H, 2 * K * D, bias=cfg.qkv_bias)  # the K·D rows of k, then of v
        self.q_norm = nn.RMSNorm(D, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(D, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.proj = nn.Linear(N * D, H, bias=False)
        self.dropout = cfg.dropout
        self.window = cfg.sliding_window

    def forward(self, x_BTH: Tensor, cache: KVCache | None, layer: int, aux) -> Tensor:
        """`aux`: Llama.block_aux's, the rotary tables, or with packed samples (tables, Packing)."""
        rope_2TD, packing = aux if isinstance(aux, tuple) else (aux, None)
        q = self.q(x_BTH)
        kv = self.kv(x_BTH)
        B, T, _ = q.shape  # T: all the tokens, also under sequence parallelism (q gathers them)
        q_BTND = q.view(B, T, self.n_head, self.head_dim)
        k_BTKD, v_BTKD = kv.view(B, T, 2, self.n_kv, self.head_dim).unbind(2)
        if self.q_norm is not None:  # Qwen3: each head normalised before the rotation
            q_BTND, k_BTKD = self.q_norm(q_BTND), self.k_norm(k_BTKD)
        q, k, v = (t.transpose(1, 2) for t in (q_BTND, k_BTKD, v_BTKD))
        q, k = rotate(q, rope_2TD), rotate(k, rope_2TD)
        past = cache.length if cache is not None else 0
        if cache is not None:
            k, v = cache.append(layer, k, v)  # rotated keys: a position's rotation never changes
        drop = self.dropout if self.training else 0.0
        # K < N: SDPA pairs the heads itself (no repeated copy of k and v; flash attention on
        # CUDA takes it as is)
        gqa = {"enable_gqa": True} if self.n_kv != self.n_head else {}
        mask_TP = self.mask(T, past, q.device) if packing is None else None
        if packing is not None:  # samples kept apart, the window inside each (model/packing.py)
            y = packing.attend(q, k, v, drop)
        elif mask_TP is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_TP, dropout_p=drop, **gqa)
        elif past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop, **gqa)
        else:  # one new token sees everything cached
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, **gqa)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return F.dropout(self.proj(y), drop, self.training)

    def mask(self, T: int, past: int, device) -> Tensor | None:
        """[T, P+T] boolean (True: attend), or None where is_causal or no mask says it: needed
        for several new tokens after a cache, and for a sliding window the sequence outgrows
        (query i sees keys i-window+1..i). Shorter sequences keep the mask-free flash path.
        The window's mask costs T·(P+T) bytes (16 GiB at 128 k tokens) and a masked kernel over
        the whole square: a CUDA run without dropout takes FlexAttention instead (the forward
        hands a Packing from Packing.window), so this serves the CPU, dropout and decoding."""
        windowed = self.window is not None and past + T > self.window
        if not windowed and (past == 0 or T == 1):
            return None
        i = torch.arange(past, past + T, device=device)[:, None]
        j = torch.arange(past + T, device=device)[None, :]
        keep = j <= i
        if windowed:
            keep &= j > i - self.window
        return keep


class SwiGLU(nn.Module):
    """proj(silu(gate(x)) · up(x)), gate and up one linear `fc` ([gate; up], 2F rows)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 2 * cfg.ffn_width, bias=False)
        self.proj = nn.Linear(cfg.ffn_width, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout
        self.width = cfg.ffn_width  # F of the whole model, also under TP: what pieces decide on

    def forward(self, x_BTH: Tensor) -> Tensor:
        """A piece of tokens at a time past model/pieces.py's MLP_PIECE_ELEMS."""
        return along_tokens(self.whole, x_BTH, self.width)

    def whole(self, x_BTH: Tensor) -> Tensor:
        gate, up = self.fc(x_BTH).chunk(2, dim=-1)  # each [B, T, F] (F/T under TP)
        return F.dropout(self.proj(F.silu(gate) * up), self.dropout, self.training)


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self, cfg: ModelConfig, mlp: nn.Module | None = None, attn: nn.Module | None = None
    ) -> None:
        """`mlp`: the block's MLP when it is not the SwiGLU (a mixture of experts: qwen3_moe);
        `attn`: its attention when it is not GroupedQueryAttention (gpt-oss's, with sinks)."""
        super().__init__()
        self.ln_1 = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = attn if attn is not None else GroupedQueryAttention(cfg)
        self.ln_2 = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLU(cfg)

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0, aux=None) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, aux)
        return x + self.mlp(self.ln_2(x))


class Llama(DecoderLM):
    """Children in execution order (the engine's chunks, model/decoder.py): the embedding,
    `blocks`, the final norm and an untied head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        V, H = cfg.padded_vocab_size, cfg.n_embd
        self.wte = embedding(V, H)
        self.blocks = nn.ModuleList(self.make_block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.RMSNorm(H, eps=cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(H, V, bias=False)

    def make_block(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Block `layer` (a mixture-of-experts network picks each block's MLP here)."""
        return LlamaBlock(cfg)

    def init_std(self, name: str) -> float | None:
        """N(0, weight_std) for the weights and the embedding, residual_std for the residual
        projections (attn.proj, mlp.proj); None (ones) for every norm, (zeros) for a bias."""
        if name.endswith(".bias") or name.startswith("ln_f") or ".ln_" in name or "norm." in name:
            return None
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            return self.cfg.residual_std()
        return self.cfg.weight_std()

    def embed_rest(self, x_BTH: Tensor, start: int | Tensor) -> Tensor:
        return F.dropout(x_BTH, self.cfg.dropout, self.training)  # positions: in attention

    def block_aux(self, T: int, past: int, device, packing: Packing | None = None):
        """The rotary tables of this call's positions, [2, T, D] fp32 (made on the device each
        forward: a few small kernels, no state to place, cast or checkpoint); packed samples:
        (the tables at each token's position in its sample, the Packing)."""
        if packing is None:
            return rope_tables(self.cfg, T, past, device)
        return rope_tables(self.cfg, T, past, device, packing.positions_BT), packing

    def final_norm(self, x_BTH: Tensor) -> Tensor:
        return self.ln_f(x_BTH)

    def head_weight(self) -> Tensor:
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def split_heads(self, rank: int, tp: int) -> None:
        for block in self.blocks:
            block.attn.n_head = self.cfg.n_head // tp
            block.attn.n_kv = self.cfg.kv_heads // tp
