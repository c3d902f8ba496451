"""The frozen base of a LoRA run held in fewer bytes and placed in tiers (fitgpt/engine/formats/frozen_base.py,
engine/chunked/frozen.py, plan/adapter.py): NF4 and int8 against bitsandbytes bit for bit, a
base streamed from the host tier against the ddp engine's plain fp32 base, the base's bytes
unchanged by training, the planner's refusal and `fitgpt capacity --lora-rank`.

The HF model is built here with random weights (3 layers, 64 wide) and saved to a temporary
folder: nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from cli_refusal import assert_refused, run_in_process, run_main
from helpers import close, tiny_llama_folder

from fitgpt.adapters import AdapterConfig
from fitgpt.dist import DistContext
from fitgpt.engine.chunked.frozen import DiskBlocks
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.engine.formats.frozen_base import BlockCodec
from fitgpt.engine.layout import ChunkSpec, ParamSlot
from fitgpt.errors import UserError
from fitgpt.interop.init_source import find_source
from fitgpt.plan.adapter import largest_lora, plan_base
from fitgpt.plan.adapter_memory import price_base
from fitgpt.plan.apply import workload_of
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import HOST_BASE, Workload
from fitgpt.train.init_from import load_source

bnbf = pytest.importorskip("bitsandbytes.functional")
transformers = pytest.importorskip("transformers")

CPU = DistContext(0, 1, 0, torch.device("cpu"))
V, SEQ, MB, STEPS = 300, 32, 4, 4
# shapes that leave a partial block of 64 weights and of 256 absmaxes, and a vector
SHAPES = [(96, 64), (33, 17), (257, 130), (40,)]


def spec_of(shapes) -> ChunkSpec:
    slots, at = [], 0
    for i, shape in enumerate(shapes):
        n = int(torch.Size(shape).numel())
        slots.append(ParamSlot(f"w{i}", tuple(shape), at, n))
        at += n
    return ChunkSpec(0, "block.0", tuple(slots), at, at)


def packed(fmt: str, flat: torch.Tensor, working=torch.float32):
    codec = BlockCodec(spec_of(SHAPES), fmt, working)
    buf = torch.zeros(codec.nbytes, dtype=torch.uint8)
    codec.pack(flat, buf)
    out = torch.empty(flat.numel(), dtype=working)
    codec.unpack(buf, out)
    return codec, buf, out


def parts(codec: BlockCodec, buf: torch.Tensor, i: int) -> dict[str, torch.Tensor]:
    return {name: buf[at : at + n] for name, at, n in codec.regions[i].parts}


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("working", [torch.float32, torch.bfloat16])
def test_nf4_is_bitsandbytes_nf4_bit_for_bit(source, working):
    """Each matrix's bytes (codes, absmaxes, their scales, offset) are quantize_4bit's with
    QLoRA's settings, and unpacking gives dequantize_4bit's values, from a bf16 source too."""
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(sum(torch.Size(s).numel() for s in SHAPES), generator=g) * 0.05
    flat = flat.to(source).float()
    codec, buf, out = packed("nf4", flat, working)
    for i, s in enumerate(codec.spec.slots):
        w = flat[s.offset : s.offset + s.numel].view(s.shape)
        got = out[s.offset : s.offset + s.numel].view(s.shape)
        if len(s.shape) == 1:  # vectors are held in bf16
            assert torch.equal(got, w.to(torch.bfloat16).to(working))
            continue
        q, st = bnbf.quantize_4bit(w.to(source), blocksize=64, compress_statistics=True,
                                   quant_type="nf4")  # fmt: skip
        p = parts(codec, buf, i)
        assert torch.equal(p["codes"], q.reshape(-1))
        assert torch.equal(p["absmax"], st.absmax)
        assert torch.equal(p["scales"].view(torch.float32), st.state2.absmax)
        assert torch.equal(p["offset"].view(torch.float32), st.offset.reshape(1))
        st.dtype = working
        assert torch.equal(got, bnbf.dequantize_4bit(q, st))
        assert (got.float() - w).abs().max() < 0.5 * w.abs().max()  # a round trip, not noise


def test_int8_is_bitsandbytes_per_row_absmax():
    """int8: the codes and row scales are int8_vectorwise_quant's (of the weights in fp16, as
    bitsandbytes quantises its own); each weight comes back within half a step (max|row|/254)
    of itself, and fp16's rounding."""
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(sum(torch.Size(s).numel() for s in SHAPES), generator=g)
    codec, buf, out = packed("int8", flat)
    for i, s in enumerate(codec.spec.slots):
        if len(s.shape) == 1:
            continue
        w = flat[s.offset : s.offset + s.numel].view(s.shape)
        codes, scales, _ = bnbf.int8_vectorwise_quant(w.half())
        p = parts(codec, buf, i)
        assert torch.equal(p["codes"].view(torch.int8).view(s.shape), codes)
        assert torch.equal(p["scales"].view(torch.float32), scales)
        got = out[s.offset : s.offset + s.numel].view(s.shape)
        assert torch.equal(got, bnbf.int8_vectorwise_dequant(codes, scales))
        step = w.abs().amax(dim=1, keepdim=True) / 127
        assert ((got - w).abs() <= step / 2 + w.abs() * 2**-11 + 1e-6).all()


