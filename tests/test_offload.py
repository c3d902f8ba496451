"""The host tier: every placement trains like the all-on-device engine; resume across placements."""

import re
import shutil

import pytest
import torch
from helpers import TINY, run_config, train

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.errors import UserError

CPU = DistContext(0, 1, 0, torch.device("cpu"))
MODEL = TINY.replace(n_layer=4)


def losses(steps: int = 20, **engine) -> list[float]:
    e = build_engine(
        MODEL, EngineConfig(engine="zero", **engine), PrecisionConfig("fp32"), OptimConfig(), CPU
    )
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        # a quarter of the vocabulary: something to learn (uniform tokens over the whole
        # vocabulary start at the best loss there is, ln V, since padded rows get no probability)
        x = torch.randint(0, MODEL.vocab_size // 4, (4, MODEL.seq_len + 1), generator=g)
        out.append(e.train_step([(x[:2, :-1], x[:2, 1:]), (x[2:, :-1], x[2:, 1:])], 3e-3).loss)
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("blocks", [1, 2, 4])  # of MODEL's 4
def test_every_placement_trains_like_all_on_device(stage, blocks):
    ref = losses(zero_stage=stage)
    got = losses(zero_stage=stage, offload_optimizer="cpu", offload_blocks=blocks)
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-6


def test_placement_puts_the_last_blocks_on_the_host():
    e = build_engine(
        MODEL,
        EngineConfig(engine="zero", offload_optimizer="cpu", offload_blocks=2),
        PrecisionConfig("fp32"),
        OptimConfig(),
        CPU,
    )
    assert [c.spec.name for c in e.hosted] == ["block.2", "block.3"]
    assert all(c.master.device.type == "cpu" and c.offloaded for c in e.hosted)
    assert "host" in e.memory_report() and e.memory_report()["host"]["optimizer"] > 0


def test_resume_across_placements(tmp_path):
    cfg = run_config(
        tmp_path,
        steps=12,
        save_every=6,
        n_layer=4,
        engine="zero",
        offload_optimizer="cpu",
        offload_blocks=2,
    )
    full = train(cfg, CPU)
    shutil.rmtree(tmp_path / "step_00000012")
    # saved with half the blocks' optimizer on the host; resumed with everything on the device
    resumed = train(run_config(tmp_path, steps=12, n_layer=4, engine="zero"), CPU, resume="")
    assert max(abs(a - b) for a, b in zip(resumed["losses"], full["losses"][6:])) < 1e-6


@pytest.mark.parametrize(
    "change,match",
    [
        ({"offload_params": "nvme", "offload_optimizer": "cpu"}, "weights stream from host RAM"),
        ({"offload_params": "cpu"}, "add --offload-optimizer cpu"),
    ],
)
def test_tier_flags_that_cannot_work_are_refused_in_one_line(change, match):
    with pytest.raises(UserError, match=match):
        EngineConfig(engine="zero", **change)


# ---- parameter streaming: the offloaded blocks' weights in host RAM ----------------------------
@pytest.mark.parametrize("stage,blocks", [(0, 2), (0, 4), (2, 2), (3, 4)])
def test_streamed_weights_train_like_all_on_device(stage, blocks):
    ref = losses(zero_stage=stage)
    got = losses(
        zero_stage=stage, offload_optimizer="cpu", offload_params="cpu", offload_blocks=blocks
    )
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-6


def test_streamed_weights_with_the_nvme_tier_train_like_all_on_device(tmp_path):
    ref = losses()
    got = losses(offload_params="cpu", **nvme(tmp_path, 3, 1))
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-6


def test_streamed_weights_live_on_the_host_and_the_model_predicts_them():
    from fitgpt.plan.memory import Workload, zero_state

    ecfg = EngineConfig(
        engine="zero", offload_optimizer="cpu", offload_params="cpu", offload_blocks=2
    )
    e = build_engine(MODEL, ecfg, PrecisionConfig("fp32"), OptimConfig(), CPU)
    x = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1))
    e.train_step([(x[:, :-1], x[:, 1:])], 1e-3)
    streamed = [c.spec.name for c in e.chunks if c.streamed]
    assert streamed == ["block.2", "block.3"]
    assert all(not c.resident for c in e.chunks if c.streamed)  # freed after their backward
    rep = e.memory_report()
    pred = zero_state(Workload(MODEL, 2, 1, "fp32"), ecfg)
    assert (
        rep["host"]["weights"]
        == pred["host"]["weights"]
        == 4 * sum(c.N for c in e.chunks if c.streamed)
    )
    assert rep["cpu"]["weights"] == pred["device"]["weights"]  # streamed weights not counted
    model = e.inference_model()  # streamed blocks are brought in for a full copy
    params, c = dict(model.named_parameters()), e.chunks[4]
    for slot in c.spec.slots:
        host = c.weight_shard[slot.offset : slot.offset + slot.numel].view(slot.shape)
        assert torch.equal(params[slot.name], host)


