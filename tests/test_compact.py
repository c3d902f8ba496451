"""Compact optimizer state (engine/formats/compact.py): the split master's codec, the piecewise
AdamW step against torch's, training on every tier and ZeRO stage against fp32 state, checkpoints
across formats, the bytes the engine holds against the Placement's, and the refusals."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cli_refusal import assert_refused, run_in_process
from helpers import TINY, run_config, train

from fitgpt.dist import DistContext, init_distributed
from fitgpt.engine.chunked.placement import Placement
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.engine.formats.compact import (
    CompactState,
    Scratch,
    join_master,
    split_master,
    state_layout,
)
from fitgpt.engine.formats.moments import BLOCK
from fitgpt.engine.state_io import KINDS, StateReader
from fitgpt.errors import UserError

CPU = DistContext(0, 1, 0, torch.device("cpu"))
I32 = torch.int32


# ---- the split master's codec ------------------------------------------------------------------
def codec(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(working weight, master joined back) of fp32 values x."""
    hi = torch.empty(x.shape, dtype=torch.bfloat16)
    rem = torch.empty(x.shape, dtype=torch.int16)
    split_master(x, hi, rem)
    back = torch.empty_like(x)
    join_master(hi, rem, back)
    return hi, back


def documented_ties(x: torch.Tensor) -> torch.Tensor:
    """Where the codec is documented to lose an ulp: low half 0x8000 (a tie) and an even high
    half (so torch's cast rounds it down)."""
    bits = x.view(I32)
    return ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) & 1 == 0)


def check_codec(x: torch.Tensor) -> int:
    """hi is torch's cast, bit for bit; join(split(x)) is x but at the documented ties, where it
    is x one ulp nearer zero, with the same bf16 rounding. Returns the number of ties."""
    hi, back = codec(x)
    assert torch.equal(hi.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    ties = documented_ties(x)
    assert torch.equal(back.view(I32), x.view(I32) - ties.to(I32))
    assert torch.equal(back.to(torch.bfloat16).view(torch.int16), hi.view(torch.int16))
    return int(ties.sum())


def test_codec_over_the_whole_fp32_range():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=g, dtype=torch.int64).to(I32)
    x = bits.view(torch.float32)
    check_codec(x[~x.isnan()])  # every exponent, both signs, subnormals included


def test_codec_at_the_extremes():
    f = torch.finfo(torch.float32)
    vals = [0.0, -0.0, f.max, -f.max, f.tiny, -f.tiny, f.smallest_normal / 2**23, 1.0, -1.0]
    vals += [float("inf"), float("-inf"), 2**-149 * 3, 1.0 + 2**-23]
    x = torch.tensor(vals, dtype=torch.float32)
    assert check_codec(x) == 0
    hi, back = codec(x)
    assert torch.equal(back.view(I32), x.view(I32))  # -0.0 keeps its sign, inf stays inf
    assert hi[2].item() == float("inf")  # fp32's max rounds up to bf16's inf, as torch's cast does
    nan = torch.tensor([float("nan")] * 2).view(I32) | torch.tensor(
        [0x1234, -(2**31) + 1], dtype=I32
    )
    assert codec(nan.view(torch.float32))[1].isnan().all()  # a NaN stays a NaN, either sign


@pytest.mark.parametrize("high", [0x3F80, 0x3F81, -0x40C0, -0x40BF, 0x0000, 0x0001, 0x7F7F])
def test_codec_over_every_low_half(high):
    """All 65536 low halves under one high half (even and odd, both signs, the subnormal range,
    the last finite binade): exactly one documented tie under an even high half, none under an
    odd one."""
    x = ((high << 16) + torch.arange(1 << 16, dtype=torch.int64)).to(I32).view(torch.float32)
    assert check_codec(x) == (1 if high % 2 == 0 else 0)


# ---- one CompactState against torch's fused AdamW ----------------------------------------------
N, DECAY_END, PIECE = 10_000, 4_500, 3_072  # a decay boundary off the vector width