@pytest.mark.parametrize("fmt, size", [("fp32", 4), ("bf16", 2), ("int8", 1), ("nf4", 0.5)])
def test_a_format_holds_its_bytes_per_parameter(fmt, size):
    codec = BlockCodec(spec_of([(256, 512)]), fmt, torch.float32)
    assert size * 256 * 512 <= codec.nbytes <= size * 256 * 512 * 1.04


# ---- the engine: a base held packed, streamed from the host tier ---------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("hf"), V)


def data():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, V, (MB, SEQ), generator=g), torch.randint(0, V, (MB, SEQ), generator=g))
        for _ in range(STEPS)
    ]


def trained(folder, checkpointing="off", accum=1, **base):
    """(losses, engine) of STEPS LoRA steps over `folder`'s base, held as `base` asks, of
    `accum` micro-batches each."""
    source = find_source(str(folder))
    a = AdapterConfig(lora_rank=4, **base)
    e = build_engine(source.model, EngineConfig(engine="ddp", checkpointing=checkpointing),
                     PrecisionConfig("fp32"), OptimConfig(grad_clip=1.0), CPU, 3, a)  # fmt: skip
    load_source(source, e, source.model, CPU)
    return [e.train_step([b] * accum, 2e-3).loss for b in data()], e


def adapters_of(e) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in e.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("host_blocks, checkpointing, accum", [(3, "off", 1), (1, "full", 2)])
def test_a_base_streamed_from_host_ram_trains_as_the_ddp_engine_s(
    llama, host_blocks, checkpointing, accum
):
    """fp32 blocks in the host tier, fetched per use (recomputed blocks, accumulated
    micro-batches too): the losses and adapters of the plain ddp engine's fp32 base, bit for
    bit."""
    ref, e0 = trained(llama, checkpointing, accum, base_format="fp32")
    got, e = trained(llama, checkpointing, accum, base_format="fp32", base_host_blocks=host_blocks)
    assert e0.store is None and sum(c.streamed for c in e.store.chunks) == host_blocks
    assert got == ref
    a, b = adapters_of(e0), adapters_of(e)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt, tol", [("bf16", 1e-3), ("int8", 5e-3), ("nf4", 5e-2)])
def test_a_packed_base_trains_close_to_fp32_and_its_bytes_never_change(llama, fmt, tol):
    """Held in bf16, int8 or NF4 (the last block streamed): the losses near the fp32 base's,
    the held bytes of every block bit-identical before and after training, and unpacking them
    gives the weights the blocks ran with."""
    ref, _ = trained(llama, base_format="fp32")
    source = find_source(str(llama))
    e = build_engine(source.model, EngineConfig(engine="ddp"), PrecisionConfig("fp32"),
                     OptimConfig(grad_clip=1.0), CPU, 3,
                     AdapterConfig(lora_rank=4, base_format=fmt, base_host_blocks=1))  # fmt: skip
    load_source(source, e, source.model, CPU)
    before = [c.weight_shard.clone() for c in e.store.chunks]
    got = [e.train_step([b], 2e-3).loss for b in data()]
    assert all(torch.equal(c.weight_shard, b) for c, b in zip(e.store.chunks, before))
    assert got != ref and max(abs(a - b) for a, b in zip(got, ref)) < tol


