"""Context parallelism (fitgpt/parallel/context.py) at world size 2 (gloo) against one process:
the model's loss and every gradient, then engines (ZeRO 0-3, the optimizer offloaded with
streamed weights, activation checkpointing, DDP) training 3 steps to the same losses, gradient
norms and weights, on plain rows (some targets -1, so the two slices count differently) and
packed chat-like rows; and the refusals, in one line, before anything is built."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_config, train
from test_packing import LLAMA, S, packed_batch

from fitgpt.data.source import Batch, BatchLoader
from fitgpt.dist import DistContext, init_distributed
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, build_model
from fitgpt.parallel import context_parallel, parallelize
from fitgpt.parallel.context import context_parallel_refusal, heads_to_seq, seq_to_heads
from fitgpt.parallel.shard import unshard
from fitgpt.plan.validate import check_settings

CPU = DistContext(0, 1, 0, torch.device("cpu"))
MODELS = {
    "llama": ModelConfig(**LLAMA, family="llama"),  # GQA: 4 query heads, 2 key/value heads
    "qwen3": ModelConfig(**LLAMA, family="qwen3", qk_norm=True),
    "mistral": ModelConfig(**LLAMA, family="mistral", sliding_window=5),
    "gpt2": ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=S, vocab_size=96),
    "gpt2_alibi": ModelConfig(
        n_layer=2, n_embd=32, n_head=4, seq_len=S, vocab_size=96, position="alibi"
    ),
}
CP2 = dict(engine="zero", context_parallel=2)
ENGINES = {
    "llama/zero1": EngineConfig(**CP2, zero_stage=1),
    "llama/zero3_full": EngineConfig(**CP2, zero_stage=3, checkpointing="full"),
    "llama/offload_stream": EngineConfig(**CP2, zero_stage=3, offload_optimizer="cpu",
                                         offload_blocks=1, offload_params="cpu"),
    "llama/ddp": EngineConfig(engine="ddp", context_parallel=2),
    "gpt2/zero3_full": EngineConfig(**CP2, zero_stage=3, checkpointing="full"),
    "gpt2/zero1_offload": EngineConfig(**CP2, zero_stage=1, offload_optimizer="cpu"),
}  # fmt: skip
PACKED = {"llama/zero1", "llama/zero3_full", "gpt2/zero3_full"}  # also on packed rows
STEPS = 3
TRAIN = dict(steps=4, micro_batch=2, grad_accum=2, log_every=1)


def plain_batch(rows: int, seed: int) -> Batch:
    """Token-stream rows with a third of the targets -1 (counts differ between slices)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 96, (rows, S + 1), generator=g)
    y = x[:, 1:].clone()
    y[torch.rand(rows, S, generator=g) < 0.33] = -1
    return Batch(x[:, :-1].contiguous(), y)


def sliced(b: Batch, c: int, C: int) -> Batch:
    """Rank c's tokens of every row, as BatchLoader hands them; the segments whole."""
    s = b.inputs.shape[1] // C
    return Batch(b.inputs[:, c * s : (c + 1) * s], b.targets[:, c * s : (c + 1) * s], b.segments)


# ---- the model's loss and gradients --------------------------------------------------------
def check_model(cfg: ModelConfig, packed: bool) -> None:
    """The CP model's token-weighted loss over both ranks and its gradients summed over them
    (what the engines do) against the unsplit model's."""
    torch.manual_seed(0)
    ref = build_model(cfg)
    ref.reset_parameters(0)
    ctx = init_distributed("cpu").with_context_parallel(2)
    cp = context_parallel(copy.deepcopy(ref), ctx.cp)
    b = packed_batch(2, seed=7, masked=0.3) if packed else plain_batch(2, seed=7)
    want = ref(b.inputs, b.targets, segments_BT=b.segments)
    want.backward()
    mine = sliced(b, ctx.cp.rank, 2)
    count = (mine.targets != -1).sum().float()
    total = count.clone()
    dist.all_reduce(total)
    got = cp(mine.inputs, mine.targets, segments_BT=mine.segments) * (count / total)
    got.backward()
    loss = got.detach().clone()
    dist.all_reduce(loss)
    assert abs(loss.item() - want.item()) < 1e-5, (cfg.family, packed, loss.item(), want.item())
    grads = dict(ref.named_parameters())
    for name, p in cp.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def check_all_to_alls(rank: int) -> None:
    """seq_to_heads gives this rank's heads (1/C of each fused part) of every token, in order;
    heads_to_seq undoes it, and each one's backward is the other."""
    cp = init_distributed("cpu").with_context_parallel(2).cp
    full = torch.randn(2, 8, 3 * 4 * 5, generator=torch.Generator().manual_seed(3))  # P=3, F=20
    mine = full[:, rank * 4 : (rank + 1) * 4].clone().requires_grad_()
    heads = seq_to_heads(mine, 3, cp)
    want = full.view(2, 8, 3, 2, 10)[:, :, :, rank].reshape(2, 8, 30)  # 2 of 4 heads of D=5
    assert torch.equal(heads, want)
    back = heads_to_seq(heads, 3, cp)
    assert torch.equal(back, mine)
    back.sum().backward()
    assert torch.equal(mine.grad, torch.ones_like(mine))


