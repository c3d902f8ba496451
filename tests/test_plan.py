"""The memory model, the planner and the capacity search."""

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest
import torch
from cli_refusal import run_main
from helpers import TINY

from fitgpt.dist import DistContext, init_distributed
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, get_preset
from fitgpt.model.loss import PIECE_LOGITS, loss_pieces, piece_bytes
from fitgpt.plan.capacity import search
from fitgpt.plan.hardware import Hardware, parse_bytes
from fitgpt.plan.memory import (
    GiB,
    Workload,
    activation_bytes,
    estimate,
    gpu_budget,
    torch_state,
    zero_state,
)
from fitgpt.plan.planner import choose, leanest, plan, why
from fitgpt.plan.rates import DEFAULTS
from fitgpt.plan.throughput import compiled_factor, efficiency, step_time

CPU = DistContext(0, 1, 0, torch.device("cpu"))
H100 = Hardware("cuda", 1, int(79.2 * GiB), "NVIDIA H100 80GB HBM3", int(125 * GiB), 16)
FP32_STATE = {"master": "fp32", "moments": "fp32", "device_moments": "fp32"}  # no compact formats


def reported(engine) -> dict:
    """{device|host: {kind: bytes}}, zeros dropped; the compute device's type becomes "device"."""
    rep = engine.memory_report()
    return {
        (d if d in ("host", "nvme") else "device"): {k: v for k, v in kinds.items() if v}
        for d, kinds in rep.items()
        if any(kinds.values())
    }


def predicted(d: dict) -> dict:
    return {
        w: {k: v for k, v in kinds.items() if v} for w, kinds in d.items() if any(kinds.values())
    }


def total(d: dict) -> int:
    return sum(v for kinds in d.values() for v in kinds.values())


# ---- closed forms against hand calculations ---------------------------------------------------
def test_state_terms_by_hand():
    m = ModelConfig(n_layer=1, n_embd=8, n_head=2, seq_len=4, vocab_size=100)  # V padded to 128
    # chunks: embed = wte 128·8 + wpe 4·8 = 1056; block = 12·64 + 13·8 = 872; head = ln_f 16
    # padded to multiples of W·128: W=1 → 1152, 896, 128; W=2 → 1280, 1024, 256
    n1 = 1152 + 896 + 128
    w1 = Workload(m, micro_batch=2, world=1, precision="bf16")
    assert zero_state(w1, EngineConfig(engine="zero"))["device"] == {
        "weights": 2 * n1,
        "weight_shards": 0,
        "grads": 2 * n1,
        "master_weights": 4 * n1,
        "optimizer": 8 * n1,
    }
    w2 = Workload(m, micro_batch=2, world=2, precision="bf16")
    s3 = zero_state(w2, EngineConfig(engine="zero", zero_stage=3))["device"]
    assert s3["weight_shards"] == 2 * 1024 // 2  # only the block is sharded at stage 3
    assert s3["weights"] == 2 * (1280 + 256)  # embed and head stay whole
    assert s3["grads"] == 2 * (1280 + 1024 + 256) // 2
    assert s3["optimizer"] == 8 * (1280 + 1024 + 256) // 2
    fp32 = zero_state(Workload(m, 2, 1, "fp32"), EngineConfig(engine="zero"))["device"]
    assert fp32["master_weights"] == 0  # fp32 compute: the weights are the master copy
    n = m.num_params()
    assert torch_state(w1) == {"master_weights": 4 * n, "grads": 4 * n, "optimizer": 8 * n}


def test_activation_terms_by_hand():
    m = ModelConfig(n_layer=3, n_embd=16, n_head=2, seq_len=8, vocab_size=128)
    w = Workload(m, micro_batch=2, world=1, precision="bf16")
    sbh = 8 * 2 * 16
    lse = 4 * 2 * 8 * 2  # each block saves its softmax's log-sum-exp: fp32 [b, N, S]
    off, full = activation_bytes(w, "off"), activation_bytes(w, "full")
    assert off["activations"] == 3 * (17 * sbh * 2 + lse)
    assert full["activations"] == 3 * sbh * 2 + 17 * sbh * 2 + lse
    # a block's backward (the MLP whole): ~8·sbh of working gradients; the head's moment: the
    # final norm's input and output, and the logits
    assert off["working_gradients"] == full["working_gradients"] == 8 * sbh * 2
    assert off["final_norm"] == 2 * sbh * 2
    # the two moments never overlap: estimate prices the larger of them, not both
    est = estimate(w, EngineConfig(engine="zero", checkpointing="off"))
    block = off["working_gradients"] + off["block_backward"]
    head = off["final_norm"] + off["logits"]
    kept = ("logits", "working_gradients")[block >= head]
    assert kept in est.compute and ({"logits", "working_gradients"} - {kept}).isdisjoint(
        est.compute
    )
    # one block's backward: the kernel's fp32 dq and k, v gradients over the 2 heads of 8
    assert off["block_backward"] == 2 * 8 * 16 * (4 + 2 * 2)
    assert off["logits"] == full["logits"] == 2 * 8 * 128 * 12