# ---- the run: planned, refused, resumed ------------------------------------------------------
def lora_run(preset: str, fmt: str, micro_batch: int, checkpointing: str):
    from helpers import run_config

    from fitgpt.model import get_preset

    run = run_config("unused", micro_batch=micro_batch, checkpointing=checkpointing,
                     precision="bf16", device="cuda")  # fmt: skip
    return dataclasses.replace(
        run, model=get_preset(preset), adapter=AdapterConfig(lora_rank=16, base_format=fmt)
    )


def gpu(gpu_gb: float, host_gb: float) -> Hardware:
    return Hardware("cuda", 1, int(gpu_gb * 2**30), "a GPU", int(host_gb * 2**30), 16)


def test_the_planner_streams_the_fewest_blocks_that_fit_and_refuses_in_one_line():
    """A 70B-shaped bf16 base on one 80 GB GPU: some blocks streamed from host RAM, the fewest
    that fit (one fewer does not); NF4 holds it all on the GPU; a GPU and host too small for
    bf16 are refused in one line that names the format that fits."""
    run = lora_run("llama3.1-70b", "bf16", 1, "full")
    placed, line = plan_base(run, gpu(80, 512))
    h = placed.adapter.base_host_blocks
    assert 0 < h < 80 and f"{h} streamed from host RAM" in line
    work = workload_of(run, 1, "cuda")
    assert price_base(work, run.adapter, "bf16", h, "full").fits(gpu(80, 512))
    assert not price_base(work, run.adapter, "bf16", h - 1, "full").fits(gpu(80, 512))
    nf4, _ = plan_base(lora_run("llama3.1-70b", "nf4", 1, "full"), gpu(80, 512))
    assert nf4.adapter.base_host_blocks == 0
    with pytest.raises(UserError) as e:
        plan_base(run, gpu(24, 64))
    msg = str(e.value)
    assert "\n" not in msg and "--lora-rank 16" in msg and "--base-format nf4 fits" in msg
    with pytest.raises(UserError, match="--checkpointing full fits"):
        plan_base(lora_run("llama3.1-8b", "bf16", 4, "off"), gpu(80, 512))


def test_the_planner_recomputes_where_it_must_and_not_where_it_is_slower(capsys):
    """--checkpointing not given (--plan auto): an 8B bf16 base at micro-batch 4 on 80 GB does
    not fit without recompute at any streaming (92.7 GiB of activations), so the planner turns
    checkpointing on, and says so; at micro-batch 1 the whole base fits without it, which its
    step time prices faster (tests/test_adapter_time.py weighs the two where both stream or
    not), so it stays off; a --checkpointing typed is kept (and refused in one line naming the
    fix)."""
    box = ["--gpu-mem", "80GB", "--cpu-mem", "115GB", "--device", "cuda"]
    shape = ["--preset", "llama3.1-8b", "--lora-rank", "16", "--base-format", "bf16"]
    code, out, _ = run_main(capsys, "plan", *shape, *box, "--micro-batch", "4")
    assert code == 0 and ", checkpointing full" in out and "--checkpointing full" in out
    free = dataclasses.replace(lora_run("llama3.1-8b", "bf16", 4, "off").adapter,
                               checkpointing_planned=True)  # fmt: skip
    placed, _ = plan_base(dataclasses.replace(lora_run("llama3.1-8b", "bf16", 4, "off"),
                                              adapter=free), gpu(80, 512))  # fmt: skip
    assert placed.engine.checkpointing == "full"
    code, out, _ = run_main(capsys, "plan", *shape, *box, "--micro-batch", "1")
    assert code == 0 and "--checkpointing off" in out and "checkpointing full" not in out
    code, err = run_in_process(capsys, "plan", *shape, *box, "--micro-batch", "4",
                               "--checkpointing", "off")  # fmt: skip
    assert_refused(code, err, "--lora-rank 16", "--checkpointing full fits")


