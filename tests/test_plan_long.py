"""Long sequences priced: attention's work at its own rate, quadratic in S, half the square for a
causal kernel, capped by a sliding window; activations with no S² term unless a T×T mask is
really built; the preset's own vocabulary without --data; the refusal's longest sequence."""

from __future__ import annotations

import dataclasses
import re

import pytest

from fitgpt.engine.config import EngineConfig
from fitgpt.model import ModelConfig, get_preset
from fitgpt.model.families import family_of
from fitgpt.plan.memory import GiB, Workload, activation_bytes, attention_path, estimate
from fitgpt.plan.rates import DEFAULTS
from fitgpt.plan.throughput import (
    FLEX_BLOCK,
    RECOMPUTE,
    attention_flops,
    compute_seconds,
    flex_keys,
    keys_per_query,
    matmul_flops,
)

R = DEFAULTS["H100"]


def llama(seq_len: int, **kw) -> ModelConfig:
    return get_preset("llama3.1-8b").replace(seq_len=seq_len, **kw)


def test_attention_work_is_half_the_reported_square_and_quadratic_in_s():
    for S in (4096, 131072):
        m = llama(S)
        square = 12.0 * m.n_layer * m.n_head * m.head_dim * S  # the reporting convention
        assert attention_flops(m) == pytest.approx(square / 2)
        assert matmul_flops(m) + square == pytest.approx(m.flops_per_token())
    # per token linear in S, so per sequence quadratic; the matmuls' per token do not grow
    assert attention_flops(llama(131072)) == pytest.approx(32 * attention_flops(llama(4096)))
    assert matmul_flops(llama(131072)) == matmul_flops(llama(4096))
    # the attention term is priced at the attention rate: doubling it halves that term only
    w, e = Workload(llama(131072), 1), EngineConfig()
    fast = type(R)(**{**R.to_dict(), "attn_tflops": 2 * R.attn_tflops})
    t, t2 = compute_seconds(w, e, 131072, R), compute_seconds(w, e, 131072, fast)
    attn_part = 2 * (t - t2)
    assert 0.7 < attn_part / t < 0.9  # attention is ~80% of Llama 3 8B's work at 128k tokens


def test_a_sliding_window_caps_the_attention_work():
    m = get_preset("mistral-7b").replace(seq_len=131072, sliding_window=4096)
    assert attention_path(m, "cuda") == "flex"
    k = keys_per_query(m, "cuda")
    # the window's keys, W - W²/2S, and the blocks straddling its edge whole (flex_keys)
    assert k == pytest.approx(flex_keys(131072, 4096))
    assert 4096 - 4096**2 / (2 * 131072) < k < 4096 + 2 * FLEX_BLOCK
    longer = m.replace(seq_len=262144)
    assert keys_per_query(longer, "cuda") == pytest.approx(k, rel=0.02)  # ∝ min(S, window)
    assert attention_flops(longer, "cuda") < 1.02 * attention_flops(m, "cuda")
    # a window longer than the sequence changes nothing; on a CPU the mask skips no block
    assert keys_per_query(m.replace(sliding_window=200000), "cuda") == 131072 / 2
    assert keys_per_query(m, "cpu") == 131072


def test_recompute_prices_attention_by_heads_times_head_dim_not_hidden():
    # Qwen3-32B: 64 heads of 128 at hidden 5120 (N·D = 8192): the recompute's attention forward
    # is RECOMPUTE x 4·L·N·D·S/2 (it was 4·L·h·S: the full square, and h for N·D)
    m = get_preset("qwen3-32b").replace(seq_len=32768)
    w = Workload(m, 1)
    off = compute_seconds(w, EngineConfig(checkpointing="off"), 1, R)
    full = compute_seconds(w, EngineConfig(checkpointing="full"), 1, R)
    from fitgpt.plan.throughput import efficiency

    share = efficiency(m.n_embd, R.model_efficiency)
    gemm, attn = R.gemm_tflops * 1e12 * share, R.attn_tflops * 1e12 * share / R.model_efficiency
    attn_fwd = 4.0 * m.n_layer * 64 * 128 * m.seq_len / 2
    mm = 2.0 * m.num_params() / gemm * family_of(m).matmul_time  # Llama's elementwise share
    expected = RECOMPUTE * (mm + attn_fwd / attn)
    assert full - off == pytest.approx(expected)
    assert m.n_head * m.head_dim != m.n_embd