def test_estimate_matches_a_measured_gpu_peak():
    # benchmarks/results/mfu_2p7b_h100_2026-11-22: zero engine, checkpointing off, 64.3 GiB measured
    est = estimate(Workload(get_preset("2.7b"), 8, 1, "bf16"), EngineConfig(engine="zero"))
    assert abs(est.compute_peak / GiB / 64.3 - 1) < 0.10


# ---- predicted state equals what the engines report -----------------------------------------
@pytest.mark.parametrize("offload", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_predicted_state_equals_engine_report_one_rank(stage, precision, offload, tier, tmp_path):
    tier = tier if offload else "none"
    ecfg = EngineConfig(
        engine="zero",
        zero_stage=stage,
        offload_optimizer=tier,
        offload_blocks=round(TINY.n_layer * (offload or 1.0)),
        nvme_blocks=round(TINY.n_layer * (offload or 1.0) * 0.5),
        nvme_path=str(tmp_path),
    )
    e = build_engine(TINY, ecfg, PrecisionConfig(precision), OptimConfig(), CPU)
    assert reported(e) == predicted(zero_state(Workload(TINY, 2, 1, precision), ecfg))


def test_predicted_state_equals_engine_report_torch_engine():
    e = build_engine(TINY, EngineConfig(engine="ddp"), PrecisionConfig("fp32"), OptimConfig(), CPU)
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1))
    e.train_step([(x[:, :-1], x[:, 1:])], 1e-3)
    e.opt.zero_grad(set_to_none=False)  # keep the gradients allocated to count them
    for p in e.params:
        p.grad = torch.zeros_like(p)
    assert reported(e) == {"device": torch_state(Workload(TINY, 2, 1, "fp32"))}


def report_worker(rank, world, out):
    ctx = init_distributed("cpu")
    got = {}
    for stage in (1, 2, 3):
        ecfg = EngineConfig(engine="zero", zero_stage=stage)
        e = build_engine(TINY, ecfg, PrecisionConfig("bf16"), OptimConfig(), ctx)
        got[stage] = (reported(e), predicted(zero_state(Workload(TINY, 2, world, "bf16"), ecfg)))
    if rank == 1:
        with open(out, "w") as f:
            json.dump(got, f)


@pytest.mark.slow
def test_predicted_state_equals_engine_report_two_ranks(tmp_path, gloo):
    gloo(2, report_worker, str(tmp_path / "r.json"))
    for stage, (rep, pred) in json.loads((tmp_path / "r.json").read_text()).items():
        assert rep == pred, stage


# ---- the planner ---------------------------------------------------------------------------
def test_planner_picks_a_fitting_plan_and_refuses_with_the_shortfall():
    r = DEFAULTS["H100"]
    chosen, cands = choose(Workload(get_preset("2.7b"), 8, 1, "bf16"), 4, H100, r)
    assert chosen.fits and chosen.ecfg.engine == "zero"
    assert cands[0] is chosen and chosen.time["total"] == min(
        c.time["total"] for c in cands if c.fits
    )
    with pytest.raises(UserError, match=r"do not fit.*short by .*what fits: \d+ layers"):
        choose(Workload(get_preset("13b"), 8, 1, "bf16"), 4, H100, r, FP32_STATE)
    # an explicit plan predicted not to fit is refused too, and --force lets it through
    big = Workload(get_preset("6.7b"), 8, 1, "bf16")
    with pytest.raises(UserError, match="do not fit"):
        choose(big, 4, H100, r, {"engine": "ddp", "checkpointing": "off"})
    forced, cands = choose(big, 4, H100, r, {"engine": "ddp", "checkpointing": "off"}, force=True)
    assert forced.ecfg.engine == "ddp" and not forced.fits
    # forced, the leanest plan runs: the least short over the tiers that are short (a plan
    # with room to spare on the host is no leaner for it)
    assert forced is leanest(cands)
    small_host = dataclasses.replace(H100, cpu_mem=int(40 * GiB))
    lean, cands2 = choose(Workload(get_preset("13b"), 8, 1, "bf16"), 4, small_host, r, force=True)
    assert lean is leanest(cands2) and not lean.fits
    # the line `fitgpt train --force` prints (a capacity trial's too): what it is short of
    assert re.search(r"no plan is predicted to fit \(GPU short by [\d.]+ GiB\), the leanest "
                     r"tried anyway", why(forced, cands))  # fmt: skip