def test_long_rows_keep_their_block_inputs_in_host_ram_and_the_plan_pays_for_them():
    """A 70B NF4 base on 80 GB: at 40,960 tokens no recompute kept on the GPU fits, so the
    planner (--checkpointing not given) keeps the block inputs in pinned host RAM, and prices
    them there: one per block but the first (the frozen embedding's output needs no gradient:
    it stays on the GPU), rounded to a power of two as the pinned cache rounds them (79 x 1 GiB
    at 65,536 tokens). Where host RAM cannot hold them it refuses in one line, and
    a typed --checkpointing cpu is priced the same."""
    box = Hardware(
        "cuda", 1, 80 * 10**9, "a GPU", 115 * 10**9, 16
    )  # --gpu-mem 80GB --cpu-mem 115GB
    for seq, planned in ((40960, True), (65536, True), (65536, False)):
        run = lora_run("llama3.1-70b", "nf4", 1, "cpu" if not planned else "full")
        run = dataclasses.replace(run, model=run.model.replace(seq_len=seq))
        free = dataclasses.replace(run.adapter, checkpointing_planned=planned)
        placed, line = plan_base(dataclasses.replace(run, adapter=free), box)
        assert placed.engine.checkpointing == "cpu" and "checkpointing cpu" in line
        p = price_base(workload_of(run, 1, "cuda"), run.adapter, "nf4", 0, "cpu")
        inputs = p.est.host["checkpointed_inputs"]  # block 0's (no gradient) stays on the GPU
        assert inputs == 79 * 2 ** (seq * 8192 * 2 - 1).bit_length()
        assert p.est.compute["first_block_input"] == seq * 8192 * 2
        assert p.host_bytes >= inputs + HOST_BASE["cuda"]
    assert inputs == 79 * 2**30
    run = lora_run("llama3.1-70b", "nf4", 1, "full")
    run = dataclasses.replace(run, model=run.model.replace(seq_len=69632),
                              adapter=dataclasses.replace(run.adapter, checkpointing_planned=True))  # fmt: skip
    with pytest.raises(UserError) as e:
        plan_base(run, box)
    assert "\n" not in str(e.value) and "--checkpointing cpu need" in str(e.value)
    # ... naming the longest length that fits (a multiple of 1,024: 65,536 plans, as above,
    # and 66,560 does not), the length that trained on an 80 GB GPU (results/qlora70_h200_*)
    assert str(e.value).endswith(
        "; --seq-len 65536 --checkpointing cpu fits (0 blocks in host RAM)"
    )
    with pytest.raises(UserError, match="--seq-len 65536 "):
        plan_base(dataclasses.replace(run, model=run.model.replace(seq_len=66560)), box)


def test_the_priced_base_is_the_bytes_the_engine_holds(llama):
    """The planner's packed blocks, per tier, are the store's bytes (the same codec)."""
    source = find_source(str(llama))
    a = AdapterConfig(lora_rank=4, base_format="nf4", base_host_blocks=2)
    e = build_engine(source.model, EngineConfig(engine="ddp"), PrecisionConfig("fp32"),
                     OptimConfig(), CPU, 3, a)  # fmt: skip
    work = Workload(source.model, MB, 1, "fp32", "cuda")
    est = price_base(work, a, "nf4", 2, "off").est
    held = e.store.held_bytes()
    assert est.compute["frozen_blocks"] == held["device"] > 0
    assert est.host["frozen_blocks_pinned"] == held["host"] > 0


def test_a_packed_base_run_resumes_exactly_and_refusals_name_their_flags(llama, tmp_path, capsys):
    """`fitgpt train --base-format nf4 --base-host-blocks 1`: 4 steps equal 2 and a resume of
    2 (the base packed again from the source, the format the checkpoint's); a bad format, too
    many host blocks, or a LoRA with neither --init-from nor --preset refused in one line."""
    common = ["train", "--init-from", llama, "--data", "synthetic", "--device", "cpu",
              "--lora-rank", "4", "--micro-batch", "2", "--seq-len", str(SEQ), "--steps", "4",
              "--eval-every", "0", "--log-every", "1"]  # fmt: skip
    code, out, _ = run_main(capsys, *common, "--base-format", "nf4", "--base-host-blocks", "1",
                            "--save-every", "2", "--out", tmp_path / "a")  # fmt: skip
    assert code == 0 and "the base in nf4, 2 of its 3 blocks on the device" in out
    plan = next(line for line in out.splitlines() if line.startswith("LoRA: the base"))
    assert float(plan.split(", predicted ")[1].removesuffix(" s/step")) > 0  # train says it
    code, again, _ = run_main(capsys, "train", "--resume", tmp_path / "a" / "step_00000002",
                              "--out", tmp_path / "b")  # fmt: skip
    assert code == 0 and "the base in nf4" in again
    assert losses(out)[-2:] == losses(again)[-2:]
    code, err = run_in_process(capsys, *common, "--base-format", "nf2", "--out", tmp_path / "c")
    assert_refused(code, err, "--base-format", "nf4")
    code, err = run_in_process(capsys, *common, "--base-host-blocks", "9", "--out", tmp_path / "d")
    assert_refused(code, err, "--base-host-blocks 9", "3 blocks")
    code, err = run_in_process(capsys, "train", "--lora-rank", "4", "--data", "synthetic",
                               "--out", tmp_path / "e")  # fmt: skip
    assert_refused(code, err, "--init-from", "--preset")


