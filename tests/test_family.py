"""A second model family, defined here in the tests only, trains through every engine.

The family differs from GPT-2 where the engine, the planner and tensor parallelism would notice
if they assumed GPT-2: RMSNorm without biases, no position table, a gated MLP of three linears
(two column-parallel, one row-parallel) 3·h wide, and an untied head. Nothing in fitgpt names it:
it is built, split, placed, priced and initialised through model/family.py alone.
"""

import json
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from helpers import TWO_RANK_ENGINES, close, engine_losses, two_rank_losses
from torch import Tensor, nn

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.layout import chunk_layout
from fitgpt.errors import UserError
from fitgpt.model import DecoderLM, Family, ModelConfig, Split, build_model, register_family
from fitgpt.model.gpt import CausalSelfAttention
from fitgpt.parallel.shard import check_tensor_parallel
from fitgpt.plan.memory import Workload, activation_bytes, zero_state


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        f = 3 * cfg.n_embd
        self.gate = nn.Linear(cfg.n_embd, f, bias=False)
        self.up = nn.Linear(cfg.n_embd, f, bias=False)
        self.down = nn.Linear(f, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GatedBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_1 = nn.RMSNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)  # bias=False in CFG: no biases anywhere
        self.norm_2 = nn.RMSNorm(cfg.n_embd)
        self.mlp = GatedMLP(cfg)

    def forward(self, x: Tensor, cache=None, layer: int = 0, aux=None) -> Tensor:
        x = x + self.attn(self.norm_1(x), cache, layer, aux)
        return x + self.mlp(self.norm_2(x))


class GatedLM(DecoderLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(GatedBlock(cfg) for _ in range(cfg.n_layer))
        self.norm_f = nn.RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)

    def embed_rest(self, x: Tensor, start: int) -> Tensor:
        return x  # no positions: causal attention alone orders the tokens

    def final_norm(self, x: Tensor) -> Tensor:
        return self.norm_f(x)

    def head_weight(self) -> Tensor:
        return self.lm_head.weight

    def init_std(self, name: str) -> float | None:
        if ".norm" in name or name.startswith("norm_f"):
            return None
        return 0.01 if name.endswith(("down.weight", "attn.proj.weight")) else 0.03

    def split_heads(self, rank: int, tp: int) -> None:
        for block in self.blocks:
            block.attn.n_head = self.cfg.n_head // tp


class GatedFamily(Family):
    name = "gated-test"
    model = GatedLM
    splits: ClassVar[dict[str, Split]] = {
        "attn.qkv.weight": Split(0, 3),
        "attn.proj.weight": Split(1),
        "mlp.gate.weight": Split(0),
        "mlp.up.weight": Split(0),
        "mlp.down.weight": Split(1),
        "wte.weight": Split(0),
        "lm_head.weight": Split(0),
    }

    def tp_sizes(self, cfg):
        return [(cfg.n_head, "the heads"), (3 * cfg.n_embd, "the gated MLP's 3·hidden"),
                (cfg.padded_vocab_size, "the padded vocabulary")]  # fmt: skip

    def num_params(self, cfg):
        h, V = cfg.n_embd, cfg.padded_vocab_size
        return cfg.n_layer * (4 * h * h + 9 * h * h + 2 * h) + 2 * V * h + h

    def block_activations(self, cfg):
        return 4 * cfg.n_embd, 14 * cfg.n_embd


GatedLM.family = register_family(GatedFamily())
CFG = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=32, vocab_size=96, bias=False,
                  family="gated-test")  # fmt: skip
CPU = DistContext(0, 1, 0, torch.device("cpu"))
STEPS = 8
CLIP = 0.3  # below the first steps' norms: clipping is active


def step_losses(ecfg: EngineConfig, ctx: DistContext) -> dict:
    return engine_losses(CFG, ecfg, ctx, STEPS, CLIP)


def two_rank_worker(rank: int, world: int, tmp: str) -> None:
    two_rank_losses({"gated": (CFG, list(TWO_RANK_ENGINES))}, tmp, STEPS, CLIP)


def test_the_family_is_built_counted_and_split_as_it_says():
    with torch.device("meta"):
        model = build_model(CFG)
    assert isinstance(model, GatedLM) and model.num_params() == CFG.num_params()
    assert CFG.flops_per_token() == 6 * CFG.num_params() + 12 * 2 * 32 * 32
    cut = {s.name: s.split for c in chunk_layout(model) for s in c.slots}
    assert cut["blocks.1.mlp.up.weight"] == Split(0) and cut["blocks.1.norm_2.weight"] is None
    # T must divide the family's sizes: 3 does not divide 4 heads, 2 divides all
    with pytest.raises(UserError, match="the heads"):
        check_tensor_parallel(3, CFG, 6)
    check_tensor_parallel(2, CFG, 2)
    # the planner prices the family's activations: (4h + 14h/T) per token per block
    work = Workload(CFG, 4, precision="fp32", device="cpu")
    one, two = (activation_bytes(work, "off", tp)["activations"] for tp in (1, 2))
    # 7h of 14h per token saved at T=2, and the softmax statistics of 2 of the 4 heads (fp32)
    assert one - two == CFG.n_layer * (7 * 32 * 4 * 32 * 4 + 4 * 2 * 32 * 4)


def test_the_family_trains_through_every_engine_stage_offload_and_tensor_parallel(tmp_path, gloo):
    ref = step_losses(EngineConfig(engine="ddp"), CPU)
    assert max(ref["norm"]) > CLIP and len(set(ref["loss"])) == STEPS  # clipped, and moving
    for ecfg in (EngineConfig(engine="zero", zero_stage=0, checkpointing="full"),
                 EngineConfig(engine="zero", zero_stage=0, offload_optimizer="cpu",
                              offload_blocks=2)):  # fmt: skip
        got = step_losses(ecfg, CPU)
        assert close(got["loss"], ref["loss"]) and close(got["norm"], ref["norm"]), ecfg
        # the planner's bytes are the engine's for this family too
        nonzero = {k: v for k, v in got["mem"]["cpu"].items() if v}
        want = zero_state(Workload(CFG, 4, precision="fp32", device="cpu"), ecfg)["device"]
        assert nonzero == {k: v for k, v in want.items() if v}
    gloo(2, two_rank_worker, str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())["gated"]
    for key in TWO_RANK_ENGINES:
        assert close(res[key]["loss"], ref["loss"]), (key, res[key]["loss"], ref["loss"])
        assert close(res[key]["norm"], ref["norm"]), key
    assert "ColumnParallelLinear" in res["tp2_ddp"]["classes"]
    assert "RowParallelLinear" in res["tp2_zero2_sp"]["classes"]