def test_a_refusal_prices_each_plan_once_and_its_line_is_unchanged_by_it(monkeypatch):
    """The refusal plans the model again for each alternative it names: within one choose() each
    (work, plan) is priced once (plan/candidate.py priced_once), and outside it nothing is kept
    (a price reads the modules' settings, which a later call may have changed)."""
    from fitgpt.plan import candidate

    r, work = DEFAULTS["H100"], Workload(get_preset("13b"), 8, 1, "bf16")
    priced: list = []
    real = candidate._evaluate

    def counted(work, grad_accum, hw, rates, ecfg, layout=None):
        priced.append((work, grad_accum, hw, rates, ecfg))
        return real(work, grad_accum, hw, rates, ecfg, layout)

    monkeypatch.setattr(candidate, "_evaluate", counted)
    with pytest.raises(UserError) as once:
        choose(work, 4, H100, r, FP32_STATE)
    assert len(priced) > 100 and len(set(priced)) == len(priced)
    with pytest.raises(UserError) as again:  # a new call prices afresh, to the same line
        choose(work, 4, H100, r, FP32_STATE)
    assert len(priced) == 2 * len(set(priced)) and str(again.value) == str(once.value)
    # a plan priced again is a copy: the planner's marks on one (rung, settled formats) stay
    with candidate.priced_once():
        a = candidate.evaluate(*priced[0])
        a.rung = 5
        b = candidate.evaluate(*priced[0])
    assert b is not a and b.rung == 0 and (b.ecfg, b.est, b.time) == (a.ecfg, a.est, a.time)
    assert len(priced) == 2 * len(set(priced)) + 1


def test_a_fixed_block_count_is_cut_to_the_layers_the_refusal_tries():
    """The refusal's "what fits" tries fewer layers with the user's fixed fields: a fixed
    --offload-blocks above a tried depth means every block there, not the engine's refusal of
    the count (which named the tried depth as if it were the user's model)."""
    r = DEFAULTS["H100"]
    small_host = dataclasses.replace(H100, cpu_mem=int(40 * GiB))
    m = get_preset("13b")
    fixed = {"offload_optimizer": "cpu", "offload_blocks": m.n_layer, **FP32_STATE}
    with pytest.raises(UserError) as e:
        choose(Workload(m, 8, 1, "bf16"), 4, small_host, r, fixed)
    msg = str(e.value)
    assert "do not fit" in msg and "short by" in msg, msg
    layers = int(re.search(r"what fits: (\d+) layers", msg).group(1))
    assert 0 < layers < m.n_layer
    assert f"with --offload-blocks {layers}" in msg  # the flag as the user must now type it
    # the depth named fits with every block offloaded, one more layer does not
    for L, fits in ((layers, True), (layers + 1, False)):
        w = Workload(m.replace(n_layer=L), 8, 1, "bf16")
        cut = dict(fixed, offload_blocks=L)
        assert any(c.fits for c in plan(w, 4, small_host, r, cut)) is fits


def test_more_gpus_or_the_host_tier_fit_what_one_gpu_cannot():
    r = DEFAULTS["H200"]
    one = Hardware("cuda", 1, int(139 * GiB), "NVIDIA H200", int(250 * GiB), 32)
    two = Hardware("cuda", 2, int(139 * GiB), "NVIDIA H200", int(250 * GiB), 32)
    m = get_preset("13b")
    on_device = {"offload_optimizer": "none", **FP32_STATE}
    assert not any(c.fits for c in plan(Workload(m, 8, 1, "bf16"), 4, one, r, on_device))
    chosen, _ = choose(Workload(m, 8, 2, "bf16"), 4, two, r, on_device)
    assert chosen.ecfg.zero_stage >= 2
    # one GPU with the host tier: the GPU filled first, only the last blocks' optimizer offloaded
    # (fp32 state: left auto, compact state is faster here and fits without offloading)
    hosted, _ = choose(Workload(m, 8, 1, "bf16"), 4, one, r, FP32_STATE)
    assert hosted.ecfg.offload_optimizer == "cpu" and 0 < hosted.ecfg.offload_blocks < m.n_layer
    fewer = dataclasses.replace(hosted.ecfg, offload_blocks=hosted.ecfg.offload_blocks - 1)
    assert estimate(Workload(m, 8, 1, "bf16"), fewer).compute_total > gpu_budget(one.gpu_mem)