def reference(master: torch.Tensor) -> tuple[torch.optim.AdamW, list[torch.Tensor]]:
    """torch.optim.AdamW(fused=True) over the master, as two decay groups."""
    params = [master[:DECAY_END].clone(), master[DECAY_END:].clone()]
    groups = [
        {"params": [params[0]], "weight_decay": 0.1},
        {"params": [params[1]], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.95), eps=1e-8, fused=True), params


def state(master: str, moments: str, w_dtype: torch.dtype, init: torch.Tensor):
    """A CompactState over N elements holding `init`, its working weights and a scratch of
    PIECE elements: 4 pieces, the last partial."""
    groups = [(0, DECAY_END, 0.1), (DECAY_END, N, 0.0)]
    s = CompactState(N, master, moments, torch.device("cpu"), groups, (0.9, 0.95), 1e-8)
    scratch, weights = Scratch(PIECE, torch.device("cpu")), torch.empty(N, dtype=w_dtype)
    s.load(init, None, None, weights, scratch)
    return s, scratch, weights


def steps(n: int, w_dtype: torch.dtype):
    """n (gradient in the working dtype, grad_mul, lr, the fp32 gradient every tier's fp32 path
    makes of it: upcast, then scaled in fp32)."""
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        grad = (torch.randn(N, generator=g) * 10 ** (i % 3 - 2)).to(w_dtype)
        mul, lr = 0.5 + 0.01 * i, 1e-3 * (1 + i % 5)
        g32 = grad.to(torch.float32, copy=True).mul_(mul)
        yield grad, mul, lr, g32


def torch_step(opt, params, g32: torch.Tensor, lr: float) -> None:
    for group, p, gg in zip(opt.param_groups, params, (g32[:DECAY_END], g32[DECAY_END:])):
        group["lr"], p.grad = lr, gg
    opt.step()


@pytest.mark.parametrize("master,w_dtype", [("fp32", torch.bfloat16), ("alias", torch.float32)])
def test_fp32_formats_step_like_torch_fused_adamw(master, w_dtype):
    """Several pieces, a partial last one, and the decay boundary inside a piece: the same bits
    as one fused step over the whole range, for 40 steps."""
    init = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.02
    s, scratch, weights = state(master, "fp32", w_dtype, init)
    opt, params = reference(init)
    for grad, mul, lr, g32 in steps(40, w_dtype):
        torch_step(opt, params, g32, lr)
        s.step(weights, grad, mul, lr, scratch)
    want = torch.cat([p.detach() for p in params])
    got_master, got_m, got_v = s.export(weights, N, scratch)
    assert torch.equal(got_master, want)
    for kind, got in (("exp_avg", got_m), ("exp_avg_sq", got_v)):
        assert torch.equal(got, torch.cat([opt.state[p][kind] for p in params])), kind
    assert torch.equal(weights, want.to(w_dtype))
    assert s.step_count.item() == 40


def test_split_master_steps_like_an_fp32_master_but_at_the_documented_ties():
    """200 steps against torch's AdamW on an fp32 master: after every step the joined master is
    torch's bit for bit except at the documented ties (one ulp nearer zero), and the working
    weights are torch's cast of torch's master. The reference then goes on from the stored
    master, so that every step is checked on its own."""
    init = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.02
    s, scratch, weights = state("split", "fp32", torch.bfloat16, init)
    opt, params = reference(init)
    ties = 0
    for grad, mul, lr, g32 in steps(200, torch.bfloat16):
        torch_step(opt, params, g32, lr)
        s.step(weights, grad, mul, lr, scratch)
        want = torch.cat([p.detach() for p in params])
        tie = documented_ties(want)
        got = s.export(weights, N, scratch)[0]
        assert torch.equal(got.view(I32), want.view(I32) - tie.to(I32))
        assert torch.equal(weights, want.to(torch.bfloat16))
        ties += int(tie.sum())
        with torch.no_grad():
            params[0].copy_(got[:DECAY_END])
            params[1].copy_(got[DECAY_END:])
    assert ties > 0  # ties were met (one element update in 2^17; 2·10^6 updates here)