def test_resume_from_streamed_weights_into_resident_ones(tmp_path):
    kw = dict(n_layer=4, engine="zero", offload_optimizer="cpu", offload_blocks=2)
    full = train(run_config(tmp_path, steps=12, save_every=6, **kw, offload_params="cpu"), CPU)
    shutil.rmtree(tmp_path / "step_00000012")
    resumed = train(run_config(tmp_path, steps=12, **kw), CPU, resume="")
    assert max(abs(a - b) for a, b in zip(resumed["losses"], full["losses"][6:])) < 1e-6


# ---- the one-step-delayed update, removed: a run saved with it resumes with exact updates ------
SMALL_RUN = [
    "train", "--preset", "tiny", "--layers", "2", "--hidden", "32", "--heads", "2",
    "--seq-len", "16", "--micro-batch", "2", "--device", "cpu", "--data", "synthetic",
    "--vocab-size", "64", "--plan", "off", "--engine", "zero", "--offload-optimizer", "cpu",
    "--eval-every", "0", "--log-every", "1",
]  # fmt: skip


def cli_train(*args: str) -> None:
    from fitgpt.cli import main

    with pytest.raises(SystemExit) as done:
        main(list(args))
    assert done.value.code in (0, None)


@pytest.mark.parametrize("delayed", [True, False])
def test_a_checkpoint_saved_with_the_delayed_update_fields_resumes_exactly(
    tmp_path, capsys, delayed
):
    """fitgpt before the removal saved delayed_update and delayed_update_after in every
    checkpoint's engine config: such a checkpoint resumes, the fields dropped, and a run that had
    the delay on goes on with exact updates, saying so in one line."""
    from fitgpt.train import checkpoint as ckpt_io

    run = tmp_path / "run"
    cli_train(*SMALL_RUN, "--steps", "4", "--save-every", "2", "--out", str(run))
    first = capsys.readouterr().out
    shutil.rmtree(run / "step_00000004")
    # the saved config as the older fitgpt wrote it; meta.json re-sealed (its checksum)
    ckpt = run / "step_00000002"
    meta = ckpt_io.verify(ckpt)
    meta["config"]["engine"].update(delayed_update=delayed, delayed_update_after=40)
    sealed = ("format", "version", "files", "file_sha256", "checksum")
    ckpt_io.write_meta(ckpt, {k: v for k, v in meta.items() if k not in sealed})
    assert ckpt_io.verify(ckpt)["config"]["engine"]["delayed_update"] is delayed

    cli_train("train", "--out", str(run), "--resume", "--plan", "off")  # the host tier kept
    again = capsys.readouterr().out
    assert "the optimizer state of the last 2 of 2 blocks on the host" in again
    notes = [ln for ln in again.splitlines() if "--delayed-update" in ln]
    assert len(notes) == (1 if delayed else 0), again
    if delayed:
        assert "was removed" in notes[0] and "exact updates" in notes[0] and str(ckpt) in notes[0]

    def losses(out: str) -> dict[str, str]:
        return dict(re.findall(r"^step +(\d+) \| loss (\S+)", out, re.M))

    # exact updates, as the first run's: steps 3-4 again to the printed digit
    assert sorted(losses(again)) == ["3", "4"]
    assert all(losses(again)[s] == losses(first)[s] for s in ("3", "4"))
    assert "delayed_update" not in ckpt_io.verify(run / "step_00000004")["config"]["engine"]