def test_parse_bytes():
    assert parse_bytes("80GB", "x") == 80e9 and parse_bytes("2GiB", "x") == 2 * GiB
    assert parse_bytes("64", "x") == 64 * GiB
    with pytest.raises(UserError, match="--gpu-mem 'lots'"):
        parse_bytes("lots", "--gpu-mem")


def test_plan_cli_refuses_before_allocating(capsys):
    code, out, err = run_main(
        capsys, "plan", "--preset", "13b", "--gpu-mem", "80GB", "--cpu-mem", "125GB",
        "--device", "cuda", "--master", "fp32", "--moments", "fp32", "--device-moments", "fp32",
    )  # fmt: skip
    assert code == 2 and "short by" in err and "Traceback" not in err
    assert "zero-0, checkpointing full" in out  # the table of candidates came first


@pytest.mark.parametrize("lora", [(), ("--lora-rank", "4")], ids=["full", "lora"])
def test_plan_init_from_plans_the_run_train_makes_of_the_folder(capsys, tmp_path, lora):
    """`fitgpt plan --init-from FOLDER` prices the model and defaults `fitgpt train --init-from
    FOLDER` trains (the folder's shape, fine-tuning's batch, a LoRA base that is the folder's):
    its chosen plan is the line train prints before its first step; a flag against the
    folder's architecture is refused by both alike."""
    from helpers import tiny_llama_folder
    from tokenizer_folders import llama3

    from fitgpt.data.tokenizer import load_tokenizer

    folder = tiny_llama_folder(tmp_path, load_tokenizer(str(llama3(tmp_path / "tok"))).vocab_size)
    llama3(folder)  # a folder with its tokenizer, as released
    run = (
        "--init-from",
        folder,
        "--seq-len",
        "32",
        "--device",
        "cpu",
        "--data",
        "synthetic",
        *lora,
    )
    code, out, err = run_main(capsys, "plan", *run)
    assert code == 0, err
    assert out.startswith(f"model {folder} with seq_len=32: ")
    assert "randomly initialised" not in out  # the base is the folder's
    line = "LoRA: " if lora else "chosen: "
    planned = next(x for x in out.splitlines() if x.startswith(line)).removeprefix("chosen: ")
    code, out, err = run_main(capsys, "train", *run, "--steps", "1", "--out", tmp_path / "run")
    assert code == 0, err
    trained = next(x for x in out.splitlines() if x.startswith(("LoRA: ", "plan: ")))
    assert trained.removeprefix("plan: ") == planned
    # no --data: the folder's own vocabulary (train's default data, bytes, would be refused)
    code, out, err = run_main(capsys, "plan", *[a for a in run if a not in ("--data", "synthetic")])
    assert code == 0 and planned in out, err
    for cmd in ("train", "--out", tmp_path / "x"), ("plan",):
        code, _, err = run_main(capsys, cmd[0], *run, "--layers", "5", *cmd[1:])
        assert code == 2 and "its model has n_layer=3, this command asks 5" in err, err


# ---- the capacity search ---------------------------------------------------------------------
@pytest.mark.parametrize("truth, start", [(37, 5), (5, 37), (1, 9), (12, 12)])
def test_search_brackets_then_bisects_in_few_trials(truth, start):
    calls = []

    def trial(n):
        calls.append(n)
        return n <= truth

    res = search(trial, start, max_trials=16)
    assert res.largest_ok == truth and res.first_fail == truth + 1
    # galloping out then bisecting: about 2·log2(distance) trials, never one per size
    assert len(calls) <= 2 * math.log2(abs(truth - start) + 1) + 3


