"""--compile: compiled blocks and head + loss (fitgpt/engine/transforms/compile.py) against eager
runs.

Compiling on 2 CPU cores takes 10-20 s per region kind when Inductor's disk caches are cold, so
there are two compiled cases: the chunk engine at stage 3 with activation checkpointing (weights
whose storage is freed and restored around every use), and a compiler that cannot run. The
rest (the flag, the auto rule, the planner resolving the flag) compiles nothing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from helpers import TINY, assembled, run_config, train

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.engine.transforms.compile import auto_compile, compile_pays, compile_scope, report_line
from fitgpt.errors import UserError
from fitgpt.train.setup import estimated_run_s, unplanned_compile

CPU = DistContext(0, 1, 0, torch.device("cpu"))
CXX = shutil.which("g++") or shutil.which("c++")
needs_cxx = pytest.mark.skipif(
    CXX is None, reason="no C++ compiler: TorchInductor cannot compile CPU code here"
)


def batches(n, b, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (n * b, TINY.seq_len + 1), generator=g)
    return [(x[i * b : (i + 1) * b, :-1], x[i * b : (i + 1) * b, 1:]) for i in range(n)]


@pytest.mark.slow
@needs_cxx
def test_compiled_stage3_with_checkpointing_trains_like_eager(tmp_path, capsys):
    """`fitgpt train --compile on` at ZeRO stage 3 with checkpointing: the same losses as eager
    (fp32: a fused kernel's rounding only), the compile reported once in the log and in
    metrics.jsonl; and the engine's block weights, whose storage is freed after every use,
    cause no recompile over several steps."""
    engine = dict(engine="zero", zero_stage=3, checkpointing="full")
    runs = {}
    for mode in ("off", "on"):
        cfg = run_config(tmp_path / mode, steps=3, log_every=1, compile=mode, **engine)
        runs[mode] = train(cfg, CPU)["losses"]
    torch.testing.assert_close(runs["on"], runs["off"], rtol=1e-5, atol=0)
    log = capsys.readouterr().out
    assert log.count("compile: 3 regions, 0 graph breaks, 0 recompiles") == 1, log
    records = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").open()]
    (rec,) = [r for r in records if r["kind"] == "compile"]
    assert rec["regions"] == 3 and rec["eager"] == 0 and rec["compile_s"] >= 0
    train_recs = [r for r in records if r["kind"] == "train"]
    assert train_recs and all(r["compiled"] for r in train_recs)
    off = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").open()]
    assert not any(r.get("compiled") for r in off) and not any("compile_s" in r for r in off)

    # the engine directly: 4 steps on fresh batches, the weights freed between uses each time
    e = build_engine(TINY, EngineConfig(compile="blocks", **engine), PrecisionConfig("fp32"),
                     OptimConfig(), CPU)  # fmt: skip
    for step in range(4):
        e.train_step(batches(2, 2, step), 1e-3)
        assert not e.blocks[0].resident  # its storage was resized to 0 after its backward
    report = e.compile_report()
    assert report["recompiles"] == 0 and report["graph_breaks"] == 0, report
    e.close()


@pytest.mark.slow
@needs_cxx
def test_the_whole_model_as_one_graph_trains_like_eager(tmp_path, capsys):
    """--compile model (on a GPU: CUDA graphs, which a CPU has not; the graph is the same):
    the same losses as eager, one region reported, no recompile over steps, and evaluation and
    sampling running the eager forward (no second compile)."""
    runs = {}
    for mode in ("off", "model"):
        cfg = run_config(
            tmp_path / mode, steps=3, log_every=1, compile=mode, eval_every=3, engine="zero"
        )
        runs["on" if mode == "model" else mode] = train(cfg, CPU)
    torch.testing.assert_close(runs["on"]["losses"], runs["off"]["losses"], rtol=1e-5, atol=0)
    log = capsys.readouterr().out
    assert log.count("compile: the whole model as one graph, 0 graph breaks, 0 recompiles") == 1
    recs = {m: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").open()]
            for m, d in (("off", "off"), ("on", "model"))}  # fmt: skip
    evals = [[r["val_loss"] for r in recs[m] if r["kind"] == "eval"] for m in runs]
    assert evals[0] and evals[1] and abs(evals[0][0] - evals[1][0]) < 1e-4
    records = recs["on"]
    (rec,) = [r for r in records if r["kind"] == "compile"]
    assert rec["regions"] == 1 and rec["scope"] == "model" and rec["recompiles"] == 0, rec


def test_only_one_rank_holding_a_small_model_whole_compiles_it_whole():
    """compile_scope, the one decision: the whole model for one GPU rank of the chunk engine
    holding a model up to MODEL_SCOPE_MAX_HIDDEN whole, unchecked; the regions otherwise; a
    scope given outright is kept; auto compiles only a long GPU run."""
    from fitgpt.engine.transforms.compile import MODEL_SCOPE_MAX_HIDDEN

    def scope(asked="on", engine="zero", dev="cuda", h=768, world=1, resident=True, ck="off"):
        return compile_scope(asked, engine, dev, h, world, resident, ck, 1e9)

    assert scope() == "model"
    assert scope(dev="cpu") == "blocks"  # no CUDA graphs: the regions
    assert scope(h=MODEL_SCOPE_MAX_HIDDEN + 1) == "blocks"  # GPU-bound
    assert scope(world=2) == "blocks"  # reductions overlap block by block
    assert scope(resident=False) == "blocks"  # host waits, streams before blocks
    assert scope(ck="full") == "blocks"  # the checkpoint wraps each block
    assert scope(engine="ddp") == "blocks"  # DDP's reducer hooks sit between blocks
    assert scope("blocks") == "blocks" and scope("off") == "off" and scope("model", dev="cpu")
    assert scope("auto", dev="cpu") == "off"
    assert compile_scope("auto", "zero", "cuda", 768, 1, True, "off", 100.0) == "off"  # short


def test_the_engines_build_what_the_config_says():
    """An engine decides nothing: a config never planned reads auto as off and on as the
    regions, whatever the machine (the planner, or setup for a run given whole, resolves them
    first on the user's path); --compile model needs the chunk engine."""
    from fitgpt.engine.transforms.compile import scope_of
    from fitgpt.plan.validate import refusal

    assert [scope_of(EngineConfig(compile=c)) for c in ("auto", "on", "off", "blocks", "model")] == [
        "off", "blocks", "off", "blocks", "model"
    ]  # fmt: skip
    why = refusal(TINY, EngineConfig(engine="ddp", compile="model"), "fp32", 1, "cpu")
    assert why.startswith("--compile model needs --engine zero")


@pytest.mark.slow
@needs_cxx
def test_a_region_that_cannot_compile_runs_eagerly_after_one_warning(capfd):
    """Inductor pointed at a C++ compiler that does not exist (a machine without a toolchain):
    each region kind warns once, in one line, and the steps run eagerly with eager's losses."""
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config

    ecfg = EngineConfig(engine="zero", zero_stage=0, compile="blocks")
    eager = build_engine(TINY, dataclasses.replace(ecfg, compile="off"), PrecisionConfig("fp32"),
                         OptimConfig(), CPU)  # fmt: skip
    want = [eager.train_step(batches(1, 2, s), 1e-3).loss for s in range(2)]
    torch._dynamo.reset()  # no compiled code from an earlier test may be reused
    with (
        torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        e = build_engine(TINY, ecfg, PrecisionConfig("fp32"), OptimConfig(), CPU)
        got = [e.train_step(batches(1, 2, s), 1e-3).loss for s in range(2)]
    torch._dynamo.reset()
    assert got == want
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: compile:")]
    assert len(warnings) == 2, err  # the blocks' kind and the head's, once each
    assert "block region(s) run eagerly" in warnings[0] and "head+loss" in warnings[1]
    assert "Traceback" not in err
    report = e.compile_report()
    assert report["regions"] == 0 and report["eager"] == 3
    assert report_line(report).startswith("compile: 0 regions, 3 eager after a failure")


def test_compile_flag_is_checked():
    with pytest.raises(UserError, match=r"--compile 'yes': use auto, on, off, blocks or model"):
        EngineConfig(compile="yes")
    from fitgpt.bench.config import BenchConfig

    with pytest.raises(UserError, match=r"--compile 'fast'"):
        BenchConfig(compile="fast")


def test_auto_compiles_only_long_gpu_runs():
    """The rule: never on CPUs; on GPUs when 3% of the run's estimated step time pays back a
    10 s compile (and triton is installed), never with activation checkpointing."""
    assert not auto_compile("cpu", 1e9)
    assert not auto_compile("cuda", 330.0)  # under 333 s of steps
    assert compile_pays(340.0) and not compile_pays(330.0)
    # checkpointed blocks run slower compiled (the checkpoint reruns the compiled forward)
    assert not compile_pays(1e9, "full") and not compile_pays(1e9, "cpu")
    # unless the family's blocks run faster compiled (Llama's 0.933): then once 6.7% of the
    # run pays back the 30 s compile (~450 s of steps), and that only under checkpointing
    assert compile_pays(460.0, "full", 0.933) and not compile_pays(440.0, "full", 0.933)
    assert not compile_pays(330.0, "off", 0.933)
    assert compile_scope("auto", "zero", "cuda", 4096, 1, False, "full", 1e9, 1.08) == "off"
    run = run_config("unused", compile="auto")
    assert unplanned_compile(run, "cpu", 1) == "off" and estimated_run_s(run, "cpu") == 0.0
    on = run_config("unused", compile="on")
    assert unplanned_compile(on, "cpu", 1) == "blocks"  # asked for: compiled, even on a CPU


def test_auto_is_settled_for_each_plan_on_its_own_checkpointing(tmp_path, monkeypatch):
    """--compile auto is decided by the planner for every plan it prices, with that plan's
    checkpointing (it cannot be known before), and what the chosen plan says is the run's
    --compile."""
    import fitgpt.engine.transforms.compile as compile_mod
    from fitgpt.plan.apply import Fixed

    seen = []

    def decide(device_type, run_s, checkpointing="off", checkpointed=1.08):
        seen.append(checkpointing)
        return checkpointing == "off"  # the rule's checkpointing part, whatever this machine is

    monkeypatch.setattr(compile_mod, "auto_compile", decide)
    run = run_config(tmp_path, engine="zero", compile="auto")
    planned = assembled(run, CPU, fixed=Fixed()).config
    assert {"off", "full"} <= set(seen)  # each plan weighed on its own
    assert planned.engine.compile == ("blocks" if planned.engine.checkpointing == "off" else "off")
    forced = assembled(run, CPU, fixed=Fixed.of({"checkpointing": "full"})).config
    assert forced.engine.compile == "off"


def test_the_planner_resolves_the_compile_flag(tmp_path):
    """A planned run's assembly (train and the bench harness: train/assemble.py): the planner
    resolves --compile on into the scope it priced; off stays off."""
    from fitgpt.plan.apply import Fixed

    run = run_config(tmp_path, engine="zero", compile="on")
    planned = assembled(run, CPU, fixed=Fixed()).config
    assert planned.engine.compile == "blocks"  # on a CPU: never the whole model
    fixed = assembled(run, CPU, fixed=Fixed.of({"compile": "off"})).config
    assert fixed.engine.compile == "off"


@needs_cxx
def test_the_optimizers_compiled_pass_is_torchs_adamw():
    """engine/chunked/update.py's one pass (a compiled run's device update) against torch's fused
    AdamW kernel on the same bf16 gradient, fp32 master and moments, over 3 steps: the master and
    moments within fp32 rounding, the bf16 weights the master's cast; skip 1.0 changes nothing."""
    from fitgpt.engine.chunked.update import _adamw_pass

    g = torch.Generator().manual_seed(0)
    n, hp = 1000, dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    master = torch.randn(n, generator=g)
    ref = [master.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(())]
    got = [master.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(())]
    w = torch.empty(n, dtype=torch.bfloat16)
    for _ in range(3):
        grad = torch.randn(n, generator=g).bfloat16()
        ref[3].add_(1)
        torch._fused_adamw_([ref[0]], [grad.float() * 0.5], [ref[1]], [ref[2]], [], [ref[3]],
                            amsgrad=False, maximize=False, **hp)  # fmt: skip
        got[3].add_(1)
        _adamw_pass()(w, got[0], got[1], got[2], grad, 0.5, 0.0, got[3], hp["lr"],
                      hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"])  # fmt: skip
        for a, b in zip(got[:3], ref[:3]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert torch.equal(w, got[0].bfloat16())
    before = [t.clone() for t in (w, *got[:3])]
    _adamw_pass()(w, got[0], got[1], got[2], grad, 0.5, torch.ones(()), got[3], hp["lr"],
                  hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"])  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip((w, *got[:3]), before))


@pytest.mark.slow
@needs_cxx
def test_a_compiled_bf16_run_updates_through_the_pass_or_warns_once(capfd):
    """bf16 (a master apart from the weights): a compiled engine steps its device state through
    the one pass, with the eager engine's losses within bf16 rounding. With no C++ compiler the
    pass warns once, in one line, and torch's fused AdamW takes over: eager's losses exactly."""
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config

    ecfg = EngineConfig(engine="zero", zero_stage=0, compile="blocks")
    bf16 = PrecisionConfig("bf16")
    eager = build_engine(TINY, dataclasses.replace(ecfg, compile="off"), bf16, OptimConfig(), CPU)
    want = [eager.train_step(batches(1, 2, s), 1e-3).loss for s in range(3)]
    import fitgpt.engine.chunked.update as update

    compiled, calls = update._adamw_pass(), []

    def counted():  # the real compiled pass, its calls counted
        return lambda *a: calls.append(1) or compiled(*a)

    e = build_engine(TINY, ecfg, bf16, OptimConfig(), CPU)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(update, "_adamw_pass", counted)
        got = [e.train_step(batches(1, 2, s), 1e-3).loss for s in range(3)]
    groups = sum(len(c.optimizer.param_groups) for c in e.chunks)
    assert e.updater.one_pass and len(calls) == 3 * groups  # every group, every step
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)
    assert got[2] < got[0]
    torch._dynamo.reset()
    with (
        torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        e = build_engine(TINY, ecfg, bf16, OptimConfig(), CPU)
        got = [e.train_step(batches(1, 2, s), 1e-3).loss for s in range(3)]
    torch._dynamo.reset()
    assert got == want and not e.updater.one_pass
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "optimizer's compiled pass" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: compile:"), err
    assert "Traceback" not in err


@pytest.mark.slow
@needs_cxx
def test_compiled_block_linears_write_their_weight_gradients():
    """engine/transforms/wgrad.py: in a compiled run the block linears' weight gradients are
    accumulated by their product, so autograd hands their AccumulateGrad nodes no gradient (nothing
    to add), the reducer still hears of every parameter once per micro-batch (its hooks run), and
    the losses are eager's (fp32: the product's accumulation rounds differently only)."""
    ecfg = EngineConfig(engine="zero", zero_stage=0)
    runs, given, heard = {}, {}, {}
    for mode in ("off", "on"):
        e = build_engine(TINY, dataclasses.replace(ecfg, compile=mode), PrecisionConfig("fp32"),
                         OptimConfig(), CPU)  # fmt: skip
        w = e.model.blocks[0].mlp.fc.weight
        given[mode], heard[mode] = [], []
        w.register_hook(lambda g, m=mode: given[m].append(g is not None))
        w.register_post_accumulate_grad_hook(lambda p, m=mode: heard[m].append(1))
        runs[mode] = [e.train_step(batches(2, 2, s), 1e-3).loss for s in range(3)]
        assert all(c.grads_seen == 0 for c in e.chunks)  # every chunk's count completed
        if mode == "on":  # one graph for every block: the linears share one forward
            assert e.compile_report()["recompiles"] == 0
        e.close()
    torch.testing.assert_close(runs["on"], runs["off"], rtol=1e-5, atol=0)
    assert given["off"] == [True] * 6 and given["on"] == [False] * 6  # 3 steps × 2 micro
    assert len(heard["off"]) == len(heard["on"]) == 6


@needs_cxx
def test_a_fused_linear_whose_input_needs_no_gradient_still_writes_its_own():
    """engine/transforms/wgrad.py's backward writes .grad, a side effect its schema cannot name:
    where its dx output goes unused (the input needs no gradient) the compiler must keep it anyway.
    The weight and bias gradients are autograd's own, to fp32 rounding."""
    from torch import nn

    from fitgpt.engine.transforms.wgrad import fuse_weight_grads

    torch.manual_seed(0)
    lin, ref = nn.Linear(16, 8), nn.Linear(16, 8)
    ref.load_state_dict(lin.state_dict())
    lin.weight.grad, lin.bias.grad = torch.zeros_like(lin.weight), torch.zeros_like(lin.bias)
    handle = fuse_weight_grads([nn.Sequential(lin)], lambda p: True)
    x = torch.randn(4, 16)  # requires no grad: dx is never used
    torch.compile(lambda x: lin(x).square().sum())(x).backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)
    handle.remove()
    assert type(lin) is nn.Linear


@pytest.mark.parametrize("bias", [True, False])
def test_layernorms_through_aten_are_eager_layernorms(bias):
    """engine/transforms/norm.py: the swapped LayerNorms run the kernels F.layer_norm runs, so a
    model's loss and every gradient are bit for bit an unswapped copy's, with and without LayerNorm
    biases; both custom ops pass torch's own registration checks (fake tensors, autograd)."""
    from fitgpt.engine.transforms.norm import AtenLayerNorm, use_aten_norms
    from fitgpt.model import GPT

    cfg = dataclasses.replace(TINY, bias=bias)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = GPT(cfg)
    model.load_state_dict(ref.state_dict())
    assert use_aten_norms(model) == 2 * cfg.n_layer + 1
    assert (
        type(model.blocks[0].ln_1) is AtenLayerNorm
        and model.state_dict().keys() == ref.state_dict().keys()
    )
    ((x, y),) = batches(1, 2, 0)
    for m in (ref, model):
        m(x, y).backward()
    assert torch.equal(model(x, y), ref(x, y))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    h = torch.randn(2, 5, cfg.n_embd, requires_grad=True)
    ln = model.blocks[0].ln_1
    torch.library.opcheck(torch.ops.fitgpt.layer_norm, (h, ln.weight, ln.bias, 1e-5))
    # a strided bf16 input, with bf16 and with fp32 parameters: the fake outputs' strides and
    # dtypes must be ATen's, forward and backward
    hb = torch.randn(5, 2, cfg.n_embd, dtype=torch.bfloat16).transpose(0, 1).requires_grad_()
    for dtype in (torch.bfloat16, torch.float32):
        wb = ln.weight.detach().to(dtype).requires_grad_()
        bb = torch.zeros_like(wb, requires_grad=True)
        torch.library.opcheck(torch.ops.fitgpt.layer_norm, (hb, wb, bb, 1e-5))
        _, mean, rstd = torch.native_layer_norm(hb.detach(), [cfg.n_embd], wb, bb, 1e-5)
        args = (torch.randn_like(hb), hb.detach(), mean, rstd, wb.detach(), bb.detach())
        torch.library.opcheck(torch.ops.fitgpt.layer_norm_backward, args)
    mean = h.mean(-1, keepdim=True).detach()
    rstd = (h.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().detach()
    torch.library.opcheck(
        torch.ops.fitgpt.layer_norm_backward,
        (torch.randn(2, 5, cfg.n_embd), h.detach(), mean, rstd, ln.weight.detach(),
         None if ln.bias is None else ln.bias.detach()),
    )  # fmt: skip


@needs_cxx
def test_a_compiled_block_keeps_layernorms_through_aten_in_its_graph():
    """engine/transforms/norm.py inside a compiled region: no graph break, the op called at run time
    (the profiler sees it forward and backward), values within fp32 rounding of eager's."""
    import torch._dynamo.utils as dynamo_utils

    from fitgpt.engine.transforms.compile import _block_train
    from fitgpt.engine.transforms.norm import use_aten_norms
    from fitgpt.model import GPT

    torch.manual_seed(0)
    model = GPT(TINY)
    use_aten_norms(model)
    block = model.blocks[0]
    x = torch.randn(2, TINY.seq_len, TINY.n_embd, requires_grad=True)
    breaks = sum(dynamo_utils.counters["graph_break"].values())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = torch.compile(_block_train)(block, x, None)
        out.square().sum().backward()
    assert sum(dynamo_utils.counters["graph_break"].values()) == breaks
    names = {e.name for e in prof.events()}
    assert {"fitgpt::layer_norm", "fitgpt::layer_norm_backward"} <= names, sorted(names)[:20]
    got = x.grad.clone()
    x.grad = None
    ref = _block_train(block, x, None)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got, x.grad)


def test_layernorms_go_through_aten_only_on_gpus_past_inductors_persistent_width():
    from fitgpt.engine.transforms.norm import aten_norms

    assert aten_norms("cuda", 2560) and aten_norms("cuda", 1600)
    assert not aten_norms("cuda", 1024) and not aten_norms("cuda", 768)
    assert not aten_norms("cpu", 2560)
    report = {"regions": 33, "eager": 0, "graph_breaks": 0, "recompiles": 0, "compile_s": 9.0,
              "scope": "regions", "aten_norms": 65}  # fmt: skip
    assert report_line(report).endswith("9.0 s; 65 LayerNorms through ATen")
    assert report_line({**report, "aten_norms": 0}).endswith("9.0 s")