def model_worker(rank: int, world: int) -> None:
    check_all_to_alls(rank)
    for name in ("llama", "qwen3", "mistral", "gpt2", "gpt2_alibi"):
        for packed in (False, True):
            check_model(MODELS[name], packed)


@pytest.mark.slow
def test_context_parallel_model_gives_the_unsplit_loss_and_gradients(gloo):
    gloo(2, model_worker)


# ---- with tensor parallelism (world 4: T = 2 × C = 2) ---------------------------------------
def check_tp_model(cfg: ModelConfig, sp: bool) -> None:
    """T = 2 (with or without sequence parallelism) × C = 2: the loss, and each gradient summed
    over the CP group (and a replicated one over the TP group under SP, as the engines do) and
    unsplit over the TP group, against the unsplit model's."""
    torch.manual_seed(0)
    ref = build_model(cfg)
    ref.reset_parameters(0)
    ctx = init_distributed("cpu").with_tensor_parallel(2).with_context_parallel(2)
    m = context_parallel(parallelize(copy.deepcopy(ref), ctx.mesh, sp), ctx.cp)
    b = packed_batch(2, seed=5, masked=0.3)
    want = ref(b.inputs, b.targets, segments_BT=b.segments)
    want.backward()
    mine = sliced(b, ctx.cp.rank, 2)
    count = (mine.targets != -1).sum().float()
    total = count.clone()
    dist.all_reduce(total, group=ctx.cp.group)
    got = m(mine.inputs, mine.targets, segments_BT=mine.segments) * (count / total)
    got.backward()
    loss = got.detach().clone()
    dist.all_reduce(loss, group=ctx.cp.group)
    assert abs(loss.item() - want.item()) < 1e-5, (cfg.family, sp, loss.item(), want.item())
    rule, grads = ref.family.split_rule, dict(ref.named_parameters())
    for name, p in m.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=ctx.cp.group)
        if sp and rule(name) is None:
            dist.all_reduce(g, group=ctx.mesh.tp_group)
        parts = [torch.empty_like(g) for _ in range(2)]
        dist.all_gather(parts, g.contiguous(), group=ctx.mesh.tp_group)
        torch.testing.assert_close(
            unshard(rule(name), parts), grads[name].grad, atol=1e-5, rtol=1e-4, msg=name
        )


TP_ENGINES = {
    "zero1": EngineConfig(engine="zero", zero_stage=1, tensor_parallel=2, context_parallel=2),
    "zero3_sp": EngineConfig(engine="zero", zero_stage=3, checkpointing="full",
                             tensor_parallel=2, sequence_parallel=True, context_parallel=2),
}  # fmt: skip


LLAMA_TC = MODELS["llama"].replace(n_head=8, n_kv_head=4)  # GQA that T·C = 4 divides