@pytest.mark.slow
def test_capacity_cli_on_cpu_with_a_budget_finds_the_true_boundary(tmp_path):
    """Real trials in their own processes under a 3 MB budget on the engine's state bytes."""
    m = dict(n_embd=64, n_head=4, seq_len=32, vocab_size=256, tie_embeddings=False)
    truth = 0
    for layers in range(1, 12):
        e = build_engine(
            ModelConfig(n_layer=layers, **m),
            EngineConfig(engine="zero"),
            PrecisionConfig("fp32"),
            OptimConfig(),
            CPU,
        )
        if total(reported(e)) <= 3_000_000:
            truth = layers
    out = tmp_path / "cap.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fitgpt",
            "capacity",
            "--system",
            "zero0",
            "--device",
            "cpu",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--seq-len",
            "32",
            "--vocab-size",
            "256",
            "--micro-batch",
            "2",
            "--grad-accum",
            "1",
            "--cap",
            "3MB",
            "--max-trials",
            "5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["largest_layers"] == truth and summary["first_fail"] == truth + 1
    # fp32 compute on a roomy CPU: the planner keeps fp32 state, and says so
    assert summary["formats"] == {"master": "fp32", "moments": "fp32", "device_moments": "fp32"}
    assert "its optimizer state: master fp32, moments fp32" in r.stdout
    trials = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(trials) <= 5 and all("predicted_peak_gib" in t for t in trials)


def test_the_host_optimizer_probe_is_dram_sized_and_does_the_engines_work():
    import torch

    from fitgpt.plan.rates import host_optimizer_pass, host_probe_elems

    n = host_probe_elems()
    assert 16 * 2**20 <= n <= 256 * 2**20  # at least 64 MiB per buffer: past the caches
    step, master, g16 = host_optimizer_pass(1 << 16)
    step()
    assert master.abs().sum() > 0  # AdamW moved the weights
    assert torch.equal(g16, master.to(torch.bfloat16))  # and they were cast back


def test_the_planner_spills_the_last_blocks_to_nvme_only_when_host_ram_is_short():
    work = Workload(ModelConfig(n_layer=68, n_embd=4096, n_head=32, tie_embeddings=False), 8, 1)
    hw = dataclasses.replace(
        H100, cpu_mem=int(122 * GiB), nvme_path="(planned)", nvme_free=int(51 * GiB)
    )
    # fp32 state fits, with the disk (left to the planner, compact formats keep it in RAM:
    # tests/test_planner_formats.py)
    chosen, _ = choose(work, 4, hw, DEFAULTS["H100"], FP32_STATE)
    e = chosen.ecfg
    assert chosen.fits and e.offload_optimizer == "nvme" and 0 < e.nvme_blocks < e.offload_blocks
    assert chosen.formats == ("fp32", "fp32", "fp32") and chosen.disk_written > 0
    assert 0 < sum(chosen.est.nvme.values()) <= 51 * GiB
    assert chosen.est.host_total <= 122 * GiB
    # the same model with RAM for all of it keeps the disk out; with too little disk it refuses
    roomy, _ = choose(
        work, 4, dataclasses.replace(hw, cpu_mem=int(400 * GiB)), DEFAULTS["H100"], FP32_STATE
    )
    assert roomy.ecfg.offload_optimizer == "cpu"
    with pytest.raises(UserError, match="do not fit"):
        choose(
            work, 4, dataclasses.replace(hw, nvme_free=int(5 * GiB)), DEFAULTS["H100"], FP32_STATE
        )


def test_the_step_model_prices_small_and_compiled_models_as_measured():
    # GPT-2 124 M and 1.5 B, micro-batch 12 / 8 x 4 on the H100's default rates, against the
    # same-run measurements of benchmarks/results/nanogpt_compare*_h100_2026-11-2[34] (eager
    # 146.0-147.6 ms and 749-757 ms; compiled 104.2-105.0 ms, the whole model as CUDA graphs,
    # and 720-732 ms, the regions): within 5%
    r = DEFAULTS["H100"]  # the defaults, not a probe this machine may have cached
    for preset, mb, eager, compiled in (
        ("gpt2-125m", 12, 0.1468, 0.1046),
        ("gpt2-1.5b", 8, 0.753, 0.728),
    ):
        work = Workload(get_preset(preset), mb, world=1, precision="bf16", device="cuda")
        off = step_time(work, EngineConfig(zero_stage=0, compile="off"), 4, r)["total"]
        on = step_time(work, EngineConfig(zero_stage=0, compile="blocks"), 4, r)["total"]
        assert off == pytest.approx(eager, rel=0.05) and on == pytest.approx(compiled, rel=0.05)
    # the factor is 1 where compiling was not measured to pay, and the curve is continuous
    assert compiled_factor(8192) == 1.0 and compiled_factor(1600) == pytest.approx(0.966)
    assert efficiency(1599, 0.88) == pytest.approx(efficiency(1600, 0.88), abs=1e-3)


