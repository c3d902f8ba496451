"""--keep-activations K (engine/transforms/activation.py checkpoint_blocks, plan/memory.py,
plan/throughput.py, plan/adapter_time.py, plan/adapter.py): under --checkpointing full the last
K blocks keep their whole activations and are not recomputed.

The engines: a tiny Llama (random weights, fp32) trains to the same losses with K = 1 of 3 as
with K = 0 and with checkpointing off, on the zero engine and in a LoRA run over an NF4 base
streamed from host RAM; the kept blocks save their sets (counted by saved-tensor hooks). The
planner: the memory estimate grows with K and the compute falls; the LoRA planner keeps K > 0
where memory allows, within the budget, and keeps a K given; a bad K is refused in one line.
The HF model is built here with random weights and saved to a temporary folder.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cli_refusal import assert_refused, run_in_process, run_main
from helpers import engine_losses, tiny_llama_folder

from fitgpt.adapters import AdapterConfig
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.engine.transforms.activation import checkpoint_blocks
from fitgpt.interop.init_source import find_source
from fitgpt.model import ModelConfig, build_model, get_preset
from fitgpt.plan.adapter import plan_base
from fitgpt.plan.adapter_memory import price_base
from fitgpt.plan.apply import workload_of
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import Workload, estimate, gpu_budget
from fitgpt.plan.rates import DEFAULTS
from fitgpt.plan.throughput import step_time
from fitgpt.train.init_from import load_source

transformers = pytest.importorskip("transformers")

CPU = DistContext(0, 1, 0, torch.device("cpu"))
TINY = ModelConfig(family="llama", n_layer=3, n_embd=64, n_head=4, n_kv_head=2, seq_len=32,
                   vocab_size=96, bias=False, position="rope", tie_embeddings=False)  # fmt: skip
V, SEQ, MB, STEPS = 300, 32, 4, 3


def full(keep: int) -> EngineConfig:
    return EngineConfig(engine="zero", checkpointing="full", keep_activations=keep)


# ---- the engines ----------------------------------------------------------------------------
def test_kept_blocks_save_their_sets_and_are_not_recomputed():
    """Saved-tensor hooks outside the checkpoints see only what is saved outside them: nothing
    of a recomputed block but its input, a kept block's whole set. K = 1 saves more than K = 0
    and less than checkpointing off, and the last block alone is left unwrapped."""
    torch.manual_seed(0)
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))

    def saved(keep: int | None) -> int:
        model = build_model(TINY)
        if keep is not None:
            checkpoint_blocks(model, keep=keep)
        n = 0

        def pack(t):
            nonlocal n
            n += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, x)
        wrapped = [hasattr(b.forward, "__wrapped__") for b in model.blocks]
        return n, wrapped

    (none, w0), (one, w1), (off, _) = saved(0), saved(1), saved(None)
    assert w0 == [True, True, True] and w1 == [True, True, False]
    assert none < one < off


def test_a_full_fine_tune_with_kept_blocks_trains_as_without():
    """The zero engine, fp32: K = 1 of 3 gives the losses and norms of K = 0 and of no
    checkpointing (within 1e-6)."""
    runs = {k: engine_losses(TINY, full(k), CPU, STEPS, 1.0) for k in (0, 1, 3)}
    runs["off"] = engine_losses(TINY, EngineConfig(engine="zero"), CPU, STEPS, 1.0)
    ref = runs["off"]
    for k, got in runs.items():
        assert max(abs(a - b) for a, b in zip(got["loss"], ref["loss"])) < 1e-6, k
        assert max(abs(a - b) for a, b in zip(got["norm"], ref["norm"])) < 1e-6, k


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("hf"), V)


def lora_losses(folder, ecfg: EngineConfig) -> list[float]:
    """STEPS LoRA steps over `folder`'s base in NF4, its last 2 blocks streamed from host RAM."""
    source = find_source(str(folder))
    a = AdapterConfig(lora_rank=4, base_format="nf4", base_host_blocks=2)
    e = build_engine(source.model, ecfg, PrecisionConfig("fp32"), OptimConfig(grad_clip=1.0),
                     CPU, 3, a)  # fmt: skip
    load_source(source, e, source.model, CPU)
    assert sum(c.streamed for c in e.store.chunks) == 2
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, V, (MB, SEQ), generator=g),) * 2 for _ in range(STEPS)]
    return [e.train_step([b], 2e-3).loss for b in batches]


def test_a_lora_run_over_a_streamed_nf4_base_with_kept_blocks_trains_as_without(llama):
    """The frozen base's blocks are fetched again for their backward by hooks, recomputed or
    not: K = 1 (the last block kept, streamed) and K = 2 give K = 0's and off's losses."""
    ddp = dict(engine="ddp")
    ref = lora_losses(llama, EngineConfig(**ddp))
    for k in (0, 1, 2):
        got = lora_losses(llama, EngineConfig(**ddp, checkpointing="full", keep_activations=k))
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-6, k


