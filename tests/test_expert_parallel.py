"""Expert parallelism (fitgpt/parallel/experts.py, --expert-parallel P): at world size 2 on gloo,
P = 2 with ZeRO 0-3, the offloaded optimizer and offloaded experts equals one process over 3
steps; a checkpoint saved at P = 2 resumes at P = 1 to the same next loss, and one saved at
P = 1 at P = 2; the refusals are one line. One gloo job serves every case (the aux loss off:
each rank balances its own rows, as under data parallelism)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import close, engine_losses, step_batches

from fitgpt.dist import DistContext, init_distributed
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.engine.layout import chunk_layout
from fitgpt.errors import UserError
from fitgpt.interop.hf import model_config_from_hf
from fitgpt.model import build_model, get_preset
from fitgpt.parallel.experts import expert_parallel_refusal
from fitgpt.plan.memory import Workload, placement_of, zero_state
from fitgpt.plan.rates import DEFAULTS
from fitgpt.plan.throughput import step_time
from fitgpt.plan.validate import refusal

# 2 layers, width 32, 4 experts, top 2, every layer sparse
TINY = model_config_from_hf(
    dict(model_type="qwen3_moe", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
         num_key_value_heads=1, head_dim=16, intermediate_size=64, moe_intermediate_size=16,
         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=128,
         max_position_embeddings=16, bos_token_id=1, eos_token_id=2),
    "tiny",
)  # fmt: skip
# gpt-oss's experts: [E, H, 2F] weights and [E, 2F] biases, the clamped SwiGLU
GPT_OSS = model_config_from_hf(
    dict(model_type="gpt_oss", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
         num_key_value_heads=1, head_dim=16, intermediate_size=16, num_local_experts=4,
         num_experts_per_tok=2, sliding_window=6, vocab_size=128, max_position_embeddings=16,
         bos_token_id=1, eos_token_id=2),
    "tiny-gpt-oss",
)  # fmt: skip
STEPS = 3
EP = {
    "ep2_zero0": EngineConfig(engine="zero", expert_parallel=2),
    "ep2_zero1": EngineConfig(engine="zero", zero_stage=1, expert_parallel=2),
    "ep2_zero2": EngineConfig(engine="zero", zero_stage=2, expert_parallel=2),
    "ep2_zero3": EngineConfig(engine="zero", zero_stage=3, expert_parallel=2, checkpointing="full"),
    "ep2_offload": EngineConfig(engine="zero", zero_stage=1, expert_parallel=2,
                                offload_optimizer="cpu", offload_blocks=1),
    "ep2_offload_experts": EngineConfig(engine="zero", zero_stage=2, expert_parallel=2,
                                        offload_optimizer="cpu", offload_experts=True),
    # the experts' weights streamed from host RAM, attention and router resident
    "ep2_stream_experts": EngineConfig(engine="zero", zero_stage=3, expert_parallel=2,
                                       offload_optimizer="cpu", offload_params="cpu",
                                       offload_experts=True),
}  # fmt: skip


def engine(ecfg: EngineConfig, ctx: DistContext):
    ctx = ctx.laid_out(1, 1, ecfg.expert_parallel)
    return build_engine(TINY, ecfg, PrecisionConfig(precision="fp32"), OptimConfig(), ctx)


def losses_from(e, start: int, stop: int) -> list[float]:
    return [e.train_step(step_batches(e, TINY, s), 3e-3).loss for s in range(start, stop)]


def saved_then_next(ecfg: EngineConfig, ctx: DistContext, folder: Path) -> tuple[float, list]:
    """Two steps, a checkpoint into `folder`, then the third step's loss, and each parameter's
    sum of squares of the whole model for sampling after the second step."""
    e = engine(ecfg, ctx)
    losses_from(e, 0, 2)
    whole = e.inference_model()  # collective under expert parallelism: every expert gathered
    sums = [p.double().square().sum().item() for p in whole.parameters()]
    folder.mkdir(exist_ok=True)
    ctx.barrier()
    e.save_state(folder)
    extra = e.extra_state()
    ctx.barrier()
    (folder / "extra.json").write_text(json.dumps(extra))
    (loss,) = losses_from(e, 2, 3)
    e.close()
    return loss, sums


def resumed_next(ecfg: EngineConfig, ctx: DistContext, folder: Path) -> float:
    e = engine(ecfg, ctx)
    e.load_state(folder, json.loads((folder / "extra.json").read_text()))
    (loss,) = losses_from(e, 2, 3)
    e.close()
    return loss


def _worker(rank, world, tmp) -> None:
    ctx = init_distributed("cpu")
    tmp = Path(tmp)
    res = {key: engine_losses(TINY, ecfg, ctx, STEPS, 1.0) for key, ecfg in EP.items()}
    res = {key: {k: r[k] for k in ("loss", "norm", "shapes", "mem")} for key, r in res.items()}
    res["gpt_oss"] = engine_losses(GPT_OSS, EP["ep2_zero1"], ctx, STEPS, 1.0)
    res["gpt_oss"]["shapes"] = res["gpt_oss"]["shapes"]["blocks.0.mlp.experts.gate_up_bias"]
    # saved at P = 2 (ZeRO 1: each rank writes its shard of the dense chunks and its experts)
    res["saved_ep2_next"], res["whole_ep2"] = saved_then_next(EP["ep2_zero1"], ctx, tmp / "ep2")
    # saved at P = 1 by one process, resumed at P = 2 with ZeRO 2
    res["resumed_ep2_next"] = resumed_next(EP["ep2_zero2"], ctx, tmp / "ep1")
    if ctx.rank == 0:
        (tmp / "results.json").write_text(json.dumps(res))


def test_expert_parallel_at_world_size_2_equals_one_process(gloo, tmp_path):
    one_ctx = DistContext(0, 1, 0, torch.device("cpu"))
    plain = EngineConfig(engine="zero")
    ref = engine_losses(TINY, plain, one_ctx, STEPS, 1.0)
    one = ref["loss"]
    one_next, whole = saved_then_next(plain, one_ctx, tmp_path / "ep1")
    assert close([one_next], one[2:])
    gloo(2, _worker, str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())
    for key in EP:
        # the norms too: Adam forgives a gradient scaled wrongly, the clip and the norm do not
        assert close(res[key]["loss"], one) and close(res[key]["norm"], ref["norm"]), key
        assert res[key]["shapes"]["blocks.1.mlp.experts.fc"] == [2 * 2 * 16, 32]  # 2 of 4
        # the planner's state bytes are the engine's, the experts' chunks 1/P of theirs
        pred = zero_state(Workload(TINY, 2, world=2, precision="fp32", device="cpu"), EP[key])
        for tier, rep in (
            ("device", res[key]["mem"]["cpu"]),
            ("host", res[key]["mem"].get("host")),
        ):
            assert nonzero(rep or {}) == nonzero(pred.get(tier, {})), (key, tier)
    oss = engine_losses(GPT_OSS, plain, one_ctx, STEPS, 1.0)
    assert close(res["gpt_oss"]["loss"], oss["loss"]) and close(res["gpt_oss"]["norm"], oss["norm"])
    assert res["gpt_oss"]["shapes"] == [2, 32]  # 2 of the 4 experts' biases
    assert close(res["whole_ep2"], whole)  # the model for sampling holds every expert
    # the full layout on disk: every expert, whichever P wrote it
    assert close([resumed_next(plain, one_ctx, tmp_path / "ep2")], [res["saved_ep2_next"]])
    assert close([res["saved_ep2_next"], res["resumed_ep2_next"]], [one[2], one[2]])


def nonzero(d: dict) -> dict:
    return {k: v for k, v in d.items() if v}


def test_the_planner_prices_expert_parallelism():
    """The experts' state 1/P per GPU, their gradients reduced over W/P ranks, the all-to-alls
    priced on top, the compute the same (each rank computes k experts per token on average)."""
    work = Workload(get_preset("qwen3-moe-30b-a3b"), micro_batch=2, world=8)
    plain = EngineConfig(engine="zero", zero_stage=1, checkpointing="full")
    by_p = {p: dataclasses.replace(plain, expert_parallel=p) for p in (1, 2, 4)}
    t = {p: step_time(work, e, 1, DEFAULTS["H100"]) for p, e in by_p.items()}
    assert "ep_comm" not in t[1] and 0 < t[2]["ep_comm"] < t[4]["ep_comm"]
    assert t[1]["compute"] == t[2]["compute"] == t[4]["compute"]
    assert t[1]["comm"] > t[2]["comm"] > t[4]["comm"]
    grads = {p: zero_state(work, e)["device"]["grads"] for p, e in by_p.items()}
    assert grads[1] > grads[2] > grads[4]
    # --offload-experts: only the experts' chunks on the host, the dense ones stay
    e = dataclasses.replace(by_p[2], offload_optimizer="cpu", offload_blocks=3,
                            offload_experts=True)  # fmt: skip
    hosted = [c.spec.name for c in placement_of(work, e).hosted]
    assert hosted == [f"block.{i}.experts" for i in (45, 46, 47)]


def test_the_experts_of_a_sparse_block_are_a_chunk_of_their_own():
    with torch.device("meta"):
        names = [c.name for c in chunk_layout(build_model(TINY))]
    assert names == ["embed", "block.0", "block.0.experts", "block.1", "block.1.experts", "head"]


@pytest.mark.parametrize(
    "ep, cfg, world, needle",
    [
        (2, get_preset("llama3.1-8b"), 2, "has no experts"),
        (3, TINY, 2, "does not divide the 2 rank(s)"),
        (3, TINY, 3, "does not divide the model's 4 experts"),
    ],
)
def test_refusals_are_one_line(ep, cfg, world, needle):
    why = expert_parallel_refusal(ep, cfg, world)
    assert why and needle in why and "\n" not in why
    engine_cfg = EngineConfig(engine="zero", expert_parallel=ep)
    assert refusal(cfg, engine_cfg, "fp32", world, "cpu") == why


def test_offloading_the_experts_alone_needs_experts_and_an_offload_tier():
    with pytest.raises(UserError, match="add --offload-optimizer cpu") as e:
        EngineConfig(engine="zero", offload_experts=True)
    assert "\n" not in str(e.value)
    e = EngineConfig(engine="zero", offload_optimizer="cpu", offload_experts=True)
    why = refusal(get_preset("llama3.1-8b"), e, "bf16", 1, "cuda")
    assert why and "has no experts" in why and "\n" not in why
    assert refusal(TINY, e, "fp32", 1, "cpu") is None


def test_expert_parallel_and_one_compiled_graph_are_refused():
    e = EngineConfig(engine="zero", expert_parallel=2, compile="model")
    why = refusal(TINY, e, "bf16", 2, "cuda")
    assert why and "--compile blocks or off" in why and "\n" not in why


def test_expert_parallel_needs_the_chunked_engine():
    why = refusal(TINY, EngineConfig(engine="ddp", expert_parallel=2), "fp32", 2, "cpu")
    assert why and "use --engine zero" in why and "\n" not in why
    # where the planner chooses the engine, it is no refusal: the planner keeps the chunked one
    planned = refusal(
        TINY, EngineConfig(expert_parallel=2), "fp32", 2, "cpu", True, frozenset({"engine"})
    )
    assert planned is None


def test_a_checkpoint_whose_sparse_blocks_are_one_chunk_is_named(monkeypatch, tmp_path):
    """Checkpoints written before the experts were chunks of their own hold the same
    parameters in other chunks: refused in one line that says so."""
    from fitgpt.engine import layout as layout_mod
    from fitgpt.train.checkpoint import CorruptCheckpoint, check_layout

    with torch.device("meta"):
        model = build_model(TINY)
    new = chunk_layout(model)
    monkeypatch.setattr(layout_mod, "EXPERTS", "no parameter has this in its name")
    old = chunk_layout(model)  # the layout before: block.i held its experts
    assert len(old) == len(new) - TINY.n_layer
    with pytest.raises(CorruptCheckpoint, match="an older fitgpt's") as e:
        check_layout({"layout": [c.to_dict() for c in old]}, new, tmp_path)
    assert "\n" not in str(e.value)