def test_compiled_checkpointed_blocks_are_priced_slower():
    # the checkpoint reruns the compiled forward: 1.06-1.13x the eager block on the H100
    # (results/offload_compile_h100_2026-11-24; 1.08 assumed at narrower widths), so a compiled
    # checkpointed plan is never predicted faster than its eager twin
    r = DEFAULTS["H100"]
    for preset in ("gpt2-125m", "6.7b", "13b"):
        work = Workload(get_preset(preset), 8, world=1, precision="bf16", device="cuda")
        off, on = (
            step_time(work, EngineConfig(zero_stage=0, checkpointing="full", compile=c), 4, r)
            for c in ("off", "blocks")
        )
        assert on["compute"] == pytest.approx(1.08 * off["compute"])
    assert compiled_factor(768, "full") == compiled_factor(5120, "cpu") == 1.08


def test_compiled_checkpointed_llama_blocks_are_priced_faster():
    # rotary and SwiGLU fuse: a checkpointed Llama-3.1-8B step took 0.933 of eager compiled
    # (results/llama_speed_h100_2026-11-27), the family's own ratio; GPT-2's is unchanged
    r = DEFAULTS["H100"]
    for preset, ratio in (("llama3.1-8b", 0.933), ("qwen2.5-14b", 0.933), ("6.7b", 1.08)):
        work = Workload(get_preset(preset), 4, world=1, precision="bf16", device="cuda")
        off, on = (
            step_time(work, EngineConfig(zero_stage=0, checkpointing="full", compile=c), 4, r)
            for c in ("off", "blocks")
        )
        assert on["compute"] == pytest.approx(ratio * off["compute"]), preset


def test_a_compiled_runs_device_update_is_priced_as_one_pass():
    # engine/chunked/update.py's one pass moves 28 bytes per element where the fused kernel's path
    # moves 36 in the model; fp32 (the master is the weight) keeps 36, and so does an unresolved
    # "auto" (the planner prices only what it resolved: plan/candidate.py settle_compile)
    r = DEFAULTS["H100"]
    bf16 = Workload(get_preset("2.7b"), 8, world=1, precision="bf16", device="cuda")
    fp32 = Workload(get_preset("gpt2-125m"), 8, world=1, precision="fp32", device="cuda")
    opt = {
        (w.precision, c): step_time(w, EngineConfig(zero_stage=0, compile=c), 4, r)["optimizer"]
        for w in (bf16, fp32)
        for c in ("off", "blocks", "model", "auto")
    }
    assert opt["bf16", "blocks"] == opt["bf16", "model"]
    assert opt["bf16", "blocks"] == pytest.approx(opt["bf16", "off"] * 28 / 36)
    assert opt["bf16", "auto"] == opt["bf16", "off"]
    assert opt["fp32", "blocks"] == opt["fp32", "off"]


def test_compiled_logits_are_priced_without_their_fp32_copies():
    # the compiled head keeps the bf16 logits only: 8 bytes fewer per entry than eager (the peak
    # fell 9.6-9.7 bytes per entry on the H100); the blocks' activations are priced as before
    # (measured at micro-batch 12; priced here at 2, whose logits fit one piece: model/loss.py)
    work = Workload(get_preset("gpt2-125m"), 2, world=1, precision="bf16", device="cuda")
    eager = activation_bytes(work, "off")
    compiled = activation_bytes(work, "off", compiled=True)
    entries = 2 * 1024 * 50304
    assert eager["logits"] - compiled["logits"] == 8 * entries
    assert eager["activations"] == compiled["activations"]
    on = estimate(work, EngineConfig(zero_stage=0, compile="blocks"))
    off = estimate(work, EngineConfig(zero_stage=0, compile="off"))
    assert on.compute_total < off.compute_total