def losses(out: str) -> list[str]:
    return [line.split("| loss ")[1].split()[0] for line in out.splitlines() if "| loss " in line]


def test_plan_says_the_base_placement_train_makes(capsys):
    """`fitgpt plan --lora-rank R`: plan_base's placement for the box the flags describe (the
    405B shape on 4 x 139 GiB, 470 GB host: int8 sharded, some blocks streamed), the train flags
    that ask for it, and with --breakdown the bytes per rank on each tier; what fits nowhere
    (bf16 there, no disk) is refused in one line naming the format that fits."""
    from fitgpt.plan.hardware import detect

    box = ["--gpus", "4", "--gpu-mem", "139GiB", "--cpu-mem", "470GB", "--device", "cuda"]
    shape = ["--preset", "llama3.1-405b", "--lora-rank", "16", "--checkpointing", "full",
             "--micro-batch", "1"]  # fmt: skip
    code, out, _ = run_main(capsys, "plan", *shape, *box, "--base-format", "int8", "--breakdown")
    assert code == 0
    run = lora_run("llama3.1-405b", "int8", 1, "full")
    # --keep-activations not given: the planner keeps what fits, as train's assembly lets it
    run = dataclasses.replace(run, adapter=dataclasses.replace(run.adapter, keep_planned=True))
    hw = detect(4, "139GiB", "470GB", None, "cuda")
    placed, line = plan_base(run, hw)
    a, k = placed.adapter, placed.engine.keep_activations
    assert line in out and "405.85 B parameters" in out
    assert 0 < a.base_host_blocks < 126 and a.base_sharded
    assert (f"as train flags: --base-format int8 --base-host-blocks {a.base_host_blocks} "
            f"--base-sharded --checkpointing full --keep-activations {k}") in out  # fmt: skip
    est = price_base(workload_of(run, 4, "cuda"), a, "int8", a.base_host_blocks, "full",
                     shards=4, keep=k).est  # fmt: skip
    for tier, items in (("GPU", est.compute), ("host", est.host)):
        assert f"{tier} per rank: " in out
        pinned = f"{items.get('frozen_blocks', items.get('frozen_blocks_pinned')) / 2**30:.2f} GiB"
        assert pinned in out
    code, err = run_in_process(capsys, "plan", *shape, *box, "--base-format", "bf16")
    assert_refused(code, err, "--lora-rank 16", "bf16", "--base-format int8")


