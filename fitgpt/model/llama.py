"""The Llama families: Llama 3, Qwen2/2.5, Qwen3 and Mistral, one network for all four.

What they share, and what sets them apart from GPT-2: RMSNorm without biases, rotary positions
(no position table; Llama 3's or YaRN's frequency scaling when the config has it), grouped-query attention
(K key/value heads serve N query heads, K dividing N), a gated MLP proj(silu(gate)·up), and no
bias anywhere, tied or untied head. What sets them apart from each other is a field of the
config each (LlamaFamily.check refuses the others, so every config exports to its Hugging Face
class): Qwen2 biases on q, k and v; Qwen3 an RMSNorm over each head of q and k before the
rotation; Mistral a sliding window, applied only to sequences longer than it: on CUDA by
FlexAttention (model/packing.py Packing.window), on the CPU by a boolean mask (mask below).

Like model/gpt.py this file holds the architecture only: sharding, offload and mixed precision
are applied from outside.

Shape legend: B batch, T tokens in this call, H hidden, N query heads, K key/value heads,
D head dim, F MLP width, V padded vocabulary, P positions already in the KV cache.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fitgpt.errors import UserError
from fitgpt.model.config import ModelConfig, RopeScaling
from fitgpt.model.decoder import DecoderLM, KVCache
from fitgpt.model.family import Family, Split, family_of, register_family
from fitgpt.model.packing import Packing
from fitgpt.model.pieces import along_tokens


# ---- rotary positions ------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig, device=None) -> Tensor:
    """[D/2] fp32 rotation frequencies theta^(-2i/D), stretched by the config's scaling (Llama
    3's or YaRN's) when it has one, in the order of operations transformers uses (so the
    tables agree to the last bit on the same device)."""
    D = cfg.head_dim
    exponent = torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D
    inv = 1.0 / (cfg.rope_theta**exponent)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.kind == "yarn":
        return yarn_inv_freq(rs, cfg.rope_theta**exponent, cfg.rope_theta, D)
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

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = GroupedQueryAttention(cfg)
        self.ln_2 = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0, aux=None) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, aux)
        return x + self.mlp(self.ln_2(x))


class Llama(DecoderLM):
    """Children in execution order (the engine's chunks, model/decoder.py): the embedding,
    `blocks`, the final norm and an untied head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.family = family_of(cfg)  # one network, four families: the config's own
        V, H = cfg.padded_vocab_size, cfg.n_embd
        self.wte = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.RMSNorm(H, eps=cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(H, V, bias=False)

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


# ---- the families --------------------------------------------------------------------------
class LlamaFamily(Family):
    """Llama 3 as model/family.py describes a family. Tensor parallelism (Megatron-LM's split):
    q, kv (k and v cut on their own: whole key/value heads per rank) and mlp.fc (gate and up
    on their own) column-parallel, the two proj row-parallel, the embedding and an untied head
    by vocabulary rows; the norms replicated (q_norm and k_norm serve every head: their
    gradients are summed over the ranks, parallel/layers.py). Qwen2, Qwen3 and Mistral are this
    family with one field each allowed (the class attributes below)."""

    name = "llama"
    model = Llama
    splits: ClassVar[dict[str, Split]] = {
        "attn.q.weight": Split(0),
        "attn.q.bias": Split(0),
        "attn.kv.weight": Split(0, 2),
        "attn.kv.bias": Split(0, 2),
        "mlp.fc.weight": Split(0, 2),
        "attn.proj.weight": Split(1),
        "mlp.proj.weight": Split(1),
        "wte.weight": Split(0),
        "lm_head.weight": Split(0),
    }
    head_shared = ("attn.q_norm.weight", "attn.k_norm.weight")
    # rotary's multiplies and concatenations, SwiGLU's silu and product are fused: a whole
    # Llama-3.1-8B step (micro-batch 4 x 4096, 8 of 32 blocks offloaded) took 7.46 s compiled
    # against 8.00 s eager on an H100 (results/llama_speed_h100_2026-11-27)
    compiled_checkpointed: ClassVar[float] = 0.933
    # rotary on q and k, SwiGLU's silu and product over F = 3.5h, RMSNorm, residual adds: ~1.5 s
    # of an 8.0 s Llama-3.1-8B step in the profile beside 5.8 s of matmuls (which the curve
    # prices at 5.84). The same step's measured time needs 1.198 (eager, 7.93-8.04 s) and
    # 1.189 (compiled, 7.40-7.48 s, after the 0.933 above) of the matmul term, H100,
    # results/llama_speed_h100_2026-11-27: the mean of the two
    matmul_time: ClassVar[float] = 1.19
    # what the Hugging Face class of the family has: the config must say the same
    has_qkv_bias: ClassVar[bool] = False  # always (Qwen2) or never
    has_qk_norm: ClassVar[bool] = False  # always (Qwen3) or never
    has_window: ClassVar[bool] = False  # may have a sliding window (Mistral)

    def check(self, cfg: ModelConfig) -> None:
        n = self.name
        if cfg.position != "rope":
            raise UserError(f"position={cfg.position!r}: the {n} family uses rotary positions")
        if cfg.bias:
            raise UserError(f"bias=True: the {n} family has no biases in its linears or norms")
        if cfg.embed_norm:
            raise UserError(f"embed_norm=True: the {n} family has no norm after the embedding")
        if cfg.head_dim % 2:
            raise UserError(f"head dimension {cfg.head_dim} must be even for rotary positions")
        if cfg.qkv_bias != self.has_qkv_bias:
            say = "always has" if self.has_qkv_bias else "has no"
            raise UserError(f"qkv_bias={cfg.qkv_bias}: the {n} family {say} q/k/v biases")
        if cfg.qk_norm != self.has_qk_norm:
            say = "always normalises" if self.has_qk_norm else "does not normalise"
            raise UserError(f"qk_norm={cfg.qk_norm}: the {n} family {say} q and k per head")
        if cfg.sliding_window is not None and not self.has_window:
            raise UserError(
                f"sliding_window={cfg.sliding_window}: the {n} family has no sliding window "
                "(mistral has); drop it"
            )

    def ffn_default(self, cfg: ModelConfig) -> int:
        """Llama's rule: two thirds of 4·hidden (the gate makes three matrices of it), rounded
        up to a multiple of 256."""
        return 256 * math.ceil(int(8 * cfg.n_embd / 3) / 256)

    def tp_sizes(self, cfg: ModelConfig) -> list[tuple[int, str]]:
        return [
            (cfg.n_head, "the head count (--heads)"),
            (cfg.kv_heads, "the key/value heads (--kv-heads)"),
            (cfg.ffn_width, "the MLP width (--ffn-hidden)"),
            (cfg.padded_vocab_size, "the padded vocabulary"),
        ]

    def num_params(self, cfg: ModelConfig) -> int:
        """Exact, equal to Llama.num_params() (checked by the tests): per block two norms (2H),
        q (N·D·H), kv (2·K·D·H), proj (H·N·D) and the MLP (3·F·H), with qkv_bias N·D + 2·K·D
        more and qk_norm 2·D; then the embedding V·H, the final norm H, and an untied head V·H."""
        H, N, K, D, F = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.ffn_width
        per_block = 2 * H + 2 * N * D * H + 2 * K * D * H + 3 * F * H
        if cfg.qkv_bias:
            per_block += N * D + 2 * K * D
        if cfg.qk_norm:
            per_block += 2 * D
        V = cfg.padded_vocab_size
        return cfg.n_layer * per_block + V * H + H + (0 if cfg.tie_embeddings else V * H)

    def flops_per_token(self, cfg: ModelConfig) -> float:
        """6 per parameter that multiplies (the input embedding is a lookup: its V·H are left
        out when the head has its own, and counted as the head's when tied), plus attention's
        QK^T and AV over the full S×S square: 12·L·N·D·S."""
        n = self.num_params(cfg)
        if not cfg.tie_embeddings:
            n -= cfg.padded_vocab_size * cfg.n_embd
        attn = 12.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.seq_len
        return 6.0 * n + attn

    def block_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """Left whole by TP, 4H: the two RMSNorms' inputs and outputs (a fused RMSNorm keeps
        its input and per-token statistics; CPU's decomposed one keeps one H more). Cut by it,
        as measured on the CPU (tests/test_llama.py): q and k after the rotation (N·D + K·D),
        v, a view that holds kv's whole output (2·K·D), and attention's output, which proj
        reads as a view (N·D; GPT-2's count has a re-laid copy of it too); the MLP's gate and
        up (2F), silu(gate) and the product proj reads (2F); with qk_norm q before its norm
        (N·D; k's is the kv output already held). Flash attention: no S² term."""
        N, K, D, F = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.ffn_width
        cut = 2 * N * D + 3 * K * D + 4 * F
        if cfg.qk_norm:
            cut += N * D
        return 4 * cfg.n_embd, cut

    def mlp_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """Saved whole: gate and up, silu(gate) and the product (4F, block_activations' MLP
        part). A piece's backward at its peak (measured, tests/test_long.py: 6F less H): the
        recomputed gate and up, their gradients' concatenation (2F) and the two gradients it
        is made of (2F)."""
        return 4 * cfg.ffn_width, 6 * cfg.ffn_width


class Qwen2Family(LlamaFamily):
    name = "qwen2"
    has_qkv_bias = True


class Qwen3Family(LlamaFamily):
    name = "qwen3"
    has_qk_norm = True


class MistralFamily(LlamaFamily):
    name = "mistral"
    has_window = True


Llama.family = register_family(LlamaFamily())  # each instance: its config's (Llama.__init__)
for _family in (Qwen2Family(), Qwen3Family(), MistralFamily()):
    register_family(_family)