def test_a_placement_larger_than_the_free_host_ram_is_refused_before_allocating():
    from fitgpt.engine.chunked.accounting import check_host_room
    from fitgpt.engine.chunked.placement import Placement
    from fitgpt.engine.layout import chunk_layout
    from fitgpt.model import GPT
    from fitgpt.plan.hardware import host_available

    # 40 layers of hidden 8192: ~32 B parameters, ~390 GB of host state: more than this machine
    big = MODEL.replace(n_layer=40, n_embd=8192, n_head=64, vocab_size=50304)
    with torch.device("meta"):
        layout = chunk_layout(GPT(big))
    every_block = Placement.of(layout, EngineConfig(offload_optimizer="cpu"), 1, 2)
    need = every_block.host_bytes()
    assert need > host_available() > 0
    with pytest.raises(UserError, match=r"host RAM per rank .*\(short by"):
        check_host_room(every_block, torch.device("cuda"))
    # the same placement for a model that fits passes, and nothing offloaded needs nothing
    with torch.device("meta"):
        small = chunk_layout(GPT(MODEL))
    check_host_room(
        Placement.of(small, EngineConfig(offload_optimizer="cpu"), 1, 2), torch.device("cuda")
    )
    assert Placement.of(layout, EngineConfig(), 1, 2).host_bytes() == 0
    # RAM the user stated (--cpu-mem, EngineConfig.cpu_mem) is what the check holds it against
    stated = EngineConfig(offload_optimizer="cpu", cpu_mem=2 * need)
    check_host_room(Placement.of(layout, stated, 1, 2), torch.device("cuda"))
    tight = EngineConfig(offload_optimizer="cpu", cpu_mem=1)
    with pytest.raises(UserError, match=r"but 0.0 GiB can be used"):
        check_host_room(Placement.of(small, tight, 1, 2), torch.device("cuda"))


def _room_verdicts(rank: int, world: int) -> None:
    import torch.distributed as dist

    from fitgpt.engine.chunked.accounting import refuse_unless_room

    gib, group = 1 << 30, dist.group.WORLD
    # rank 1 read MemAvailable after its peer's first allocations: every rank refuses, agreed
    with pytest.raises(UserError, match=r"needs 10.0 GiB .* but 5.0 GiB can be used") as e:
        refuse_unless_room(10 * gib, (20 if rank == 0 else 5) * gib, torch.device("cpu"), group, 2)
    assert e.value.agreed
    # the most any rank needs is what every rank checks
    with pytest.raises(UserError, match=r"needs 30.0 GiB"):
        refuse_unless_room((30 if rank == 1 else 1) * gib, 20 * gib, torch.device("cpu"), group, 2)
    refuse_unless_room(10 * gib, 20 * gib, torch.device("cpu"), group, 2)  # room on both
    refuse_unless_room(10 * gib, 0, torch.device("cpu"), group, 2)  # no rank knows: no refusal


def test_every_rank_agrees_on_the_host_room_verdict(gloo):
    gloo(2, _room_verdicts)


# ---- the nvme tier: optimizer state in files ----------------------------------------------------
def nvme(tmp_path, blocks=None, nvme_blocks=None, **kw) -> dict:
    # nvme_path first: run_config applies fields one at a time, each validated
    return dict(
        nvme_path=str(tmp_path),
        nvme_blocks=nvme_blocks,
        offload_blocks=blocks,
        offload_optimizer="nvme",
        **kw,
    )


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("blocks,nvme_blocks", [(4, 4), (3, 1), (2, 2)])  # of MODEL's 4
def test_every_nvme_placement_trains_like_all_on_device(stage, blocks, nvme_blocks, tmp_path):
    ref = losses(zero_stage=stage)
    got = losses(zero_stage=stage, **nvme(tmp_path, blocks, nvme_blocks))
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-6


