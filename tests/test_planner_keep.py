"""The full fine-tune planner chooses --keep-activations K (plan/enumeration.py most_kept):
under checkpointing full, every plan that fits keeps the most last blocks' activations that
still fit, priced as any plan is; fit itself is decided at K = 0 (or the K given), so the
searches for what fits (planner.py largest_seq_len, largest_micro_batch, the refusal) answer
as before; a K given is kept; `fitgpt plan` prints the K as a train flag; and train builds the
plan it was given: a tiny Llama on the CPU, whose --cpu-mem holds checkpointing full with some
blocks kept but not checkpointing off, trains with the recompute wrapped round the first
blocks only.

The GPU plans are priced for a GPU (Workload device "cuda") as the other planner tests do; the
GPU memory of each case is set between two of the model's own predicted peaks.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from cli_refusal import run_main
from helpers import assembled, run_config

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig
from fitgpt.model import ModelConfig
from fitgpt.plan.apply import workload_of
from fitgpt.plan.candidate import Candidate, evaluate
from fitgpt.plan.fixed import Fixed
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import GPU_SAFETY_MARGIN, GiB, Workload
from fitgpt.plan.planner import largest_seq_len, plan, refusal
from fitgpt.plan.rates import DEFAULTS
from fitgpt.train.loop import Trainer

LLAMA = ModelConfig(family="llama", n_layer=4, n_embd=64, n_head=4, n_kv_head=2, seq_len=64,
                    vocab_size=96, bias=False, position="rope", tie_embeddings=False)  # fmt: skip
N = LLAMA.n_layer
R = DEFAULTS["H200"]
# zero-0 with nothing offloaded: the plans that compete are checkpointing off and full
FIXED = {"engine": "zero", "offload_optimizer": "none"}
WORK = Workload(LLAMA, 8)  # bf16 on a GPU


def gpu(gpu_mem: int) -> Hardware:
    return Hardware("cuda", 1, gpu_mem, "H200", 100 * GiB, 16)


def priced(work: Workload, hw: Hardware, **fields) -> Candidate:
    """One zero-0 plan priced as the planner prices every plan."""
    return evaluate(work, 1, hw, R, EngineConfig(engine="zero", **fields))


def peaks(work: Workload) -> list[int]:
    """GPU bytes of checkpointing full at K = 0..N kept blocks."""
    return [priced(work, gpu(80 * GiB), checkpointing="full", keep_activations=k).est.compute_total
            for k in range(N + 1)]  # fmt: skip


def between(lo: int, hi: int) -> Hardware:
    """A GPU whose budget (less the safety margin) holds `lo` bytes but not `hi`."""
    assert lo < hi
    hw = gpu(int((lo + hi) // 2 / (1 - GPU_SAFETY_MARGIN)))
    budget = int(hw.gpu_mem * (1 - GPU_SAFETY_MARGIN))
    assert lo <= budget < hi
    return hw


def test_the_full_planner_keeps_the_most_blocks_that_fit_and_steps_faster():
    """A GPU between K = 2's peak and K = 3's: checkpointing off does not fit, the plan chosen
    is checkpointing full with the most blocks kept that fit (one more does not), its bytes and
    step are what pricing that K gives, and its step is faster than K = 0's."""
    p = peaks(WORK)
    assert p == sorted(p) and p[0] < p[-1]
    target = next(k for k in range(2, N) if p[k] < p[k + 1])  # K = 1 costs none (memory.py)
    hw = between(p[target], p[target + 1])
    assert not priced(WORK, hw, checkpointing="off").fits
    chosen = plan(WORK, 1, hw, R, FIXED)[0]
    e = chosen.ecfg
    k = e.keep_activations
    assert chosen.fits and e.checkpointing == "full" and k == target, chosen.name
    at = priced(WORK, hw, checkpointing="full", keep_activations=k, compile=e.compile)
    more = priced(WORK, hw, checkpointing="full", keep_activations=k + 1, compile=e.compile)
    none = priced(WORK, hw, checkpointing="full", compile=e.compile)
    assert at.fits and not more.fits
    assert chosen.est.compute_total == at.est.compute_total
    assert chosen.time["total"] == at.time["total"] < none.time["total"]
    assert f"checkpointing full (the last {k} blocks kept)" in chosen.name


def test_a_given_count_is_kept_and_the_count_stops_short_of_all_blocks():
    """K given (0 or 1) is the plan's, on the same GPU; with every block's room to spare and
    checkpointing full given, N-1 blocks are kept (N kept is checkpointing off's plan)."""
    p = peaks(WORK)
    target = next(k for k in range(2, N) if p[k] < p[k + 1])
    hw = between(p[target], p[target + 1])
    for given in (0, 1):
        chosen = plan(WORK, 1, hw, R, {**FIXED, "keep_activations": given})[0]
        assert chosen.ecfg.checkpointing == "full" and chosen.ecfg.keep_activations == given
    roomy = plan(WORK, 1, gpu(80 * GiB), R, {**FIXED, "checkpointing": "full"})
    assert all(c.ecfg.keep_activations == N - 1 for c in roomy if c.fits)
    assert plan(WORK, 1, gpu(80 * GiB), R, FIXED)[0].ecfg.checkpointing == "off"


