"""Attention through FlexAttention as the step model prices it (plan/throughput.py): the keys
its kernel scores, counted from the BlockMask torch builds, and gpt-oss's sink kernel's time
(Family.attention_time) against the measurement it was taken from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.nn.attention.flex_attention import create_block_mask

from fitgpt.model import get_preset
from fitgpt.model.families import family_of
from fitgpt.plan import rates
from fitgpt.plan.throughput import FLEX_BLOCK, efficiency, flex_keys, keys_per_query

SINK = Path(__file__).resolve().parents[1] / "benchmarks/results/moe_sink_h200_2026-11-28/sink.json"


def scored_keys(S: int, W: int | None) -> float:
    """Keys per query in the blocks torch's BlockMask has the kernel visit (partial and full)."""

    def mask(b, h, q, k):
        return (k <= q) & (q - k < W) if W is not None else k <= q

    bm = create_block_mask(mask, None, None, S, S, device="cpu")
    assert bm.BLOCK_SIZE == (FLEX_BLOCK, FLEX_BLOCK)
    blocks = int(bm.kv_num_blocks.sum())
    if bm.full_kv_num_blocks is not None:
        blocks += int(bm.full_kv_num_blocks.sum())
    return FLEX_BLOCK * blocks / -(-S // FLEX_BLOCK)


@pytest.mark.parametrize("S", [256, 1024, 2048])
@pytest.mark.parametrize("W", [None, 64, 128, 129, 300, 4096])
def test_flex_keys_are_the_blocks_the_kernel_scores(S, W):
    assert flex_keys(S, W) == pytest.approx(scored_keys(S, W))
    # never fewer than the window's own keys, never more than the causal square's blocks
    exact = S / 2 if W is None or W >= S else W - W * W / (2 * S)
    assert exact <= flex_keys(S, W) <= flex_keys(S, None)


def test_gpt_oss_prices_its_sliding_layers_by_the_blocks():
    m = get_preset("gpt-oss-20b").replace(seq_len=2048)
    windows = family_of(m).layer_windows(m)
    want = sum(scored_keys(2048, w) for w in windows) / len(windows)
    assert keys_per_query(m, "cuda") == pytest.approx(want)


def test_gpt_oss_attention_time_is_its_measured_kernel_over_the_price():
    """The constant against sink.json: a full and a sliding layer forward + backward at 4 ×
    4,096 tokens, over what the planner prices for them on an H200 (its default rates)."""
    rec = json.loads(SINK.read_text())
    assert rec["gpu"] == "NVIDIA H200"
    measured = rec["full_bfloat16_4x4096"]["flex_s"] + rec["sliding128_bfloat16_4x4096"]["flex_s"]
    m = get_preset("gpt-oss-20b")
    r = rates.load("NVIDIA H200")
    rate = r.attn_tflops * 1e12 * efficiency(m.n_embd, r.model_efficiency) / r.model_efficiency
    N, D, T = m.n_head, m.head_dim, 4 * 4096
    keys = flex_keys(4096, None) + flex_keys(4096, m.sliding_window)
    priced = 12 * N * D * keys * T / rate
    assert family_of(m).attention_time == pytest.approx(measured / priced, rel=0.01)
