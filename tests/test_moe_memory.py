"""What the planner prices a sparse block's MLP at (Family.block_activations' expert part)
against what it saves for the backward, tensor by tensor, on the CPU: Qwen3-MoE's SwiGLU
experts and gpt-oss's clamped, biased ones."""

from __future__ import annotations

import pytest
import torch

from fitgpt.model import build_model, get_preset
from fitgpt.model.families import family_of
from fitgpt.model.families.llama.family import LlamaFamily

SMALL = dict(
    n_layer=1, n_embd=64, n_head=4, n_kv_head=2, head_size=16, moe_ffn_hidden=48,
    num_experts=8, experts_per_token=3, vocab_size=256, seq_len=64, ffn_hidden=96,
)  # fmt: skip


def saved_by_the_mlp(cfg, B: int = 2) -> int:
    """Elements (of their own dtype) of the distinct storages one sparse MLP's forward saves,
    its input and parameters aside."""
    block = build_model(cfg).train().blocks[0]
    T = cfg.seq_len
    x = block.ln_2(torch.randn(B, T, cfg.n_embd))
    skip = {t.untyped_storage().data_ptr() for t in [*block.parameters(), x]}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            saved[st.data_ptr()] = st.nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block.mlp(x)
    return sum(saved.values()) // (B * T)


@pytest.mark.parametrize("preset", ["qwen3-moe-30b-a3b", "gpt-oss-20b"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_sparse_mlp_saves_what_the_planner_prices(preset, k):
    cfg = get_preset(preset).replace(**{**SMALL, "experts_per_token": k})
    fam = family_of(cfg)
    _, cut = fam.block_activations(cfg)
    attention = LlamaFamily.block_activations(fam, cfg)[1] - 4 * cfg.ffn_width
    if preset.startswith("gpt-oss"):  # the sinks' flex path (CUDA), priced with attention
        attention += cfg.n_head * cfg.head_dim + cfg.n_head
    # exact to the row widths (H, F': 48-64 here); the routing's index bookkeeping within k
    assert abs(saved_by_the_mlp(cfg) - (cut - attention)) <= k


def test_a_sparse_backward_is_priced_by_its_rows_and_its_experts():
    """The working set beside the saved one grows with k (rows per token) and E (the experts'
    whole gradient), and a dense family prices none."""
    cfg = get_preset("qwen3-moe-30b-a3b").replace(**SMALL)
    fam = family_of(cfg)
    one = fam.mlp_backward_bytes(cfg, 1000, 2)
    assert fam.mlp_backward_bytes(cfg.replace(experts_per_token=4), 1000, 2) > one
    assert fam.mlp_backward_bytes(cfg.replace(num_experts=16), 1000, 2) > one
    dense = get_preset("tiny")
    assert family_of(dense).mlp_backward_bytes(dense, 1000, 2) == 0
