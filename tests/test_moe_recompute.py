"""What a sparse model's backward holds under ZeRO-3 and activation checkpointing, at world size
2 on gloo: the bytes of live tensors do not grow as the backward walks down the blocks, no
sparse MLP keeps its recompute's routing (engine/transforms/activation.py _Recompute), and at
most two blocks' full weights are resident at once (engine/chunked/fetch.py), which is what
the planner's gathered_weights prices (a sparse layer's two chunks each, where it priced the
experts' chunk alone before 2026-11-28).

Before 2026-11-28 each block's recompute left its routing statistics, and with them the graph
of everything the recompute saved before the router, on its SparseMoe until the next forward:
one layer's attention activations more for every block already through its backward (10-15 GiB
unpriced at the backward's peak of Qwen3-MoE-30B on 4 H200s)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fitgpt.dist import init_distributed
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.interop.hf import model_config_from_hf
from fitgpt.plan.memory import Workload, estimate

LAYERS = 4
# every layer sparse, width 32, 4 experts, top 2
TINY = model_config_from_hf(
    dict(model_type="qwen3_moe", hidden_size=32, num_hidden_layers=LAYERS,
         num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
         moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
         vocab_size=128, max_position_embeddings=32, bos_token_id=1, eos_token_id=2),
    "tiny",
)  # fmt: skip


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops allocated under it and that are still alive: every
    op's fresh outputs (outputs that alias an input, in-place ops' and views, are someone
    else's storage), each storage counted once, forgotten when freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.live.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
        return out

    def total(self) -> int:
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        return sum(n for _, n in self.live.values())


ZERO3 = EngineConfig(engine="zero", zero_stage=3, checkpointing="full")


def _worker(rank, world, tmp) -> None:
    ctx = init_distributed("cpu").laid_out(1, 1, 1)
    ecfg = ZERO3
    e = build_engine(TINY, ecfg, PrecisionConfig(precision="fp32"), OptimConfig(), ctx)
    mode, marks = LiveBytes(), []

    def mark(layer: int) -> None:
        marks.append({
            "layer": layer,
            "live": mode.total(),
            "resident_layers": sorted({c.spec.layer for c in e.blocks if c.resident}),
            "routes": sum(m.route is not None for m in e.model.sparse_mlps()),
            "resident_bytes": sum(c.weight.nbytes for c in e.blocks if c.resident),
        })  # fmt: skip

    for i, block in enumerate(e.model.blocks):
        block.register_full_backward_pre_hook(lambda _m, _g, i=i: mark(i))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1), generator=g)
    for _ in range(2):  # the second step's backward, once every buffer exists
        marks.clear()
        with mode:
            e.train_step([(x[:, :-1], x[:, 1:])], 1e-3)
    after = sum(m.route is not None for m in e.model.sparse_mlps())
    e.close()
    if rank == 0:
        (Path(tmp) / "marks.json").write_text(json.dumps({"marks": marks, "after": after}))


def test_a_sparse_backward_under_zero3_and_recompute_holds_no_more_as_it_goes(gloo, tmp_path):
    gloo(2, _worker, str(tmp_path))
    res = json.loads((tmp_path / "marks.json").read_text())
    marks = res["marks"]
    assert [m["layer"] for m in marks] == list(reversed(range(LAYERS)))
    # nothing of a finished block's recompute stays: what is alive at a block's backward does
    # not grow from the second block's (the first holds the head's transients) to the last's
    live = [m["live"] for m in marks[1:]]
    assert max(live) == live[0], live
    assert all(m["routes"] == 0 for m in marks) and res["after"] == 0
    # a block and the one prefetched below it, as the planner prices them: a sparse layer's
    # two chunks (the block's, its experts') each
    assert all(len(m["resident_layers"]) <= 2 for m in marks)
    est = estimate(Workload(TINY, 2, world=2, precision="fp32", device="cpu"), ZERO3)
    assert max(m["resident_bytes"] for m in marks) == est.host["gathered_weights"]