def test_activations_have_no_s_squared_term_without_a_mask():
    def act(m: ModelConfig, device: str = "cuda") -> int:
        a = activation_bytes(Workload(m, 1, device=device), "full")
        return a["activations"] + a["block_backward"] + a.get("attention_bias", 0)

    # flash: bytes per token never grow with S; past a few pieces of the MLP (one piece's
    # transient and the logits' piece are fixed sizes) they settle
    per_token = [act(llama(S)) / S for S in (32768, 131072, 524288)]
    assert per_token[0] >= per_token[1] >= per_token[2]
    assert per_token[1] / per_token[2] < 1.01
    # a window shorter than S on a CPU builds a [S, S] boolean per block; on CUDA none
    m = get_preset("mistral-7b").replace(seq_len=16384, sliding_window=4096, n_layer=2)
    assert act(m, "cpu") - act(m.replace(sliding_window=None), "cpu") == 16384**2
    assert act(m, "cuda") == act(m.replace(sliding_window=None), "cuda")
    # ALiBi: the fp32 [N, S, S] bias shared by the blocks, and each block's working-dtype copy
    g = ModelConfig(n_layer=2, n_embd=64, n_head=4, seq_len=2048, vocab_size=256)
    a = activation_bytes(Workload(g.replace(position="alibi"), 1), "off")
    assert a["attention_bias"] == 4 * 2048**2 * 4
    plain = activation_bytes(Workload(g, 1), "off")
    assert a["activations"] - plain["activations"] == 2 * 4 * 2048**2 * 2


def test_softmax_statistics_and_backward_workspace_scale_with_s():
    small, big = (activation_bytes(Workload(llama(S), 1), "full") for S in (8192, 131072))
    assert big["block_backward"] == 16 * small["block_backward"]
    m = llama(131072)
    assert big["block_backward"] == 131072 * m.n_head * m.head_dim * (4 + 2 * 2)


@pytest.mark.parametrize(
    "seq, plan, measured",
    [
        (
            131072,
            dict(offload_blocks=26, master="fp32", moments="fp32", device_moments="fp32"),
            61.1,
        ),
        (
            247808,
            dict(offload_blocks=31, master="split", moments="bf16", device_moments="bf16"),
            53.0,
        ),
    ],
)
def test_long_llama_gpu_peaks_are_priced_just_above_the_measured(seq, plan, measured):
    """Llama-3.1-8B at 131,072 and 247,808 tokens on an H100 (torch 2.11, 2026-11-27), eager,
    checkpointing cpu, weights streamed, the planner's plans: max_memory_allocated 61.1 and
    53.0 GiB, once priced 73.0 and 74.0 (the head's terms summed with a block's backward, and
    GPT-2's 8·sbh of MLP gradients where the MLP runs in pieces). An upper bound, under 15% over."""
    m = get_preset("llama3.1-8b").replace(seq_len=seq)
    ecfg = EngineConfig(
        engine="zero",
        zero_stage=0,
        checkpointing="cpu",
        offload_optimizer="cpu",
        offload_params="cpu",
        compile="off",
        **plan,
    )
    peak = estimate(Workload(m, 1, precision="bf16", device="cuda"), ecfg).compute_peak / GiB
    assert measured <= peak <= measured * 1.15


def test_gpt2_short_sequences_keep_their_whole_mlp_working_gradients():
    # the MLP whole (every ordinary micro-batch): 8·sbh of working gradients beside a block's
    # saved set, as calibrated on GPT-2; past the piece threshold attention's side only
    m = get_preset("gpt2-125m")
    a = activation_bytes(Workload(m, 8), "full")
    assert a["working_gradients"] == 8 * 8 * 1024 * 768 * 2
    long = activation_bytes(Workload(llama(131072), 1), "cpu")
    h = 4096
    assert long["working_gradients"] == 131072 * (h + 2 * 32 * 128 + 2 * 8 * 128) * 2