def test_nvme_files_are_created_used_and_removed(tmp_path):
    (tmp_path / "keep.txt").write_text("not the engine's")
    e = build_engine(
        MODEL,
        EngineConfig(engine="zero", **nvme(tmp_path, 2)),
        PrecisionConfig("fp32"),
        OptimConfig(),
        CPU,
    )
    assert [c.spec.name for c in e.chunks if c.on_disk] == ["block.2", "block.3"]
    (scratch,) = tmp_path.glob("fitgpt-scratch-*")
    files = sorted(p.name for p in scratch.iterdir())
    assert len(files) == 6  # master and two moments of each disk-homed block
    assert all(not c.state_resident for c in e.chunks if c.on_disk)  # not held in RAM
    x = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1))
    e.train_step([(x[:, :-1], x[:, 1:])], 1e-3)
    e._sync_host()
    b = e.breakdown()
    n = sum(c.master.numel() for c in e.chunks if c.on_disk)
    assert b["nvme_read_gb_total"] * 1e9 >= 12 * n and b["nvme_written_gb_total"] * 1e9 >= 24 * n
    assert e.memory_report()["nvme"]["optimizer"] == 8 * n
    e.host_opt.close()
    assert not scratch.exists() and (tmp_path / "keep.txt").read_text() == "not the engine's"


