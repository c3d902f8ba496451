"""Tensor parallelism (fitgpt/parallel) on real gloo groups against one unsplit process.

World 2 (T=2) and world 4 (T=2 × DP=2): the same losses and gradient norms as one process over
8 steps (fp32, clipping active), with and without sequence parallelism, 1/T of every split
weight per rank, replicated gradients identical across the TP group (with sequence parallelism
once summed over it); checkpoints saved at T=2 resume at T=1 and at ZeRO-3 on 2 ranks,
and load on one process for generation; bad T refused in one line.
"""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import TINY, engine_losses, run_config, train

from fitgpt.dist import DistContext, init_distributed
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.transforms.tp_state import sync_replicated
from fitgpt.errors import UserError
from fitgpt.infer.generate import SampleConfig, generate, load_model
from fitgpt.model import GPT, ModelConfig
from fitgpt.model.loss import piece_bytes
from fitgpt.parallel import parallelize
from fitgpt.parallel.shard import tensor_parallel_refusal, unshard
from fitgpt.plan import rates
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import GiB, Workload, estimate, layout_of, torch_state, zero_state
from fitgpt.plan.planner import plan
from fitgpt.plan.throughput import step_time, tp_comm_time

CPU = DistContext(0, 1, 0, torch.device("cpu"))
split_rule = GPT.family.split_rule  # how TP cuts each GPT-2 parameter
STEPS = 8  # several Adam updates, clipping active in each (20 took twice the CPU)
CLIP = 0.5  # below the first steps' norms: clipping is active


def step_losses(ecfg: EngineConfig, ctx: DistContext) -> dict:
    return engine_losses(TINY, ecfg, ctx, STEPS, CLIP)