# ---- the refusal names the longest sequence that fits; the preset's own vocabulary ----------
def test_the_refusal_names_the_longest_sequence_that_fits():
    from fitgpt.errors import UserError
    from fitgpt.plan.fixed import Fixed
    from fitgpt.plan.hardware import Hardware
    from fitgpt.plan.memory import GiB
    from fitgpt.plan.planner import choose, fits_seq

    m = ModelConfig(n_layer=4, n_embd=512, n_head=4, seq_len=131072, vocab_size=256)
    hw = Hardware("cuda", 1, int(4 * GiB), "NVIDIA H100 80GB HBM3", int(16 * GiB), 16)
    work = Workload(m, 1)
    with pytest.raises(UserError) as refused:
        choose(work, 1, hw, R, Fixed())
    said = str(refused.value)
    seq = int(re.search(r"what fits: seq (\d+) at micro-batch 1", said).group(1))
    assert seq % 1024 == 0 and 0 < seq < 131072
    # it is the longest: it fits and one quantum more does not
    assert fits_seq(work, 1, hw, R, Fixed(), seq)
    assert not fits_seq(work, 1, hw, R, Fixed(), seq + 1024)
    choose(dataclasses.replace(work, model=m.replace(seq_len=seq)), 1, hw, R, Fixed())


def test_plan_prices_the_presets_own_vocabulary_without_data(capsys):
    from fitgpt.cli import main

    # host RAM enough for a plan to fit: a refusal would search what fits instead (seconds)
    for extra, params in (((), "70.55 B"), (("--vocab-size", "256"), "68.46 B")):
        with pytest.raises(SystemExit):
            main(["plan", "--preset", "llama3.1-70b", "--device", "cuda", "--gpu-mem", "80GiB",
                  "--cpu-mem", "2TiB", "--gpus", "8", "--micro-batch", "1", *extra])  # fmt: skip
        assert f"{params} parameters (80×8192)" in capsys.readouterr().out


def test_plan_prices_compile_auto_for_the_steps_given(monkeypatch, capsys):
    """`fitgpt plan --steps N` weighs --compile auto against N steps, as train does: a 2-step
    run does not compile what a 400-step one does (triton taken as present, as on a GPU box)."""
    import importlib.util

    from fitgpt.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: True if n == "triton" else real(n, *a)
    )
    flags = ["plan", "--preset", "llama3.1-8b", "--seq-len", "131072", "--micro-batch", "1",
             "--device", "cuda", "--gpu-mem", "80GiB", "--cpu-mem", "125GiB"]  # fmt: skip
    chosen = {}
    for steps in ("2", "400"):
        with pytest.raises(SystemExit):
            main([*flags, "--steps", steps])
        out = capsys.readouterr().out
        chosen[steps] = re.search(r"--compile (\w+)", out).group(1)
    assert chosen == {"2": "off", "400": "blocks"}, chosen


# ---- `fitgpt capacity --search seq-len` -----------------------------------------------------
@pytest.mark.slow
def test_capacity_seq_search_on_cpu_finds_the_true_boundary(tmp_path):
    """Real trials in their own processes under a 0.7 MB budget on the engine's state bytes, which
    GPT-2's learned position table makes grow with the sequence (S·h parameters). The budget puts
    the boundary a few steps up, past the first doubling: the search still gallops, fails and
    bisects, in 4 trials (at 1 MB, 8 of ~2.5 s each)."""
    import json
    import subprocess
    import sys

    import torch

    from fitgpt.dist import DistContext
    from fitgpt.engine.config import OptimConfig, PrecisionConfig
    from fitgpt.engine.factory import build_engine

    cpu = DistContext(0, 1, 0, torch.device("cpu"))
    m = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=256, tie_embeddings=False)
    step, truth = 128, 0
    for seq in range(step, 2048, step):
        e = build_engine(
            ModelConfig(seq_len=seq, **m),
            EngineConfig(engine="zero"),
            PrecisionConfig("fp32"),
            OptimConfig(),
            cpu,
        )
        state = sum(v for kinds in e.memory_report().values() for v in kinds.values())
        if state <= 700_000:
            truth = seq
    assert 2 * step < truth < 2048 - step
    out = tmp_path / "seq.jsonl"
    args = ["capacity", "--search", "seq-len", "--layers", "1", "--seq-step", str(step),
            "--max-seq", "8192", "--system", "zero0", "--device", "cpu", "--hidden", "32",
            "--heads", "2", "--vocab-size", "256", "--micro-batch", "1", "--grad-accum", "1",
            "--warmup", "0", "--steps", "1", "--cap", "0.7MB", "--max-trials", "9",
            "--out", str(out)]  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "fitgpt", *args], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["largest_seq_len"] == truth and summary["first_fail"] == truth + step
    trials = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(trials) <= 9 and all(t["seq_len"] % step == 0 for t in trials)
    assert all("predicted_peak_gib" in t for t in trials)
    assert re.search(rf"longest that trained: seq {truth} at 1 layers", r.stdout)


