"""Attention kept inside each of the samples packed into a row (`fitgpt data preprocess --chat`).

A packed row holds several samples, numbered by their segment ids (data/source.py: 0, 1, ...
along the row, never decreasing). Trained as it is, a sample would attend to the samples before
it in its row, and its positions would continue from theirs. Packing, made once per forward from
the segment ids and handed to every block, keeps each sample as it would be alone:

  positions_BT   each token's position inside its own sample (0 at its first token): the
                 rotary tables and GPT-2's learnt positions are taken at these
  attention      a query sees only keys of its own segment, causally (and, with Mistral's
                 sliding window, only the last `window` of them)

Two ways to apply the attention rule, chosen once here (Packing.of):
  mask (the reference, and every CPU run): SDPA with a boolean [B, 1, T, T] block-diagonal
       causal mask (a float one with ALiBi's bias folded in: [B, N, T, T]). Costs B·T² bytes
       per forward (B·N·T²·4 with ALiBi), shared by the blocks, and SDPA's masked kernels,
       which read the mask and skip no block of the square.
  flex (CUDA, no dropout, no ALiBi): FlexAttention with a document mask. No T×T tensor: a
       BlockMask of (T/128)² block flags per row, and the kernel skips the blocks that cross
       samples, so a row of short samples costs less than a full causal square.
Why FlexAttention and not torch.nn.attention.varlen.varlen_attn (read in the venv's torch
2.13, and in an earlier release's source): varlen's signature changed between releases
(`is_causal=` and no window or grouped-query heads then; causal as `window_size=(-1, 0)` and
`enable_gqa` in 2.13), so one call is not known to serve the GPU's torch 2.11 and the CPU's
2.13 alike; it takes no additive bias (ALiBi) nor dropout, and its max_q argument is a Python
int that changes with every batch (a recompile per step under --compile). flex_attention's
call (block_mask, enable_gqa) is the same from 2.5 to 2.13, takes the window and the document
rule as one mask function, and its lengths are the row's T. Its cost: it runs fast only
compiled (torch.compile of flex_attention, once per shape; eager flex materialises the
scores), and dropout needs the mask path. FlexAttention has no CPU backward, so CPU runs keep
the mask path; its forward on the CPU equals the mask's (tests/test_packing.py).
benchmarks/parts/packed_attention_gpu.py checks flex against the mask path on a GPU and times both.

Mistral's sliding window over rows of one sequence each is the same rule with one segment: on
CUDA, past the window, Packing.window gives the blocks a flex Packing of a single segment
(no T×T mask: at 128 k tokens the boolean mask is 16 GiB); the CPU keeps the attention's own
mask (the reference). Generation (the KV cache) never packs: a cache serves one sequence per
row.

Shape legend: B batch, T tokens, N query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig


def segment_positions(segments_BT: Tensor) -> Tensor:
    """Each token's position inside its own sample, int64 [B, T]: 0 at every sample's first
    token. Segment ids never decrease along a row (BatchLoader.next_with_segments)."""
    T = segments_BT.shape[1]
    t = torch.arange(T, device=segments_BT.device).expand_as(segments_BT)
    new = torch.ones_like(segments_BT, dtype=torch.bool)
    new[:, 1:] = segments_BT[:, 1:] != segments_BT[:, :-1]
    start = torch.where(new, t, torch.zeros_like(t)).cummax(dim=1).values  # where each began
    return t - start


def keep_mask(segments_BT: Tensor, window: int | None) -> Tensor:
    """[B, 1, T, T] boolean, True where query i may see key j: same segment, j <= i, and with
    a window, j > i - window."""
    T = segments_BT.shape[1]
    i = torch.arange(T, device=segments_BT.device)[:, None]
    j = torch.arange(T, device=segments_BT.device)[None, :]
    keep = j <= i
    if window is not None:
        keep = keep & (j > i - window)
    same = segments_BT[:, :, None] == segments_BT[:, None, :]  # [B, T, T]
    return (same & keep)[:, None]


_FLEX: dict[str, Any] = {}  # the compiled flex_attention and create_block_mask, made once


def _flex() -> tuple[Any, Any]:
    """(compiled flex_attention, create_block_mask); imported on first use: torch's flex module
    pulls in dynamo, 1.5 s at start."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        _FLEX["attn"] = torch.compile(flex_attention, dynamic=False)
        _FLEX["mask"] = create_block_mask
    return _FLEX["attn"], _FLEX["mask"]


def block_mask(segments_BT: Tensor, window: int | None) -> Any:
    """FlexAttention's BlockMask of the same rule as keep_mask, without a T×T tensor."""
    _, create = _flex()
    seg = segments_BT

    def document(b, h, q, k):
        m = (seg[b, q] == seg[b, k]) & (k <= q)
        return m & (q - k < window) if window is not None else m

    B, T = seg.shape
    return create(document, B, None, T, T, device=seg.device, _compile=True)