def check_split_shapes(shapes: dict, tp: int) -> None:
    """Each rank holds 1/T of every split parameter, all of a replicated one."""
    with torch.device("meta"):
        full = dict(GPT(TINY).named_parameters())
    assert set(shapes) == set(full)
    for name, shape in shapes.items():
        n, whole = torch.Size(shape).numel(), full[name].numel()
        assert n * (tp if split_rule(name) else 1) == whole, (name, shape)
    assert shapes["blocks.0.attn.qkv.weight"] == [3 * TINY.n_embd // tp, TINY.n_embd]
    assert shapes["wte.weight"] == [TINY.padded_vocab_size // tp, TINY.n_embd]


def check_layers(rank: int, tie: bool, sp: bool = False) -> None:
    """The parallelized modules against the unsplit model: the same loss, the split gradients
    the reference's parts, the replicated ones bit-identical on both TP ranks (with sequence
    parallelism: once summed over the group, as the engines do)."""
    cfg = ModelConfig(**{**TINY.__dict__, "tie_embeddings": tie})
    ref = GPT(cfg)
    ref.reset_parameters(0)
    ctx = init_distributed("cpu").with_tensor_parallel(2)
    tp = parallelize(copy.deepcopy(ref), ctx.mesh, sequence_parallel=sp)
    x = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    want, got = ref(x[:, :-1], x[:, 1:]), tp(x[:, :-1], x[:, 1:])
    want.backward()
    got.backward()
    assert abs(want.item() - got.item()) < 1e-5
    if sp:
        rep = [p.grad for n, p in tp.named_parameters() if split_rule(n) is None]
        sync_replicated(rep, ctx.mesh)
    grads = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        parts = [torch.empty_like(p.grad) for _ in range(2)]
        dist.all_gather(parts, p.grad.contiguous())
        if split_rule(name) is None:
            assert torch.equal(parts[0], parts[1]), f"{name}: replicated gradients differ"
        torch.testing.assert_close(unshard(split_rule(name), parts), grads[name].grad, msg=name)
    if sp:
        return  # head() of a sequence-parallel model takes this rank's tokens only
    h = torch.randn(2, 4, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # full logits, gathered over the TP group (padded rows -inf)
        torch.testing.assert_close(tp.head(h), ref.head(h))


def two_rank_worker(rank: int, world: int, tmp: str) -> None:
    tmp = Path(tmp)
    check_layers(rank, tie=True)
    check_layers(rank, tie=False)
    check_layers(rank, tie=True, sp=True)
    ctx = init_distributed("cpu")
    res = {}
    for key, ecfg in {
        "zero0": EngineConfig(engine="zero", tensor_parallel=2),
        "zero1full": EngineConfig(engine="zero", zero_stage=1, checkpointing="full",
                                  tensor_parallel=2),
        "ddp": EngineConfig(engine="ddp", tensor_parallel=2),
        "zero2sp": EngineConfig(engine="zero", zero_stage=2, tensor_parallel=2,
                                sequence_parallel=True),
    }.items():  # fmt: skip
        res[key] = step_losses(ecfg, ctx)
        check_split_shapes(res[key].pop("shapes"), 2)
    # the training loop at T=2 (both ranks the same micro-batches), saving at steps 5 and 10
    cfg = run_config(tmp / "tp2", steps=10, save_every=5, engine="zero", zero_stage=2,
                     tensor_parallel=2)  # fmt: skip
    res["train_tp2"] = train(cfg, ctx)["losses"]
    # resume the T=2 checkpoint at ZeRO-3 on 2 data-parallel ranks (micro-batch 2 each)
    cfg = run_config(tmp / "z3", steps=10, micro_batch=2, engine="zero", zero_stage=3)
    res["resumed_z3"] = train(cfg, ctx, resume=str(tmp / "tp2" / "step_00000005"))["losses"]
    if rank == 0:
        (tmp / "results.json").write_text(json.dumps(res))


def four_rank_worker(rank: int, world: int, tmp: str) -> None:
    ctx = init_distributed("cpu")
    res = {}
    for key, ecfg in {
        "zero3full": EngineConfig(engine="zero", zero_stage=3, checkpointing="full",
                                  tensor_parallel=2),
        "offload1": EngineConfig(engine="zero", zero_stage=1, offload_optimizer="cpu",
                                 offload_blocks=1, tensor_parallel=2),
        "ddp": EngineConfig(engine="ddp", tensor_parallel=2),
        "zero1sp": EngineConfig(engine="zero", zero_stage=1, checkpointing="full",
                                tensor_parallel=2, sequence_parallel=True),
        "ddpsp": EngineConfig(engine="ddp", tensor_parallel=2, sequence_parallel=True),
    }.items():  # fmt: skip
        res[key] = step_losses(ecfg, ctx)
        check_split_shapes(res[key].pop("shapes"), 2)
    if rank == 0:
        (Path(tmp) / "results.json").write_text(json.dumps(res))


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_tensor_parallel_two_ranks_matches_one_process_and_checkpoints_load_anywhere(
    tmp_path, gloo
):
    ref = step_losses(EngineConfig(engine="zero"), CPU)
    assert max(ref["norm"]) > CLIP  # the test exercises clipping
    gloo(2, two_rank_worker, str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())
    for key in ("zero0", "zero1full", "ddp", "zero2sp"):
        assert close(res[key]["loss"], ref["loss"]), key
        assert close(res[key]["norm"], ref["norm"]), key
    # the planner's bytes are the engine's, at T=2 (this rank's split layout)
    work = Workload(TINY, 4, world=2, precision="fp32", device="cpu")
    ecfg = EngineConfig(engine="zero", zero_stage=1, checkpointing="full", tensor_parallel=2)
    nonzero = {k: v for k, v in zero_state(work, ecfg)["device"].items() if v}
    assert {k: v for k, v in res["zero1full"]["mem"]["cpu"].items() if v} == nonzero
    ddp, want = res["ddp"]["mem"]["cpu"], torch_state(work, layout_of(TINY, 2))
    for kind in ("master_weights", "optimizer"):  # its gradients are freed after each step
        assert ddp[kind] == want[kind], kind

    full = train(run_config(tmp_path / "ref", steps=10, save_every=5, engine="zero"), CPU)
    assert close(res["train_tp2"], full["losses"])
    assert close(res["resumed_z3"], full["losses"][5:])
    # resume the T=2 checkpoint on one process, unsplit
    cfg = run_config(tmp_path / "tp2", steps=10, engine="ddp")
    resumed = train(cfg, CPU, resume=str(tmp_path / "tp2" / "step_00000005"))["losses"]
    assert close(resumed, full["losses"][5:])
    # generation reads it on one device: the reference's weights, and it samples
    model, _ = load_model(tmp_path / "tp2" / "step_00000005", torch.device("cpu"))
    want, _ = load_model(tmp_path / "ref" / "step_00000005", torch.device("cpu"))
    for (n, p), q in zip(model.named_parameters(), want.parameters()):
        # Adam turns float-rounding differences of near-zero gradients into up to ~1e-5 apart
        torch.testing.assert_close(p, q, atol=1e-4, rtol=0, msg=n)
    prompt = torch.tensor([[1, 2, 3]])
    cfg = SampleConfig(max_new_tokens=4, temperature=0.0)
    assert torch.equal(generate(model, prompt, cfg), generate(want, prompt, cfg))


def test_tensor_parallel_times_data_parallel_matches_one_process(tmp_path, gloo):
    ref = step_losses(EngineConfig(engine="zero"), CPU)
    gloo(4, four_rank_worker, str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())
    for key in ("zero3full", "offload1", "ddp", "zero1sp", "ddpsp"):
        assert close(res[key]["loss"], ref["loss"]), key
        assert close(res[key]["norm"], ref["norm"]), key


def test_bad_tensor_parallel_degrees_are_refused_in_one_line():
    assert "head count" in tensor_parallel_refusal(3, TINY, 3)
    assert "rank count" in tensor_parallel_refusal(2, TINY, 1)
    with pytest.raises(UserError, match="whole number >= 1, or auto"):
        EngineConfig(tensor_parallel=-1)
    with pytest.raises(UserError, match="add --tensor-parallel"):
        EngineConfig(sequence_parallel=True)
    odd = ModelConfig(**{**TINY.__dict__, "seq_len": 33})
    assert "sequence length" in tensor_parallel_refusal(2, odd, 2, sequence_parallel=True)
    with pytest.raises(UserError, match="does not divide"):  # no mesh, so no engine, is built
        CPU.laid_out(2, 1)


def test_the_planner_prices_tensor_parallel_plans():
    m = ModelConfig(n_layer=4, n_embd=1024, n_head=16, seq_len=2048, vocab_size=50257)
    work = Workload(m, 2, world=2, precision="bf16", device="cuda")
    one, two = (EngineConfig(zero_stage=1, tensor_parallel=t) for t in (1, 2))
    # 1/T of every split weight's state; the activations inside attention/MLP and logits 1/T
    n1, n2 = (sum(c.numel for c in layout_of(m, t)) for t in (1, 2))
    assert n2 < 0.55 * n1
    e1, e2 = estimate(work, one), estimate(work, two)
    # the logits 1/T per rank: 4,096 × 50,304 at T=1 are past one piece (model/loss.py) and
    # priced as one; their 1/T at T=2 fit one piece and are priced whole, 2w + 8 bytes each
    assert e1.compute["logits"] == piece_bytes(2 * 2048, 50304, 1024, 2)
    assert e2.compute["logits"] == 2 * 2048 * 50304 // 2 * 12
    assert e2.compute["activations"] < 0.7 * e1.compute["activations"]
    sp = EngineConfig(zero_stage=1, tensor_parallel=2, sequence_parallel=True)
    assert estimate(work, sp).compute["activations"] < e2.compute["activations"]
    # the TP all-reduces: 4 per block and 2 for embedding and head per micro-batch, b·S·h·2 bytes
    r = rates.load("(planned GPU)")
    t2 = step_time(work, two, 3, r)
    size = 2 * 2048 * 1024 * 2
    assert t2["tp_comm"] == pytest.approx(
        3 * (4 * 4 + 2) * (size / (r.bus_gbps * 1e9) + 20e-6), rel=1e-9
    )
    assert t2["tp_comm"] == tp_comm_time(work, two, 3, r.bus_gbps)
    assert "tp_comm" not in step_time(work, one, 3, r)
    # sequence parallelism: the column-parallel inputs gathered again in backward
    assert step_time(work, sp, 3, r)["tp_comm"] > t2["tp_comm"]
    # T is priced only when asked: the default plans keep T=1; auto lists T=1 and T=2
    hw = Hardware("cuda", 2, 80 * GiB, "(planned GPU)", 500 * GiB, 16)
    assert {c.ecfg.tensor_parallel for c in plan(work, 1, hw, r, {})} == {1}
    auto = plan(work, 1, hw, r, {"tensor_parallel": 0})
    assert {c.ecfg.tensor_parallel for c in auto} == {1, 2}
    assert all(c.compared_time == c.time["total"] * c.ecfg.tensor_parallel for c in auto)