# ---- the attention rate: probed on CUDA, defaulted for caches written before it ------------
def test_a_probe_cache_without_the_attention_rate_keeps_its_figures(tmp_path, monkeypatch):
    import json

    from fitgpt.plan import rates

    monkeypatch.setenv("FITGPT_CACHE", str(tmp_path))
    old = R.to_dict()
    del old["attn_tflops"]  # a cache written before the field existed
    old.update(gemm_tflops=700.0, source="probe 2026-11-22 10:00")
    name = "NVIDIA H100 80GB HBM3"
    rates.cache_path(name).write_text(json.dumps(old))
    r = rates.load(name)
    assert r.gemm_tflops == 700.0 and r.attn_tflops == rates.DEFAULTS["H100"].attn_tflops


def test_the_attention_probe_counts_the_causal_half_square(monkeypatch):
    import torch

    from fitgpt.plan import rates

    calls = []
    real = rates._time

    def timed(fn, repeat=5):
        calls.append(repeat)
        real(fn, 1)  # it runs: forward and backward of a causal SDPA
        return 1.0  # one second a pass: the rate is the FLOPs it counts

    monkeypatch.setattr(rates, "_time", timed)
    got = rates._probe_attention(torch.device("cpu"), B=1, N=2, S=64, D=16)
    assert got == pytest.approx(12 * 2 * 16 * 64 * 64 / 2 / 1e12) and calls


def test_host_checkpointed_inputs_and_their_copies_scale_with_s():
    from fitgpt.plan.memory import GiB, estimate
    from fitgpt.plan.throughput import step_time

    e = EngineConfig(checkpointing="cpu")
    host = {
        S: estimate(Workload(llama(S), 1), e).host["checkpointed_inputs"] for S in (65536, 131072)
    }
    assert host[131072] == 2 * host[65536] == 32 * GiB  # 32 block inputs of S·h·2 bytes, pinned
    slow = type(R)(**{**R.to_dict(), "d2h_gbps": 0.5, "h2d_gbps": 0.5})  # a link that cannot hide
    t = {S: step_time(Workload(llama(S), 1), e, 1, slow) for S in (65536, 131072)}
    moved = {S: S * 32 * 4096 * 2 for S in t}  # down in forward and back in backward, each way
    for S in t:
        c = t[S]["compute"]
        want = (moved[S] / 0.5e9 - c / 4) + max(0.0, moved[S] / 0.5e9 - 3 * c / 4)
        assert t[S]["activation_offload"] == pytest.approx(want)


def test_context_parallel_is_priced_per_rank_slice_with_its_all_to_alls():
    """C-way context parallelism: a rank's activations are the model's at S/C, its compute is
    1/C of each sequence (attention per token still over all of S), the step trains 1/C of the
    tokens of as many data-parallel ranks, and the all-to-alls add (2N+2K)·D·b·S·w·(C-1)/C²
    bytes per block and pass."""
    from fitgpt.plan.throughput import step_time

    S, C = 131072, 4
    m = llama(S)
    work = Workload(m, 1, world=C)
    dp = EngineConfig(engine="zero", zero_stage=3, checkpointing="full")
    cp = dataclasses.replace(dp, context_parallel=C)
    whole = activation_bytes(work, "full")
    local = activation_bytes(Workload(llama(S // C), 1, world=C), "full")
    assert activation_bytes(work, "full", cp=C) == local
    assert local["activations"] < whole["activations"] / (C - 0.5)
    assert work.tokens_per_step(1, cp=C) == S == work.tokens_per_step(1) // C
    t_dp, t_cp = (step_time(work, e, 1, DEFAULTS["H100"]) for e in (dp, cp))
    assert t_cp["compute"] == pytest.approx(t_dp["compute"] / C, rel=0.01)
    per_pass = (2 * m.n_head + 2 * m.kv_heads) * m.head_dim * S * 2 * (C - 1) / C**2
    assert t_cp["cp_comm"] == pytest.approx(3 * m.n_layer * per_pass / 265e9)
    assert "cp_comm" not in t_dp