def _flex_serves(device: torch.device, cfg: ModelConfig, dropout: float, takes_flex: bool) -> bool:
    """FlexAttention on CUDA, without dropout (it has none) or ALiBi's additive bias, for a
    family whose attention takes it (`takes_flex`: its Family.flex_attention, which the
    network hands in; gpt-oss's sinks do not take it)."""
    return device.type == "cuda" and dropout == 0.0 and cfg.position != "alibi" and takes_flex


def window_block_mask(T: int, window: int | None, device) -> Any:
    """FlexAttention's BlockMask of a causal window over one sequence (query i sees keys
    i-window+1..i; None: every key up to i), made once for every row and head (B and H
    broadcast): (T/128)² flags."""
    _, create = _flex()

    def sliding(b, h, q, k):
        return (k <= q) & (q - k < window) if window is not None else k <= q

    return create(sliding, None, None, T, T, device=device, _compile=True)


def flex_attention_fn() -> Any:
    """The compiled flex_attention every FlexAttention path calls (made once: _flex)."""
    return _flex()[0]


def flex_serves(device: torch.device, cfg: ModelConfig, dropout: float) -> bool:
    """Whether a family with its own FlexAttention path (gpt-oss's sinks) may take it: the rule
    of _flex_serves, for the attention that asks."""
    return _flex_serves(device, cfg, dropout, True)


@dataclass(frozen=True)
class Packing:
    """What every block needs to keep packed samples apart, made once per forward (Packing.of):
    the positions, and either the SDPA mask (`mask`) or FlexAttention's block mask (`flex`)."""

    segments_BT: Tensor
    positions_BT: Tensor
    mask: Tensor | None = None  # bool [B, 1, T, T], or float [B, N, T, T] with a bias folded in
    flex: Any = None  # BlockMask

    @staticmethod
    def of(segments_BT: Tensor, cfg: ModelConfig, dropout: float, takes_flex: bool) -> Packing:
        """The one place the kernel is chosen (module docstring): flex on CUDA without dropout
        or ALiBi's additive bias, the boolean mask otherwise; the window is the config's."""
        positions = segment_positions(segments_BT)
        window = cfg.sliding_window
        if _flex_serves(segments_BT.device, cfg, dropout, takes_flex):
            return Packing(segments_BT, positions, flex=block_mask(segments_BT, window))
        return Packing(segments_BT, positions, mask=keep_mask(segments_BT, window))

    @staticmethod
    def window(
        T: int, cfg: ModelConfig, device, dropout: float, takes_flex: bool
    ) -> Packing | None:
        """Mistral's sliding window over rows of one sequence each, longer than the window: on
        CUDA (no dropout) the rule of one segment by FlexAttention, a [1, T] segment row
        broadcast over the batch (no T×T tensor; the kernel skips the blocks outside the
        window, so attention costs T·window, not T²/2). None elsewhere: the attention's own
        boolean [T, T] mask (families/llama/model.py GroupedQueryAttention.mask), the CPU
        reference, T² bytes (16 GiB at 128 k tokens) and a masked kernel over the whole
        square."""
        w = cfg.sliding_window
        if w is None or w >= T or not _flex_serves(torch.device(device), cfg, dropout, takes_flex):
            return None
        seg = torch.zeros(1, T, dtype=torch.int64, device=device)
        return Packing(seg, segment_positions(seg), flex=window_block_mask(T, w, device))

    def with_bias(self, bias_NTT: Tensor) -> Packing:
        """ALiBi: its additive bias folded into the mask, -inf across samples: a float
        [B, N, T, T], B times the bias's own memory."""
        mask = bias_NTT[None].masked_fill(~self.mask, float("-inf"))
        return Packing(self.segments_BT, self.positions_BT, mask=mask)

    def attend(self, q_BNTD: Tensor, k_BKTD: Tensor, v_BKTD: Tensor, dropout: float) -> Tensor:
        """Attention of q over k, v within each sample: [B, N, T, D]."""
        gqa = k_BKTD.shape[1] != q_BNTD.shape[1]
        if self.flex is not None:
            attn, _ = _flex()
            return attn(q_BNTD, k_BKTD, v_BKTD, block_mask=self.flex, enable_gqa=gqa)
        mask = self.mask if self.mask.dtype == torch.bool else self.mask.to(q_BNTD.dtype)
        kw = {"enable_gqa": True} if gqa else {}
        return F.scaled_dot_product_attention(
            q_BNTD, k_BKTD, v_BKTD, attn_mask=mask, dropout_p=dropout, **kw
        )