# ---- the planner ----------------------------------------------------------------------------
def test_memory_grows_and_compute_falls_with_the_blocks_kept():
    """A full fine-tune's estimate at every K of 0..n: activations never fewer, K = n those of
    checkpointing off and at most one block input (sbh·w) more; the step's compute never more,
    K = n that of checkpointing off."""
    work = Workload(get_preset("llama3.1-8b"), 1)
    n = work.model.n_layer
    mem, secs = [], []
    for k in range(n + 1):
        e = full(k)
        mem.append(estimate(work, e).compute_peak)
        secs.append(step_time(work, e, 1, DEFAULTS["H200"])["compute"])
    off = EngineConfig(engine="zero")
    sbh_w = work.model.seq_len * work.model.n_embd * work.w
    assert mem == sorted(mem) and mem[0] < mem[-1]
    assert 0 <= mem[-1] - estimate(work, off).compute_peak <= sbh_w
    assert secs == sorted(secs, reverse=True) and secs[0] > secs[-1]
    assert secs[-1] == pytest.approx(step_time(work, off, 1, DEFAULTS["H200"])["compute"])


def lora70(keep_planned: bool, keep: int = 0):
    from helpers import run_config

    run = run_config("unused", micro_batch=1, checkpointing="full", precision="bf16",
                     device="cuda", keep_activations=keep)  # fmt: skip
    model = get_preset("llama3.1-70b").replace(seq_len=4096)
    a = AdapterConfig(lora_rank=16, base_format="nf4", keep_planned=keep_planned)
    return dataclasses.replace(run, model=model, adapter=a)


BOX = Hardware("cuda", 1, 80 * 10**9, "a GPU", 115 * 10**9, 16)  # --gpu-mem 80GB --cpu-mem 115GB


def test_the_lora_planner_keeps_what_fits_and_a_given_count():
    """The 70B NF4 QLoRA at 4,096 tokens on 80 GB: the planner keeps K > 0 blocks within the
    GPU budget, one more does not fit, and its predicted step is faster than K = 0's at the
    same placement; the GPU bytes grow with K; a K given is kept as given."""
    run = lora70(True)
    placed, line = plan_base(run, BOX)
    a, k = placed.adapter, placed.engine.keep_activations
    assert 0 < k < 80 and f"the last {k} blocks' activations kept" in line
    work = workload_of(run, 1, "cuda")

    def at(keep: int):
        return price_base(work, a, "nf4", a.base_host_blocks, "full", a.base_disk_blocks,
                          keep=keep)  # fmt: skip

    assert at(k).est.compute_total <= gpu_budget(BOX.gpu_mem) and not at(k + 1).fits(BOX)
    gpu = [at(i).est.compute_total for i in range(0, 81, 8)]
    assert gpu == sorted(gpu) and gpu[0] < gpu[-1]
    from fitgpt.plan.adapter import timed_base

    t = {i: timed_base(at(i), run, work, DEFAULTS["H200"]).time["total"] for i in (0, k)}
    assert t[k] < t[0]
    given, line = plan_base(lora70(False, 5), BOX)
    assert given.engine.keep_activations == 5 and "the last 5 blocks" in line


def test_plan_prints_the_count_as_a_train_flag_and_keeps_a_given_one(capsys):
    """`fitgpt plan`: the LoRA plan's train flags carry --keep-activations; a full fine-tune's
    keeps a given count in its train flags and its predicted step."""
    box = ["--gpu-mem", "80GB", "--cpu-mem", "115GB", "--device", "cuda"]
    shape = ["--preset", "llama3.1-70b", "--lora-rank", "16", "--base-format", "nf4",
             "--seq-len", "4096", "--micro-batch", "1"]  # fmt: skip
    code, out, _ = run_main(capsys, "plan", *shape, *box)
    assert code == 0 and "--checkpointing full --keep-activations " in out
    code, out, _ = run_main(capsys, "plan", *shape, *box, "--checkpointing", "full",
                            "--keep-activations", "7")  # fmt: skip
    assert code == 0 and "the last 7 blocks" in out and "--keep-activations 7" in out
    code, out, _ = run_main(capsys, "plan", "--preset", "gpt2-125m", "--micro-batch", "1", *box,
                            "--checkpointing", "full", "--keep-activations", "3")  # fmt: skip
    flags = next(line for line in out.splitlines() if line.startswith("as train flags:"))
    assert code == 0 and "--checkpointing full" in flags and "--keep-activations 3" in flags


# ---- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, names",
    [
        (["--keep-activations", "-1"], ["--keep-activations -1", ">= 0"]),
        (["--keep-activations", "1"], ["--keep-activations 1", "--checkpointing full"]),
        (["--checkpointing", "cpu", "--keep-activations", "1"], ["--checkpointing full", "cpu"]),
        (["--checkpointing", "full", "--keep-activations", "13"], ["--keep-activations 13", "12"]),
    ],
)
def test_a_bad_count_is_refused_in_one_line(capsys, tmp_path, flags, names):
    code, err = run_in_process(capsys, "train", "--preset", "gpt2-125m", "--data", "synthetic",
                               "--device", "cpu", "--steps", "1", "--out", tmp_path, *flags)  # fmt: skip
    assert_refused(code, err, *names)