def tp_worker(rank: int, world: int, tmp: str) -> None:
    for cfg in (LLAMA_TC, MODELS["gpt2"]):
        for sp in (False, True):
            check_tp_model(cfg, sp)
    ctx = init_distributed("cpu")
    res = {key: engine_run(LLAMA_TC, e, ctx, True) for key, e in TP_ENGINES.items()}
    if rank == 0:
        (Path(tmp) / "results.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_context_parallel_composes_with_tensor_parallel(tmp_path, gloo):
    gloo(4, tp_worker, str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())
    want = engine_run(LLAMA_TC, EngineConfig(engine="ddp"), CPU, True)
    for key, got in res.items():
        assert close(got["loss"], want["loss"], 1e-5), (key, got["loss"], want["loss"])
        assert close(got["norm"], want["norm"], 1e-4), (key, got["norm"], want["norm"])
        assert close(got["weights"], want["weights"], 1e-4), key


# ---- engines -------------------------------------------------------------------------------
def engine_run(cfg: ModelConfig, ecfg: EngineConfig, ctx, packed: bool) -> dict:
    """STEPS steps of 2 micro-batches of 2 rows, each rank its slice of every row; the losses,
    gradient norms and a checksum of each weight after the last step."""
    ctx = ctx.laid_out(ecfg.tensor_parallel, ecfg.context_parallel)
    e = build_engine(cfg, ecfg, PrecisionConfig(precision="fp32"), OptimConfig(grad_clip=0.5), ctx)
    C, c = e.ctx.cp_size, e.ctx.cp.rank if e.ctx.cp is not None else 0
    out: dict = {"loss": [], "norm": []}
    for step in range(STEPS):
        make = packed_batch if packed else plain_batch
        micro = [sliced(make(2, seed=100 * step + m), c, C) for m in range(2)]
        if not packed:
            micro = [Batch(b.inputs, b.targets) for b in micro]
        st = e.train_step(micro, 1e-2)
        out["loss"].append(st.loss)
        out["norm"].append(st.grad_norm)
    model = e.inference_model()
    out["weights"] = [p.double().abs().sum().item() for p in model.parameters()]
    e.close()
    return out


def engine_worker(rank: int, world: int, tmp: str) -> None:
    ctx = init_distributed("cpu")
    res = {}
    for key, ecfg in ENGINES.items():
        cfg = MODELS[key.split("/")[0]]
        for packed in (False, True) if key in PACKED else (False,):
            res[f"{key}/{packed}"] = engine_run(cfg, ecfg, ctx, packed)
    # the training loop: the loader's data rank and slices, the tokens per step
    run = run_config(
        Path(tmp) / "cp2", **TRAIN, save_every=2, engine="zero", zero_stage=2, context_parallel=2
    )
    res["train"] = train(run, ctx)["losses"]
    if rank == 0:
        (Path(tmp) / "results.json").write_text(json.dumps(res))


def close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


@pytest.mark.slow
def test_context_parallel_engines_train_as_one_process(tmp_path, gloo):
    gloo(2, engine_worker, str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())
    want = train(run_config(tmp_path / "one", **TRAIN), CPU)["losses"]
    assert close(res.pop("train"), want, 1e-5)
    # its checkpoint (ZeRO-2 shards over both CP ranks) resumes on one process
    run = run_config(tmp_path / "cp2", **TRAIN, engine="ddp")
    resumed = train(run, CPU, resume=str(tmp_path / "cp2" / "step_00000002"))["losses"]
    assert close(resumed, want[2:], 1e-5)
    refs: dict = {}
    for key, got in res.items():
        name, _, packed = key.split("/")
        ref_key = f"{name}/{packed}"
        if ref_key not in refs:
            refs[ref_key] = engine_run(
                MODELS[name], EngineConfig(engine="ddp"), CPU, packed == "True"
            )
        want = refs[ref_key]
        assert close(got["loss"], want["loss"], 1e-5), (key, got["loss"], want["loss"])
        assert close(got["norm"], want["norm"], 1e-4), (key, got["norm"], want["norm"])
        # Adam's 1/sqrt(v) amplifies rounding in near-zero gradients (biases): 1e-4
        assert close(got["weights"], want["weights"], 1e-4), key


# ---- the loader and the refusals -----------------------------------------------------------
class _Rows:
    seq_len, vocab_size = 8, 50

    def get(self, idx):
        import numpy as np

        return (idx[:, None] * 100 + np.arange(9)[None, :]).astype(np.int64)


def test_the_loader_gives_each_cp_rank_its_slice_of_the_same_rows():
    whole = BatchLoader(_Rows(), 2, rank=1, world=2).next()
    parts = [BatchLoader(_Rows(), 2, 1, 2, 0, c, 4).next() for c in range(4)]
    assert torch.equal(torch.cat([p.inputs for p in parts], 1), whole.inputs)
    assert torch.equal(torch.cat([p.targets for p in parts], 1), whole.targets)
    assert parts[1].inputs.shape == (2, 2)


def test_context_parallel_the_scheme_cannot_run_is_refused_in_one_line():
    llama = MODELS["llama"]  # 4 heads, 2 key/value heads, S = 32
    refused = context_parallel_refusal
    assert re.search(r"does not divide the key/value heads .*, 2: use one of", refused(4, llama, 4))
    assert "does not divide the rank count" in refused(2, llama, 3)
    odd = llama.replace(seq_len=33)
    assert "the sequence length (--seq-len), 33" in refused(2, odd, 2)
    # 2 key/value heads: 1 per TP rank
    assert "with --tensor-parallel 2 does not divide the key/val" in refused(2, llama, 4, tp=2)
    with pytest.raises(UserError, match="whole number"):
        EngineConfig(context_parallel=0)
    # the one validation train, plan and the planner share (plan/validate.py)
    with pytest.raises(UserError, match="--context-parallel 4 does not divide"):
        check_settings(
            llama, EngineConfig(context_parallel=4), PrecisionConfig(precision="fp32"), 4, "cpu"
        )
    check_settings(
        llama, EngineConfig(context_parallel=2), PrecisionConfig(precision="fp32"), 2, "cpu"
    )