def test_fit_is_decided_before_the_count():
    """A GPU that holds checkpointing full at 64 tokens with no room for a block's set more: the
    longest sequence found is still at least 64 (with a K given it is what that K fits, less);
    the refusal of a micro-batch that fits nowhere is the one a K fixed at 0 gives, and not the
    one of a large K given."""
    p = peaks(WORK)
    first = next(k for k in range(1, N) if p[k] < p[k + 1])
    hw = between(p[0], p[first + 1])
    # checkpointing full and fp32 state: neither the host's activations nor compact state
    # make a longer sequence fit
    fixed = {**FIXED, "checkpointing": "full", "master": "fp32", "moments": "fp32",
             "device_moments": "fp32"}  # fmt: skip
    seq = largest_seq_len(WORK, 1, hw, R, Fixed.of(fixed), below=2 * LLAMA.seq_len, quantum=8)
    assert seq >= LLAMA.seq_len
    fits = plan(dataclasses.replace(WORK, model=LLAMA.replace(seq_len=seq)), 1, hw, R, fixed)
    assert fits[0].fits
    given = Fixed.of({**fixed, "keep_activations": N - 1})
    assert largest_seq_len(WORK, 1, hw, R, given, below=2 * LLAMA.seq_len, quantum=8) < seq
    # 4x the micro-batch fits nowhere on this GPU
    big = dataclasses.replace(WORK, micro_batch=4 * WORK.micro_batch)

    def refused(**more) -> str:
        cands = plan(big, 1, hw, R, {**fixed, **more})
        assert not any(c.fits for c in cands)
        return refusal(big, 1, hw, R, cands, {**fixed, **more})

    line = refused()
    assert line == refused(keep_activations=0) and "micro-batch" in line
    assert line != refused(keep_activations=N - 1)


def test_plan_prints_the_chosen_count_in_the_train_flags(capsys):
    """`fitgpt plan` of an 8 B Llama on 4 H200s: the chosen plan keeps K blocks, says so and
    carries --keep-activations K in its train flags; --keep-activations 0 given: neither."""
    box = ["--preset", "llama3.1-8b", "--gpus", "4", "--device", "cuda",
           "--gpu-mem", "139.8GiB", "--cpu-mem", "476GiB"]  # fmt: skip

    def chosen(*flags: str) -> tuple[str, str]:
        code, out, _ = run_main(capsys, "plan", *box, *flags)
        lines = out.splitlines()
        assert code == 0, out
        pick = next(x for x in lines if x.startswith("chosen:"))
        return pick, next(x for x in lines if x.startswith("as train flags:"))

    line, flags = chosen()
    k = int(flags.split("--keep-activations ")[1].split()[0])
    assert 0 < k < 32 and f"(the last {k} blocks kept)" in line and "--checkpointing full" in flags
    line, flags = chosen("--keep-activations", "0")
    assert "kept" not in line and "--keep-activations" not in flags


def test_train_builds_the_planned_count_on_the_cpu(tmp_path):
    """A CPU run under --plan auto with --cpu-mem between checkpointing full's host bytes at
    K = 2 and at K = 3 (checkpointing off's do not fit): the plan keeps 2, the engine wraps the
    recompute round the first N-2 blocks only, and two steps train to finite losses."""
    cpu = DistContext(0, 1, 0, torch.device("cpu"))
    fixed = Fixed.of({"engine": "zero"})
    config = dataclasses.replace(run_config(tmp_path, micro_batch=8, steps=2), model=LLAMA)
    # the model as train settles it (its vocabulary from the data), priced as the planner prices
    settled = assembled(config, cpu, fixed=fixed).config
    work = workload_of(settled, 1, "cpu")
    box = Hardware("cpu", 1, 0, "cpu", 0, 2)

    def host(**fields) -> int:
        return evaluate(work, 1, box, R, EngineConfig(engine="zero", **fields)).est.host_total

    full = [host(checkpointing="full", keep_activations=k) for k in range(N + 1)]
    assert full == sorted(full) and full[2] < full[3] <= host(checkpointing="off")
    mem = math.ceil((full[2] + full[3]) / 2)
    run = assembled(dataclasses.replace(config, engine=EngineConfig(engine="zero", cpu_mem=mem)),
                    cpu, fixed=fixed)  # fmt: skip
    e = run.config.engine
    assert e.checkpointing == "full" and e.keep_activations == 2, e
    trainer = Trainer(run)
    wrapped = [hasattr(b.forward, "__wrapped__") for b in trainer.engine.model.blocks]
    assert wrapped == [True] * (N - 2) + [False] * 2
    losses = trainer.fit()["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
