"""A second model family, defined outside fitgpt in a folder of its own (tests/families/gated/,
as a plugin would be), trains through every engine.

The family differs from GPT-2 where the engine, the planner and tensor parallelism would notice
if they assumed GPT-2: RMSNorm without biases, no position table, a gated MLP of three linears
(two column-parallel, one row-parallel) 3·h wide, and an untied head. Nothing in fitgpt names it:
it is built, split, placed, priced and initialised through model/family.py alone, and registered
with register_family.
"""

import importlib
import json

import pytest
import torch
from families.gated.model import GatedLM
from families.gated.presets import TINY as CFG
from helpers import TWO_RANK_ENGINES, close, engine_losses, two_rank_losses

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.layout import chunk_layout
from fitgpt.errors import UserError
from fitgpt.interop.hf import check_exportable, mapping_for_hf, mapping_for_model
from fitgpt.model import PRESETS, ModelConfig, Split, build_model, family_of
from fitgpt.model.families import TABLE, module
from fitgpt.parallel.shard import tensor_parallel_refusal
from fitgpt.plan.memory import Workload, activation_bytes, zero_state

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
    assert "the heads" in tensor_parallel_refusal(3, CFG, 6)
    assert tensor_parallel_refusal(2, CFG, 2) is None
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


def test_the_registry_is_a_table_of_folders_loaded_by_name():
    """Each line of TABLE is a folder whose family.py, presets.py and hf.py answer for that name
    (its Family, its presets, its map for each model_type it lists), and nothing else does."""
    gathered = []
    for name, types in TABLE.items():
        family = importlib.import_module(module(name, "family")).FAMILY
        mapping = importlib.import_module(module(name, "hf")).MAPPING
        presets = importlib.import_module(module(name, "presets")).PRESETS
        assert family.name == name and presets, name
        for key, cfg in presets.items():
            assert cfg.family == name and PRESETS[key] is cfg and family_of(cfg) is family, key
            assert mapping_for_model(cfg) is mapping and build_model_family(cfg) is family, key
        assert [mapping_for_hf({"model_type": t}, "c") for t in types] == [mapping] * len(types)
        gathered += presets
    assert gathered == list(PRESETS)  # `fitgpt presets` lists them in the table's order
    with pytest.raises(UserError, match=r"family 'nope' is unknown: use one of gated-test, gpt2,"):
        ModelConfig(family="nope")
    # a family registered from outside builds and trains (above) but has no Hugging Face map
    with pytest.raises(UserError, match="family 'gated-test' has no Hugging Face mapping"):
        check_exportable(CFG)


def build_model_family(cfg: ModelConfig):
    """The Family build_model sets on the network it builds for `cfg` (on the meta device)."""
    with torch.device("meta"):
        return build_model(cfg).family