def test_bytes_per_parameter_of_each_format():
    """Master and moments per element of a chunk of whole int8 blocks: docs/offload.md's table."""
    n = 64 * BLOCK
    per_block = 8 / BLOCK  # int8: one fp32 scale per block, per moment
    for (master, moments), want in {
        ("fp32", "fp32"): 12,
        ("split", "fp32"): 10,
        ("fp32", "bf16"): 8,
        ("split", "bf16"): 6,
        ("fp32", "int8"): 6 + per_block,
        ("split", "int8"): 4 + per_block,
        ("alias", "bf16"): 4,
    }.items():
        s = CompactState(n, master, moments, torch.device("cpu"), [(0, n, 0.0)], (0.9, 0.95), 1e-8)
        held = sum(t.nbytes for t in s.tensors().values())
        assert held == s.master_nbytes() + s.moments_nbytes() == want * n, (master, moments)
        assert state_layout(n, master, moments, True) == {
            k: t.nbytes for k, t in s.tensors().items()
        }


# ---- the engine: every tier and stage ------------------------------------------------------------
STEPS = 8
TIERS = ("device", "cpu", "streamed", "nvme")


def tier(name: str, disk) -> dict:
    """Engine flags of a tier on TINY's 2 blocks: the embedding and head stay on the device; "cpu"
    homes one block in host RAM, "streamed" both with their weights there too, "nvme" one in
    host RAM and one in files under `disk`."""
    return {
        "device": {},
        "cpu": dict(offload_optimizer="cpu", offload_blocks=1),
        "streamed": dict(offload_optimizer="cpu", offload_params="cpu"),
        "nvme": dict(offload_optimizer="nvme", nvme_blocks=1, nvme_path=str(disk)),
    }[name]