def test_a_preset_s_random_base_trains_in_its_tiers_and_exports_for_peft(tmp_path, capsys):
    """What benchmarks/multi_gpu/lora_x4.sh runs at 405 B, at 2 blocks of width 64: a LoRA on a
    preset's random base (no --init-from) in int8, its last block streamed from host RAM, then
    `fitgpt export --format peft`: the folder holds an A and a B for every adapted linear of
    every block, of rank 16, named as PEFT names them, and says it has no base."""
    from safetensors import safe_open

    small = ["--preset", "llama3.1-405b", "--layers", "2", "--hidden", "64", "--heads", "8",
             "--ffn-hidden", "128", "--vocab-size", "256", "--seq-len", "32"]  # fmt: skip
    code, out, _ = run_main(capsys, "train", *small, "--lora-rank", "16", "--base-format", "int8",
                            "--base-host-blocks", "1", "--checkpointing", "full", "--data",
                            "synthetic", "--micro-batch", "2", "--steps", "2", "--eval-every", "0",
                            "--log-every", "1", "--out", tmp_path / "run")  # fmt: skip
    assert code == 0 and "the base in int8, 1 of its 2 blocks" in out
    assert "randomly initialised base" in out and len(losses(out)) == 2
    code, out, _ = run_main(capsys, "export", "--ckpt", tmp_path / "run", "--format", "peft",
                            "--out", tmp_path / "peft")  # fmt: skip
    assert code == 0 and "a random base (--preset without --init-from" in out
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["r"] == 16 and cfg["base_model_name_or_path"] is None
    with safe_open(tmp_path / "peft" / "adapter_model.safetensors", "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert len(shapes) == 2 * 2 * len(names)
    for i in range(2):
        for n in names:
            part = "self_attn" if n[0] in "qkvo" else "mlp"
            stem = f"base_model.model.model.layers.{i}.{part}.{n}"
            assert shapes[f"{stem}.lora_A.weight"][0] == 16
            assert shapes[f"{stem}.lora_B.weight"][1] == 16


def test_capacity_covers_lora(capsys):
    """`fitgpt capacity --lora-rank R`: the largest layer count whose LoRA run the planner fits
    (one more does not); on a GPU NF4 fits more layers than bf16, and bf16 more than its
    blocks alone would (the rest streamed from host RAM)."""
    from fitgpt.bench.config import BenchConfig
    from fitgpt.bench.systems import bench_run

    code, out, _ = run_main(capsys, "capacity", "--device", "cpu", "--lora-rank", "8",
                            "--hidden", "64", "--heads", "4", "--micro-batch", "2",
                            "--seq-len", "64", "--vocab-size", "512", "--cap", "20MB")  # fmt: skip
    assert code == 0
    found = json.loads(out.strip().splitlines()[-1])
    bench = BenchConfig(hidden=64, heads=4, micro_batch=2, seq_len=64, vocab_size=512)
    hw = Hardware("cpu", 1, 0, "", 20 * 10**6 + HOST_BASE["cpu"], 2)

    def run_at(layers):
        run = bench_run(bench.model(layers), bench, "fp32", "cpu")
        engine = dataclasses.replace(run.engine, checkpointing=bench.checkpointing)
        return dataclasses.replace(run, engine=engine, adapter=AdapterConfig(lora_rank=8))

    plan_base(run_at(found["layers"]), hw)
    with pytest.raises(UserError):
        plan_base(run_at(found["layers"] + 1), hw)
    big = BenchConfig(hidden=2048, heads=16, micro_batch=1, seq_len=1024, vocab_size=8192)

    def gpu_run(fmt):
        def run_at(n):
            run = bench_run(big.model(n), big, "bf16", "cuda")
            engine = dataclasses.replace(run.engine, checkpointing="full")
            adapter = AdapterConfig(lora_rank=16, base_format=fmt)
            return dataclasses.replace(run, engine=engine, adapter=adapter)

        return run_at

    nf4, _ = largest_lora(gpu_run("nf4"), gpu(4, 4))
    bf16, line = largest_lora(gpu_run("bf16"), gpu(4, 4))
    assert nf4 > bf16 > 4 * 2**30 / (2 * big.model(1).num_params()) and "streamed" in line


def test_a_base_on_the_disk_tier_trains_as_the_ddp_engine_s(llama, tmp_path, monkeypatch):
    """Blocks in files under --nvme-path, read ahead into a ring of staging buffers (two here,
    so they cycle and every step reads): the plain engine's losses bit for bit; the files are
    gone after close()."""
    monkeypatch.setattr(DiskBlocks, "RING", 2)
    ref, _ = trained(llama, base_format="fp32")
    source = find_source(str(llama))
    a = AdapterConfig(lora_rank=4, base_format="fp32", base_host_blocks=3, base_disk_blocks=3)
    e = build_engine(source.model, EngineConfig(engine="ddp", nvme_path=str(tmp_path)),
                     PrecisionConfig("fp32"), OptimConfig(grad_clip=1.0), CPU, 3, a)  # fmt: skip
    load_source(source, e, source.model, CPU)
    assert [e.train_step([b], 2e-3).loss for b in data()] == ref
    io = e.store.disk.store.stats()
    assert e.memory_report()["nvme"]["frozen_weights"] == e.store.held_bytes()["disk"] > 0
    # the ring cycles: blocks are read again, step after step (more than two whole passes)
    assert io["bytes_read"] > 2 * e.store.held_bytes()["disk"]
    e.close()
    assert not any(tmp_path.iterdir())


def test_the_planner_puts_blocks_on_the_disk_when_host_ram_is_short():
    """With --nvme-path, a bf16 70B-shaped base whose streamed blocks overflow host RAM puts
    the last of them on the disk (the fewest); without it the run is refused; disk blocks
    without --nvme-path are refused in one line."""
    run = lora_run("llama3.1-70b", "bf16", 1, "full")
    short = dataclasses.replace(gpu(80, 64), nvme_path="/nvme", nvme_free=2**40)
    placed, line = plan_base(run, short)
    a = placed.adapter
    assert 0 < a.base_disk_blocks <= a.base_host_blocks and "from the disk" in line
    work = workload_of(run, 1, "cuda")
    fewer = price_base(
        work, run.adapter, "bf16", a.base_host_blocks, "full", a.base_disk_blocks - 1
    )
    assert not fewer.fits(short)
    with pytest.raises(UserError):
        plan_base(run, gpu(80, 64))
    asked = dataclasses.replace(run, adapter=dataclasses.replace(
        run.adapter, base_host_blocks=10, base_disk_blocks=2))  # fmt: skip
    with pytest.raises(UserError, match=r"--base-disk-blocks 2: .*--nvme-path"):
        plan_base(asked, gpu(80, 512))


def _sharded_worker(rank: int, world: int, folder: str, tmp: str) -> None:
    """One gloo rank of test_a_sharded_base_...: half the batch, the base's bytes cut in two."""
    from fitgpt.dist.context import init_distributed

    ctx = init_distributed("cpu")
    source = find_source(folder)
    a = AdapterConfig(lora_rank=4, base_format="nf4", base_host_blocks=1, base_sharded=True)
    e = build_engine(source.model, EngineConfig(engine="ddp"), PrecisionConfig("fp32"),
                     OptimConfig(grad_clip=1.0), ctx, 3, a)  # fmt: skip
    load_source(source, e, source.model, ctx)
    half = [(x[rank::world], y[rank::world]) for x, y in data()]
    losses = [e.train_step([b], 2e-3).loss for b in half]
    shards = [c.weight_shard.numel() for c in e.store.chunks]
    out = {"loss": losses, "shards": shards, "whole": [c.N for c in e.store.chunks],
           "adapters": {n: t.tolist() for n, t in adapters_of(e).items()}}  # fmt: skip
    (Path(tmp) / f"r{rank}.json").write_text(json.dumps(out))


@pytest.mark.slow
def test_a_sharded_base_on_two_gloo_ranks_equals_one_process(llama, tmp_path, gloo):
    """--base-sharded: each rank holds half of every block's NF4 bytes (one block streamed
    from host RAM, its half pinned) and all-gathers a block as it runs; two ranks on half the
    batch each give the one process's losses and adapters."""
    one, e = trained(llama, base_format="nf4", base_host_blocks=1)
    gloo(2, _sharded_worker, str(llama), str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2))
    assert all(2 * s == n for s, n in zip(r0["shards"], r0["whole"]))
    assert close(r0["loss"], one, 1e-6) and r0["adapters"] == r1["adapters"]
    for n, t in adapters_of(e).items():
        assert torch.allclose(torch.tensor(r0["adapters"][n]), t, atol=1e-6), n


def test_plan_lora_on_a_machine_without_a_gpu_says_whose_answer_it_is(capsys):
    """`fitgpt plan --lora-rank` on the CPU, no --gpu-mem: the line says the plan is this CPU's
    (with the flags that plan for a GPU box), also in a refusal, which names no GPU memory."""
    code, out, _ = run_main(capsys, "plan", "--preset", "tiny-llama", "--lora-rank", "4")
    assert code == 0 and "planned for this machine's CPU" in out
    code, err = run_in_process(capsys, "plan", "--preset", "llama3.1-8b", "--lora-rank", "16",
                               "--cpu-mem", "4GB")  # fmt: skip
    line = assert_refused(code, err, "--lora-rank 16", "planned for this machine's CPU")
    assert "a GPU" not in line.split("(planned")[0]