def test_cpu_pricing_never_predicts_a_16_bit_precision_faster_than_fp32():
    """CPUs have no tensor cores: fp32 is not the slow path there (the GPU's FP32_FRACTION once
    priced it 12x slower than bf16), and fp16 has no fast matmul at all (measured ~20x slower
    than fp32: plan/validate.py). The GPU keeps its tensor-core order."""
    m = ModelConfig(n_layer=2, n_embd=64, n_head=2, seq_len=32, vocab_size=256)
    r = DEFAULTS["cpu"]

    def step(precision: str, device: str) -> float:
        work = Workload(m, 4, 1, precision, device)
        return step_time(work, EngineConfig(), 1, r)["compute"]

    assert step("fp32", "cpu") == step("bf16", "cpu") < step("fp16", "cpu")
    assert step("fp16", "cpu") >= 10 * step("fp32", "cpu")
    assert step("bf16", "cuda") == step("fp16", "cuda") < step("fp32", "cuda")


def test_logits_past_one_piece_are_priced_as_one_piece():
    # Llama 3's vocabulary at 8,192 tokens: the loss goes a piece of rows at a time
    # (model/loss.py), priced as one piece's logits and the two gradients, eager or compiled
    m = ModelConfig(n_layer=2, n_embd=4096, n_head=32, seq_len=8192, vocab_size=128256)
    work = Workload(m, 1, world=1, precision="bf16", device="cuda")
    V = m.padded_vocab_size
    rows = loss_pieces(8192, V)
    assert rows == PIECE_LOGITS // V and 0 < rows < 8192
    piece = rows * V * 6 + V * 4096 * 2 + 8192 * 4096 * 2
    assert activation_bytes(work, "off")["logits"] == piece
    assert activation_bytes(work, "off", compiled=True)["logits"] == piece
    assert piece < 8192 * V * 12 / 4  # under a quarter of the whole logits' 12.6 GB
    # under T = 2 the decision is taken on this rank's V/2 columns
    assert activation_bytes(work, "off", tp=2)["logits"] == piece_bytes(8192, V // 2, 4096, 2)
    # fp16 sums the weight gradient in fp32 (model/loss.py's docstring)
    fp16 = Workload(m, 1, world=1, precision="fp16", device="cuda")
    assert activation_bytes(fp16, "off")["logits"] == piece + V * 4096 * 2


def test_plan_breakdown_lists_the_chosen_plans_bytes_and_step_terms(capsys):
    """--breakdown: the chosen plan's GPU items (with the fragmentation margin) add up to the
    per-rank figure the plan names, and the host items to the host figure."""
    code, out, err = run_main(
        capsys, "plan", "--preset", "gpt2-1.5b", "--gpus", "2", "--gpu-mem", "12GiB",
        "--cpu-mem", "64GiB", "--device", "cuda", "--breakdown",
    )  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    gpu = next(i for i, x in enumerate(lines) if x.startswith("GPU per rank:"))
    host = next(i for i, x in enumerate(lines) if x.startswith("host per rank:"))

    def gib(line: str) -> float:
        return float(line.split()[-2])

    items = [gib(x) for x in lines[gpu + 1 : host]]
    assert any(x.split()[0] == "grads" for x in lines[gpu + 1 : host])
    assert abs(sum(items) - gib(lines[gpu])) < 0.01 * len(items)
    predicted = float(
        next(x for x in lines if x.startswith("chosen:")).split("predicted ")[1].split()[0]
    )
    assert abs(gib(lines[gpu]) - predicted) < 0.06
    step = next(x for x in lines if x.startswith("step "))
    assert "compute" in step and float(step.split()[1]) > 0


def test_ranks_of_one_host_share_its_host_optimizer_rate(monkeypatch):
    """Four ranks' host optimizers on one host ran at 0.68-0.78 of the rate one process
    measures (4x H200): each rank is priced at host_share(W) of it, one rank at all of it."""
    from fitgpt.plan import throughput

    assert throughput.host_share(1) == 1.0
    assert throughput.host_share(4) == pytest.approx(0.75)
    assert throughput.host_share(2) > throughput.host_share(4) > throughput.host_share(8)
    m = get_preset("20b")
    w = Workload(m, 8, 4, "bf16")
    e = EngineConfig(
        engine="zero", zero_stage=3, offload_optimizer="cpu", offload_blocks=m.n_layer,
        master="split", moments="bf16", device_moments="bf16",
    )  # fmt: skip
    shared = step_time(w, e, 4, DEFAULTS["H200"])["host_optimizer"]
    monkeypatch.setattr(throughput, "HOST_SHARED", 0.0)
    alone = step_time(w, e, 4, DEFAULTS["H200"])["host_optimizer"]
    assert shared > alone > 0


def test_fp32_host_state_shares_the_host_worse_than_compact_state():
    """torch's fused CPU AdamW (fp32 state) on 4 ranks of one host ran at 0.30 of one process's
    rate, the native kernel's compact formats at ~0.75 (4x H200): priced so, per chunk."""
    from fitgpt.plan import throughput

    assert throughput.host_share(1, compact=False) == 1.0
    assert throughput.host_share(4, compact=False) == pytest.approx(0.30, abs=0.005)
    assert throughput.host_share(4, compact=False) < throughput.host_share(4)
    m = get_preset("20b")
    fp32 = EngineConfig(
        engine="zero", zero_stage=3, offload_optimizer="cpu", offload_blocks=m.n_layer,
        master="fp32", moments="fp32", device_moments="fp32",
    )  # fmt: skip
    # every block offloaded: no forward to hide behind, the host term is the work itself,
    # which at 4 ranks (each a quarter of the elements) costs 1/(4·0.30) of one rank's
    one = step_time(Workload(m, 8, 1, "bf16"), fp32, 4, DEFAULTS["H200"])["host_optimizer"]
    four = step_time(Workload(m, 8, 4, "bf16"), fp32, 4, DEFAULTS["H200"])["host_optimizer"]
    assert four / one == pytest.approx(1 / (4 * throughput.host_share(4, compact=False)), rel=0.03)


def test_the_refusal_counts_the_disk_tier_for_every_rank():
    """The disk line of a refusal says what the box's disk must hold, all ranks' files: needs
    minus has is the shortfall (it once printed one rank's bytes beside the whole disk's)."""
    hw = Hardware("cuda", 2, int(40 * GiB), "NVIDIA H100 80GB HBM3", int(60 * GiB), 16,
                  "/nvme", int(10 * GiB))  # fmt: skip
    with pytest.raises(UserError) as e:
        choose(Workload(get_preset("13b"), 8, 2, "bf16"), 4, hw, DEFAULTS["H100"])
    need, has, short = map(float, re.search(
        r"needs ([\d.]+) GiB on the nvme tier \(has ([\d.]+), short by ([\d.]+)\)", str(e.value)
    ).groups())  # fmt: skip
    assert has == 10.0 and need - has == pytest.approx(short, abs=0.11)


def test_a_refusal_names_the_least_disk_that_would_fit_it():
    """Past GPU plus host RAM the disk tier is the way further: a refusal on a box given no disk
    names the disk that makes this model fit, and that much disk does while less does not."""
    r = DEFAULTS["H100"]
    box = Hardware("cuda", 2, int(40 * GiB), "NVIDIA H100 80GB HBM3", int(60 * GiB), 16)
    work = Workload(get_preset("13b"), 8, 2, "bf16")
    with pytest.raises(UserError) as e:
        choose(work, 4, box, r)
    named = re.search(r"this model with ~(\d+) GiB of optimizer state on a disk \(fitgpt train "
                      r"--nvme-path DIR", str(e.value))  # fmt: skip
    assert named, str(e.value)
    gib = int(named.group(1))
    with_disk = dataclasses.replace(box, nvme_path="(planned)", nvme_free=int((gib + 1) * GiB))
    chosen, _ = choose(work, 4, with_disk, r)
    assert chosen.ecfg.offload_optimizer == "nvme"
    assert sum(chosen.est.nvme.values()) * 2 <= (gib + 1) * GiB
    short = dataclasses.replace(with_disk, nvme_free=int(gib * 0.8 * GiB))
    with pytest.raises(UserError, match="on the nvme tier"):
        choose(work, 4, short, r)
    # a user who keeps the state in host RAM is not told of a disk
    with pytest.raises(UserError) as e:
        choose(work, 4, box, r, {"offload_optimizer": "cpu"})
    assert "on a disk" not in str(e.value)


def test_a_stated_gpu_size_is_what_the_planner_plans_for():
    """`fitgpt train --gpu-mem 80GB` (EngineConfig.gpu_mem, bytes) and `fitgpt plan --gpu-mem
    80GB` (as typed) plan for the same GPU; a bigger stated GPU fits a bigger batch."""
    from fitgpt.plan.hardware import detect, parse_bytes

    typed = detect(1, "80GB", "125GB", None, "cuda")
    stated = detect(1, parse_bytes("80GB", "--gpu-mem"), "125GB", None, "cuda")
    assert typed.gpu_mem == stated.gpu_mem == parse_bytes("80GB", "--gpu-mem")
    assert detect(1, 2 * stated.gpu_mem, "125GB", None, "cuda").gpu_mem == 2 * stated.gpu_mem