def batches(steps: int, world: int = 1, rank: int = 0):
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        # a quarter of the vocabulary: a loss that descends (test_offload.py says why)
        x = torch.randint(0, TINY.vocab_size // 4, (4, TINY.seq_len + 1), generator=g)
        rows = x[rank * 4 // world : (rank + 1) * 4 // world]
        yield [(rows[:, :-1], rows[:, 1:])]


def normal(mem: dict) -> dict:
    """{tier: {kind: bytes}} without zeros; the compute device's type ("cpu") named "device"."""
    out = {}
    for where, kinds in mem.items():
        kinds = {k: v for k, v in kinds.items() if v}
        if kinds:
            out["device" if where not in ("host", "nvme") else where] = kinds
    return out


@dataclass
class Run:
    losses: list[float]
    weights: torch.Tensor  # every working weight (the forward's values), flat
    master: torch.Tensor  # this rank's fp32 master, as checkpoints hold it (chunk_state.py)
    report: dict  # memory_report() after construction
    placed: dict  # Placement.state_bytes() of the same config


def run(ctx: DistContext = CPU, steps: int = STEPS, precision: str = "bf16", **engine) -> Run:
    ecfg = EngineConfig(engine="zero", **engine)
    e = build_engine(TINY, ecfg, PrecisionConfig(precision), OptimConfig(), ctx)
    world = ctx.world if ctx.distributed else 1
    placed = Placement.of(e.layout, ecfg, world, e.dtype.itemsize, ctx.device.type).state_bytes()
    report = e.memory_report()
    losses = [e.train_step(b, 3e-3).loss for b in batches(steps, world, ctx.rank)]
    weights = torch.cat([p.detach().float().flatten() for p in e.inference_model().parameters()])
    master = torch.cat([p.tensors["master"] for p in e.state_io.pieces(KINDS)])
    e.close()
    return Run(losses, weights, master, normal(report), normal(placed))


def split_facts(got: Run, ref: Run, steps: int = STEPS) -> dict:
    """What a split-master run shares with the fp32-master run of the same tier (JSON)."""
    d = (got.master.view(I32) - ref.master.view(I32)).abs()
    low = got.master != got.master.to(torch.bfloat16).float()
    return {
        "same_losses": got.losses == ref.losses,
        "same_weights": torch.equal(got.weights, ref.weights),
        "differing": int((d > 0).sum()),
        "max_ulps": int(d.max()),
        "updates": steps * d.numel(),
        "low_bits": float(low.float().mean()),
        "memory": [got.report == got.placed, ref.report == ref.placed],
        "master_bytes": [
            got.report[w]["master_weights"] < ref.report[w]["master_weights"]
            for w in ("device", "host", "nvme")
            if w in ref.report
        ],
    }


def check_split(f: dict) -> None:
    """The split master trains as the fp32 one: the same losses and working weights bit for bit,
    and the same fp32 master but at the documented ties (engine/formats/compact.py: one element
    update in 2^17 stores its master an ulp nearer zero, and the later steps carry that along, by an
    ulp or two, without changing its bf16 rounding); the engine holds what the Placement says,
    and fewer master bytes on every tier."""
    assert f["same_losses"] and f["same_weights"], f
    assert f["differing"] <= max(4, f["updates"] >> 14) and f["max_ulps"] <= 4, f
    assert f["low_bits"] > 0.9, f  # the fp32 master, not just its bf16 high half
    assert all(f["memory"]) and f["master_bytes"] and all(f["master_bytes"]), f


@pytest.mark.parametrize("name", TIERS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_split_master_trains_like_the_fp32_master(stage, name, tmp_path):
    kw = dict(zero_stage=stage, **tier(name, tmp_path))
    check_split(split_facts(run(master="split", **kw), run(**kw)))


@pytest.mark.parametrize("name", TIERS)
def test_compact_moments_train_close_to_fp32_moments(name, tmp_path):
    """bf16 and int8 moments of the tier's own chunks (the device's with "device", the
    offloaded ones' otherwise), beside a split master: close to fp32 state, not equal to it."""
    kw = dict(master="split", **tier(name, tmp_path))
    ref = run(steps=12, **tier(name, tmp_path))
    # measured: both within 5e-4 of fp32's losses over these 12 steps
    for fmt, tol in (("bf16", 3e-3), ("int8", 3e-3)):
        got = run(steps=12, **kw, **{"device_moments" if name == "device" else "moments": fmt})
        assert got.losses[0] == ref.losses[0]  # the first forward is before any update
        assert max(abs(a - b) for a, b in zip(got.losses, ref.losses)) < tol, fmt
        assert got.losses != ref.losses, fmt  # the compact stores were really used
        assert got.losses[0] - got.losses[-1] > 0.8 * (ref.losses[0] - ref.losses[-1]), fmt
        assert got.report == got.placed, fmt


# ---- two ranks ---------------------------------------------------------------------------------
def two_rank_worker(rank: int, world: int, disk: str, out: str) -> None:
    """Stages 1-3 at world size 2: split against fp32 masters on every tier, compact moments,
    and the bytes held against the Placement for more formats. Facts only, written to a file
    per rank: an assert here would leave the other rank waiting in a collective."""
    ctx = init_distributed("cpu")
    facts: dict = {"split": {}, "moments": {}, "memory": []}
    for stage in (1, 2, 3):
        for name in TIERS:
            if name == "streamed" and stage < 3:
                continue  # refused on several ranks (test_engine_dist.py)
            kw = dict(zero_stage=stage, **tier(name, disk))
            facts["split"][f"{stage}-{name}"] = split_facts(
                run(ctx, master="split", **kw), run(ctx, **kw)
            )
    ref = run(ctx, zero_stage=3, **tier("cpu", disk))
    got = run(
        ctx,
        zero_stage=3,
        master="split",
        moments="int8",
        device_moments="bf16",
        **tier("cpu", disk),
    )
    facts["moments"] = {"ref": ref.losses, "got": got.losses, "memory": got.report == got.placed}
    for stage in (1, 2, 3):
        for name in ("cpu", "nvme"):
            for precision in ("fp32", "bf16"):
                ecfg = EngineConfig(engine="zero", zero_stage=stage, master="split", moments="int8",
                                    device_moments="bf16", **tier(name, disk))  # fmt: skip
                e = build_engine(TINY, ecfg, PrecisionConfig(precision), OptimConfig(), ctx)
                want = Placement.of(e.layout, ecfg, world, e.dtype.itemsize, "cpu").state_bytes()
                if normal(e.memory_report()) != normal(want):
                    facts["memory"].append([stage, name, precision])
                e.close()
    Path(out, f"r{rank}.json").write_text(json.dumps(facts))


@pytest.mark.slow
def test_two_ranks_split_master_and_compact_moments(tmp_path, gloo):
    disk = tmp_path / "disk"
    disk.mkdir()
    gloo(2, two_rank_worker, str(disk), str(tmp_path))
    for rank in range(2):
        facts = json.loads((tmp_path / f"r{rank}.json").read_text())
        assert len(facts["split"]) == 10
        for key, f in facts["split"].items():
            try:
                check_split(f)
            except AssertionError as e:
                raise AssertionError(f"rank {rank}, stage-tier {key}: {e}") from None
        ref, got = facts["moments"]["ref"], facts["moments"]["got"]
        assert got[0] == ref[0] and got != ref and facts["moments"]["memory"]
        assert max(abs(a - b) for a, b in zip(got, ref)) < 3e-3
        assert facts["memory"] == []  # (stage, tier, precision) whose bytes differ


# ---- checkpoints across formats ----------------------------------------------------------------
def save_and_resume(
    tmp_path, saved: dict, resumed: dict, ctx: DistContext = CPU
) -> tuple[list[float], list[float]]:
    """12 steps saved at step 6 in `saved`'s formats; steps 7-12 again, resumed in `resumed`'s:
    (the first run's losses of steps 7-12, the resumed run's)."""
    kw = dict(engine="zero", precision="bf16", lr=1e-2, device=ctx.device.type)
    full = train(run_config(tmp_path, steps=12, save_every=6, **kw, **saved), ctx)
    shutil.rmtree(tmp_path / "step_00000012")
    again = train(run_config(tmp_path, steps=12, **kw, **resumed), ctx, resume="")
    return full["losses"][6:], again["losses"]


def disk(tmp_path) -> dict:
    (tmp_path / "disk").mkdir(exist_ok=True)
    return dict(nvme_path=str(tmp_path / "disk"), offload_optimizer="nvme", nvme_blocks=1)


@pytest.mark.parametrize(
    "saved,resumed",
    [
        (
            dict(offload_optimizer="cpu"),
            dict(offload_optimizer="cpu", master="split", moments="int8"),
        ),
        (dict(master="split", device_moments="bf16"), {}),
        (dict(offload_optimizer="cpu", moments="int8"), dict(device_moments="bf16")),
        ("disk-fp32", "disk-split-int8"),
    ],
    ids=["fp32-to-split-int8-host", "split-bf16-to-fp32", "int8-host-to-bf16-device", "disk"],
)
def test_resume_into_other_formats_continues_the_curve(saved, resumed, tmp_path):
    if saved == "disk-fp32":  # a disk-homed chunk loaded into compact formats
        saved, resumed = disk(tmp_path), dict(**disk(tmp_path), master="split", moments="int8")
    want, got = save_and_resume(tmp_path, saved, resumed)
    # checkpoints hold the fp32 master, whose bf16 cast is the working weight in every format:
    # the first resumed forward is the uninterrupted run's, bit for bit
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got, want)) < 3e-3  # measured: < 5e-4
    assert got != want  # the other format was really used


def test_resume_in_the_same_compact_formats_is_exact(tmp_path):
    """Split master and bf16 moments, one block's on disk: saved decoded to fp32, loaded back
    into the same formats without a bit lost, so the resumed run is the uninterrupted one."""
    fmt = dict(**disk(tmp_path), master="split", moments="bf16", device_moments="bf16")
    want, got = save_and_resume(tmp_path, fmt, fmt)
    assert got == want


def test_weights_only_checkpoints_hold_the_fp32_master(tmp_path):
    """A weights-only checkpoint of a split master (the device's, host RAM's and the disk's
    chunks) holds the fp32 master: the fp32-master run's, but at the documented ties, whose
    bf16 cast is the working weights."""
    saved = {}
    for master in ("fp32", "split"):
        e = build_engine(TINY, EngineConfig(engine="zero", master=master, **disk(tmp_path)),
                         PrecisionConfig("bf16"), OptimConfig(), CPU)  # fmt: skip
        for b in batches(STEPS):
            e.train_step(b, 3e-3)
        (tmp_path / master).mkdir()
        e.save_state(tmp_path / master, optimizer=False)
        reader = StateReader(tmp_path / master)
        assert {k for es in reader.entries.values() for x in es for k in x["crc"]} == {"master"}
        saved[master] = [reader.read(c.spec.index, "master", 0, c.n) for c in e.chunks]
        for c, m in zip(e.chunks, saved[master]):
            e.fetcher.ensure(c)  # the streamed and sharded ones' full weights
            assert torch.equal(m.to(torch.bfloat16), c.weight[: c.n])
        e.close()
    got, ref = torch.cat(saved["split"]), torch.cat(saved["fp32"])
    d = (got.view(I32) - ref.view(I32)).abs()
    assert int((d > 0).sum()) <= 4 and int(d.max()) <= 4
    assert (got != got.to(torch.bfloat16).float()).float().mean() > 0.9


# ---- bytes held: every format, tier, stage and precision ---------------------------------------
FORMATS = [(m, f) for m in ("fp32", "split") for f in ("fp32", "bf16", "int8")]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", TIERS)
def test_memory_report_equals_the_placement_for_every_format(name, stage, precision, tmp_path):
    for i, (master, moments) in enumerate(FORMATS):
        device_moments = FORMATS[(i + 1) % len(FORMATS)][1]  # device chunks in another format
        ecfg = EngineConfig(engine="zero", zero_stage=stage, master=master, moments=moments,
                            device_moments=device_moments, **tier(name, tmp_path))  # fmt: skip
        e = build_engine(TINY, ecfg, PrecisionConfig(precision), OptimConfig(), CPU)
        want = Placement.of(e.layout, ecfg, 1, e.dtype.itemsize, "cpu").state_bytes()
        assert normal(e.memory_report()) == normal(want), (master, moments, device_moments)
        e.close()


# ---- GPU checks (skipped without CUDA; run them on the device) ---------------------------------
# What the CPU cannot reach: a host-homed split master whose working weights live on the GPU
# (brought down beside the gradient, `weight_staging`), its initialisation and checkpoints
# across devices, the device tier's pieces on a GPU.
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU check: run on the device")


@GPU
@pytest.mark.parametrize("name", TIERS)
@pytest.mark.parametrize("stage", [0, 3])
def test_gpu_split_master_trains_like_the_fp32_master(stage, name, tmp_path):
    gpu = DistContext(0, 1, 0, torch.device("cuda"))
    kw = dict(zero_stage=stage, **tier(name, tmp_path))
    check_split(split_facts(run(gpu, master="split", **kw), run(gpu, **kw)))


@GPU
def test_gpu_checkpoints_of_host_homed_split_masters(tmp_path):
    gpu = DistContext(0, 1, 0, torch.device("cuda"))
    fmt = dict(offload_optimizer="cpu", offload_blocks=1, master="split", moments="int8")
    want, got = save_and_resume(tmp_path / "a", fmt, {}, gpu)  # into fp32 state
    assert got[0] == want[0] and max(abs(a - b) for a, b in zip(got, want)) < 3e-3
    fmt = dict(offload_optimizer="cpu", offload_blocks=1, master="split", moments="bf16")
    want, got = save_and_resume(tmp_path / "b", fmt, fmt, gpu)
    assert got == want  # the same formats: exact


# ---- refusals ----------------------------------------------------------------------------------
TRAIN = (
    "train --preset tiny --layers 2 --hidden 32 --heads 2 --seq-len 16 --steps 2 --micro-batch 2 "
    "--device cpu --plan off --eval-every 0 --log-every 1 --data synthetic --vocab-size 64 "
    "--no-save --out r"
)


@pytest.mark.parametrize(
    "flags,names",
    [
        ("--engine zero --master split --precision fp16", ["--master split", "--precision bf16"]),
        ("--engine ddp --moments int8", ["--engine ddp", "--engine zero"]),
        ("--engine ddp --master split", ["--engine ddp", "--engine zero"]),
        ("--engine ddp --device-moments bf16", ["--engine ddp", "--engine zero"]),
    ],
)  # fmt: skip
def test_formats_that_cannot_work_are_refused_in_one_line(
    flags, names, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    code, err = run_in_process(capsys, *f"{TRAIN} {flags}".split())
    assert_refused(code, err, *names)


def test_split_master_with_fp16_is_refused_at_engine_start_up():
    """fp16 working weights hold no high half of an fp32 master: the engine refuses the plan
    it is given (the planner's too), before allocating anything."""
    with pytest.raises(UserError, match=r"--master split .* --precision bf16"):
        build_engine(TINY, EngineConfig(engine="zero", master="split"), PrecisionConfig("fp16"),
                     OptimConfig(), CPU)  # fmt: skip
    for fmt in (dict(master="split"), dict(moments="bf16"), dict(device_moments="int8")):
        with pytest.raises(UserError, match="--engine ddp keeps torch's fp32 optimizer state"):
            EngineConfig(engine="ddp", **fmt)


@GPU
def test_gpu_machine_compiled_int8_codec_steps_like_the_eager_one(monkeypatch):
    """The host's compiled int8 kernels (engine/formats/codec.py, the default on GPU machines)
    against the eager stores over 5 steps of two whole pieces and a partial one: the same state but
    for what a last-bit difference in v's scales moves (the compiler's square root: codec.py), and
    the compiled kernels really used."""
    from fitgpt.engine.formats import codec

    P, n = 1 << 20, (1 << 21) + 4096
    out = {}
    for mode in ("eager", "compiled"):
        monkeypatch.setenv("FITGPT_HOST_KERNELS", mode)
        s = CompactState(n, "split", "int8", torch.device("cpu"), [(0, n, 0.1)], (0.9, 0.95), 1e-8)
        scratch, w = Scratch(P, torch.device("cpu")), torch.empty(n, dtype=torch.bfloat16)
        s.load(torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02, None, None, w,
               scratch)  # fmt: skip
        s.warm_up(scratch)
        assert (codec.kernels("int8", torch.device("cpu")) is not None) == (mode == "compiled")
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            s.step(w, (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16), 0.5, 1e-3, scratch)
        out[mode] = (w.clone(), s.export(w, n, scratch))
    (we, (me, m1e, v1e)), (wc, (mc, m1c, v1c)) = out["eager"], out["compiled"]
    # 5 steps of lr 1e-3: the Adam steps differ only where v's decoded values do (measured on
    # the 2-core box: master by <= 1.1e-4, 240 of 2 M weights by one bf16 step, m not at all)
    assert torch.allclose(mc, me, rtol=0, atol=5e-4)
    assert (wc.float() - we.float()).abs().max() <= 1e-3 and (wc != we).float().mean() < 0.01
    assert torch.allclose(m1c, m1e, rtol=0, atol=float(m1e.abs().max()) / 100)
    assert torch.allclose(v1c, v1e, rtol=0, atol=float(v1e.max()) / 100)


# ---- the native host kernel (engine/formats/hostkernel.py) ---------------------------------------
NATIVE = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler here"
)


def native_steps(monkeypatch, mode: str, master: str, moments: str, n_steps: int = 6):
    """CompactState over N (several int8 blocks, a partial last one, the decay boundary inside
    a block) stepped under FITGPT_HOST_KERNELS=mode; returns weights, (master, m, v), and how
    many steps went through the native kernel."""
    from fitgpt.engine.formats import hostkernel

    monkeypatch.setenv("FITGPT_HOST_KERNELS", mode)
    calls = []
    real = hostkernel.adamw_
    monkeypatch.setattr(hostkernel, "adamw_", lambda *a: calls.append(1) or real(*a))
    init = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.02
    groups = [(0, DECAY_END, 0.1), (DECAY_END, N, 0.0)]
    s = CompactState(N, master, moments, torch.device("cpu"), groups, (0.9, 0.95), 1e-8)
    scratch, weights = Scratch(2 * BLOCK, torch.device("cpu")), torch.empty(N, dtype=torch.bfloat16)
    s.load(init, None, None, weights, scratch)
    for grad, mul, lr, _ in steps(n_steps, torch.bfloat16):
        s.step(weights, grad, mul, lr, scratch)
    return weights, s.export(weights, N, scratch), len(calls)


@NATIVE
@pytest.mark.parametrize(
    ("master", "moments"),
    [("split", "bf16"), ("fp32", "bf16"), ("split", "int8"), ("fp32", "int8")],
)
def test_native_host_kernel_steps_like_the_torch_path(master, moments, monkeypatch):
    """The native kernel against the torch path (eager) over 6 steps: the same AdamW, so the
    same state but where an fp32 last bit, rounded into a narrow moment, moves it by one step of
    its format (measured: the master within 2.5e-4 at lr up to 5e-3, under 1% of weights one
    bf16 step apart)."""
    we, (pe, me, ve), used_e = native_steps(monkeypatch, "eager", master, moments)
    wn, (pn, mn, vn), used_n = native_steps(monkeypatch, "native", master, moments)
    assert (used_e, used_n) == (0, 6)
    assert torch.allclose(pn, pe, rtol=0, atol=5e-4)
    assert (wn.float() - we.float()).abs().max() <= 2e-3 and (wn != we).float().mean() < 0.02
    for got, want in ((mn, me), (vn, ve)):
        assert torch.allclose(got, want, rtol=0, atol=float(want.abs().max()) / 50)


@NATIVE
@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_native_split_master_steps_like_the_native_fp32_master(moments, monkeypatch):
    """Through the native kernel, a split master is the fp32 master but at the documented ties
    (compact.py), as through torch's: the same working weights and moments bit for bit."""
    ws, (ps, ms, vs), used = native_steps(monkeypatch, "native", "split", moments, 20)
    wf, (pf, mf, vf), used_f = native_steps(monkeypatch, "native", "fp32", moments, 20)
    assert used == used_f == 20
    assert torch.equal(ws, wf) and torch.equal(ms, mf) and torch.equal(vs, vf)
    # a tie's ulp stays an ulp of the magnitude it was made at (more of them as an element
    # shrinks towards zero): bounded in absolute terms, and few elements
    assert torch.allclose(ps, pf, rtol=0, atol=1e-8)
    assert int((ps != pf).sum()) <= max(4, 20 * N >> 14)


@NATIVE
@pytest.mark.parametrize("name", ["cpu", "nvme"])
def test_native_host_kernel_trains_offloaded_chunks(name, tmp_path, monkeypatch):
    """The engine's host tier through the native kernel (split master, bf16 moments): the
    losses of the torch path within what the last-bit differences move (measured 2e-6)."""
    kw = dict(master="split", moments="bf16", **tier(name, tmp_path))
    monkeypatch.setenv("FITGPT_HOST_KERNELS", "eager")
    ref = run(steps=12, **kw)
    monkeypatch.setenv("FITGPT_HOST_KERNELS", "native")
    got = run(steps=12, **kw)
    assert got.losses[0] == ref.losses[0]
    assert max(abs(a - b) for a, b in zip(got.losses, ref.losses)) < 1e-3
    assert got.losses != ref.losses  # the native kernel really stepped the host chunk
    assert got.report == got.placed


@NATIVE
def test_fp32_compute_keeps_the_torch_path_under_the_native_setting(tmp_path, monkeypatch):
    """The kernel reads bf16 weights and gradients: with fp32 compute (fp32 weights, fp32
    gradients) the host chunks' compact moments step through torch, as without it, bit for bit
    (a GPU machine's default once read fp32 buffers as bf16 pairs: garbage losses)."""
    kw = dict(moments="bf16", **tier("cpu", tmp_path))
    out = {}
    for mode in ("eager", "native"):
        monkeypatch.setenv("FITGPT_HOST_KERNELS", mode)
        out[mode] = run(steps=6, precision="fp32", **kw).losses
    assert out["native"] == out["eager"]