def test_nvme_scratch_is_removed_when_the_process_exits(tmp_path):
    import subprocess
    import sys

    code = f"""
import torch
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.model import ModelConfig
m = ModelConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16, vocab_size=64)
e = build_engine(m, EngineConfig(engine="zero", offload_optimizer="nvme", nvme_path={str(tmp_path)!r}),
                 PrecisionConfig("fp32"), OptimConfig(), DistContext(0, 1, 0, torch.device("cpu")))
x = torch.randint(0, 64, (2, 17))
e.train_step([(x[:, :-1], x[:, 1:])], 1e-3)
print(len(list(__import__("pathlib").Path({str(tmp_path)!r}).glob("fitgpt-scratch-*/*"))))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.strip()) == 6  # files existed while it ran
    assert list(tmp_path.iterdir()) == []  # and are gone after it exited


def test_a_placement_needing_more_disk_than_free_is_refused_with_the_shortfall(tmp_path):
    big = MODEL.replace(n_layer=40, n_embd=8192, n_head=64, vocab_size=50304)  # ~390 GB of state
    with pytest.raises(UserError, match=r"short by .* GiB"):
        build_engine(
            big,
            EngineConfig(engine="zero", **nvme(tmp_path)),
            PrecisionConfig("fp32"),
            OptimConfig(),
            CPU,
        )
    assert list(tmp_path.iterdir()) == []  # refused before writing anything


def test_resume_across_nvme_and_host_placements(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    cfg = run_config(tmp_path, steps=12, save_every=6, n_layer=4, engine="zero", **nvme(disk, 2))
    full = train(cfg, CPU)
    shutil.rmtree(tmp_path / "step_00000012")
    # saved with half the blocks' optimizer on disk; resumed with it in host RAM
    resumed = train(
        run_config(
            tmp_path,
            steps=12,
            n_layer=4,
            engine="zero",
            offload_optimizer="cpu",
            offload_blocks=3,
        ),
        CPU,
        resume="",
    )
    assert max(abs(a - b) for a, b in zip(resumed["losses"], full["losses"][6:])) < 1e-6


# ---- compressed moments of host-homed chunks -----------------------------------------------------
@pytest.mark.parametrize("kind,tol", [("bf16", 0.02), ("int8", 0.05)])
def test_compressed_host_moments_train_close_to_fp32_moments(kind, tol):
    ref = losses(offload_optimizer="cpu")
    got = losses(offload_optimizer="cpu", moments=kind)
    assert got[0] == ref[0]  # the first forward is before any update
    assert max(abs(a - b) for a, b in zip(got, ref)) < tol
    assert got != ref  # the compressed stores were really used
    assert got[0] - got[-1] > 0.8 * (ref[0] - ref[-1])  # and it descends about as far


def test_compressed_moments_hold_fewer_bytes_and_the_model_predicts_them():
    from fitgpt.plan.memory import Workload, zero_state

    held = {}
    for kind in ("fp32", "bf16", "int8"):
        ecfg = EngineConfig(engine="zero", offload_optimizer="cpu", offload_blocks=2, moments=kind)
        e = build_engine(MODEL, ecfg, PrecisionConfig("fp32"), OptimConfig(), CPU)
        rep = e.memory_report()["host"]
        pred = zero_state(Workload(MODEL, 2, 1, "fp32"), ecfg)["host"]
        assert {k: v for k, v in rep.items() if v} == {k: v for k, v in pred.items() if v}
        held[kind] = rep["optimizer"]
    # (int8 pads each moment to whole 2048-element blocks: small chunks gain less than 4x)
    assert held["bf16"] * 2 == held["fp32"] and held["int8"] < held["bf16"]


def test_resume_from_int8_moments_into_fp32_moments(tmp_path):
    kw = dict(n_layer=4, engine="zero", offload_optimizer="cpu", offload_blocks=2)
    full = train(run_config(tmp_path, steps=12, save_every=6, moments="int8", **kw), CPU)
    shutil.rmtree(tmp_path / "step_00000012")
    resumed = train(run_config(tmp_path, steps=12, **kw), CPU, resume="")
    # the checkpoint holds the decoded moments in fp32: the resumed run continues the same curve
    assert max(abs(a - b) for a, b in zip(resumed["losses"], full["losses"][6:])) < 0.05


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoints_in_host_memory_train_like_full_checkpointing(stage):
    ref = losses(zero_stage=stage, checkpointing="full")
    got = losses(zero_stage=stage, checkpointing="cpu", offload_optimizer="cpu")
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-6


def test_close_releases_the_engine_and_its_memory():
    import gc
    import weakref

    e = build_engine(
        MODEL,
        EngineConfig(engine="zero", offload_optimizer="cpu", offload_params="cpu"),
        PrecisionConfig("fp32"),
        OptimConfig(),
        CPU,
    )
    x = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1))
    e.train_step([(x[:, :-1], x[:, 1:])], 1e-3)
    engine, chunk = weakref.ref(e), weakref.ref(e.chunks[1])
    e.close()
    del e
    gc.collect()
    assert engine() is None and chunk() is None  # nothing (hooks included) keeps it alive


def test_a_host_worker_that_dies_fails_the_step_instead_of_hanging(monkeypatch):
    """Found on the H100: the host optimizer's worker thread died as it started (it selected
    its GPU by a device without an index, which torch refuses), and the next forward waited for
    its chunk's update for ever. A worker that is gone now fails the step with its error. (The
    death is injected here: a CPU run's worker has no GPU to select.)"""
    import threading

    from fitgpt.engine.chunked import offload

    def dies(self):
        raise ValueError("Expected a torch.device with a specified index")

    monkeypatch.setattr(offload.HostOptimizer, "_serve", dies)
    e = build_engine(
        MODEL,
        EngineConfig(engine="zero", offload_optimizer="cpu", offload_blocks=2),
        PrecisionConfig("fp32"),
        OptimConfig(),
        CPU,
    )
    x = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1))
    raised: list[BaseException] = []

    def steps() -> None:
        try:
            for _ in range(2):  # the second forward waits for the first step's updates
                e.train_step([(x[:, :-1], x[:, 1:])], 1e-3)
        except RuntimeError as err:
            raised.append(err)

    t = threading.Thread(target=steps, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the step hangs on a dead worker"
    assert raised and "host optimizer failed" in str(raised[0])
    assert "specified index" in str(raised[0].__cause__)
    e.close()
