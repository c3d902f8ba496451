"""Checkpoints: their size from the layout, the free-space check, failed saves, weights-only
checkpoints, resuming with none yet, metrics written once per step, the divergence guard."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from cli_refusal import run_main
from helpers import TINY, assembled, run_config, train

from fitgpt.dist import DistContext
from fitgpt.engine.state_io import KINDS
from fitgpt.errors import UserError
from fitgpt.infer.generate import load_model
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train import space
from fitgpt.train.loop import Trainer

CPU = DistContext(0, 1, 0, torch.device("cpu"))
TINY_ARGS = [
    *("--data", "synthetic", "--layers", "2", "--hidden", "32", "--heads", "4"),
    *("--seq-len", "32", "--vocab-size", "96", "--micro-batch", "2", "--eval-every", "0"),
    *("--device", "cpu", "--plan", "off", "--engine", "zero", "--zero-stage", "1"),
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def fitgpt(*argv, env=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "fitgpt", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**ENV, **(env or {})},
    )


def folder_bytes(p):
    return sum(f.stat().st_size for f in p.iterdir())


def strict_lines(path):
    def refuse(c):
        raise ValueError(f"non-standard JSON constant {c}")

    return [json.loads(x, parse_constant=refuse) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("engine, mode", [("ddp", "full"), ("zero", "full"), ("zero", "none")])
def test_checkpoint_size_from_the_layout_matches_the_files(tmp_path, engine, mode):
    cfg = run_config(tmp_path, steps=1, engine=engine, save_optimizer=mode)
    train(cfg, CPU)
    actual = folder_bytes(tmp_path / "step_00000001")
    estimate = Trainer(assembled(cfg, CPU)).checkpoints.size.of(mode == "full")
    assert actual <= estimate <= actual + 2048, (actual, estimate)
    # every state file exactly, from the layout alone
    index = json.loads((tmp_path / "step_00000001" / "index-r000.json").read_text())
    kinds = KINDS if mode == "full" else KINDS[:1]
    for e in index:
        assert e["bytes"] == space.safetensors_bytes(e["lo"], e["hi"], kinds), e


def test_sharded_files_and_saves_and_copies_are_counted_as_written():
    # 2 ranks, shards of 128-element multiples cut to the unpadded length
    assert space.writer_ranges(300, 2, True) == [(0, 0, 256), (1, 256, 300)]
    assert space.writer_ranges(100, 2, True) == [(0, 0, 100)]
    assert space.writer_ranges(300, 2, False) == [(0, 0, 300)]
    assert space.saves_in_run(0, 10, 0) == 1
    assert space.saves_in_run(0, 10, 5) == 2  # 5 and 10
    assert space.saves_in_run(0, 12, 5) == 3  # 5, 10 and the last
    assert space.saves_in_run(6, 12, 6) == 1
    assert space.saves_in_run(12, 12, 6) == 0
    assert space.copies_to_add(existing=0, saves=10, keep=3) == 4  # 3 kept + 1 being written
    assert space.copies_to_add(existing=0, saves=1, keep=3) == 1
    assert space.copies_to_add(existing=2, saves=10, keep=3) == 2
    assert space.copies_to_add(existing=5, saves=2, keep=3) == 1
    assert space.copies_to_add(existing=5, saves=0, keep=3) == 0


def test_a_run_whose_checkpoints_cannot_fit_is_refused_before_step_1(tmp_path, monkeypatch):
    cfg = run_config(tmp_path, steps=10, save_every=2, keep=3)
    size = Trainer(assembled(cfg, CPU)).checkpoints.size
    # room for 2 full checkpoints, the run needs 4 at once (3 kept + 1 being written)
    monkeypatch.setenv(space.FAKE_FREE_ENV, str(2 * size.full + 10))
    with pytest.raises(UserError) as e:
        train(cfg, CPU)
    msg = str(e.value)
    assert "\n" not in msg
    for needle in ("one checkpoint of this run is", "needs", "free", "--save-optimizer none"):
        assert needle in msg, msg
    assert "--keep 1" in msg and "--save-every 0" in msg and "--no-save" in msg and "--out" in msg
    assert not ckpt_io.step_dirs(tmp_path) and not (tmp_path / "metrics.jsonl").exists()
    # each option the message names is accepted
    train(run_config(tmp_path, steps=4, save_every=2, keep=1), CPU)
    shutil.rmtree(tmp_path)
    train(run_config(tmp_path, steps=10, save_every=2, save_optimizer="none"), CPU)
    monkeypatch.setenv(space.FAKE_FREE_ENV, "1000")
    train(run_config(tmp_path / "b", steps=2, save=False), CPU)


def test_a_save_that_fails_removes_its_folder_and_keeps_the_earlier_ones(tmp_path, monkeypatch):
    for kind, needle in [
        ("enospc", "the disk is full"),
        ("eio", "Input/output error"),
        ("error", "RuntimeError"),
    ]:
        out = tmp_path / kind
        monkeypatch.setenv(ckpt_io.FAULT_ENV, f"0:4:{kind}")
        with pytest.raises(ckpt_io.SaveFailed) as e:
            train(run_config(out, steps=6, save_every=2), CPU)
        msg = str(e.value)
        assert "\n" not in msg and needle in msg and "needs" in msg and " free" in msg, msg
        assert "step_00000002" in msg  # the earlier checkpoint, named
        assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
        assert [p.name for p in ckpt_io.step_dirs(out)] == ["step_00000002"]
        ckpt_io.verify(out / "step_00000002")
    # and through the command: one line, no traceback, exit 2
    r = fitgpt(
        "train",
        *TINY_ARGS,
        *("--steps", "4", "--save-every", "2", "--out", str(tmp_path / "cli")),
        env={ckpt_io.FAULT_ENV: "0:4:enospc"},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "the disk is full" in r.stderr
    assert [p.name for p in ckpt_io.step_dirs(tmp_path / "cli")] == ["step_00000002"]


def test_killed_saves_leave_nothing_once_the_next_run_starts(tmp_path):
    train(run_config(tmp_path, steps=2), CPU)
    (tmp_path / ".step_00000004.tmp").mkdir()  # a save killed mid-way
    (tmp_path / ".step_00000004.tmp" / "c0000-r000.safetensors").write_bytes(b"x" * 100)
    os.replace(tmp_path / "step_00000002", tmp_path / ".step_00000002.old")  # killed mid-swap
    train(run_config(tmp_path, steps=3), CPU, resume="")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["metrics.jsonl", "step_00000002", "step_00000003"], names


def weights(e):
    return {n: p.detach().clone() for n, p in e.inference_model().named_parameters()}


@pytest.mark.parametrize("engine", ["ddp", "zero"])
def test_weights_only_checkpoints_generate_export_and_resume_fresh(tmp_path, engine, capsys):
    cfg = run_config(tmp_path, steps=4, save_every=2, engine=engine, save_optimizer="none")
    train(cfg, CPU)
    ckpt = tmp_path / "step_00000004"
    meta = ckpt_io.verify(ckpt)
    assert meta["optimizer_state"] is False
    for e in json.loads((ckpt / "index-r000.json").read_text()):
        assert list(e["crc"]) == ["master"]
    full_dir = tmp_path / "full"
    train(run_config(full_dir, steps=4, engine=engine), CPU)
    assert ckpt_io.verify(full_dir / "step_00000004")["optimizer_state"] is True
    # generate reads the same weights from both kinds
    model, _ = load_model(ckpt, torch.device("cpu"))
    ref, _ = load_model(full_dir / "step_00000004", torch.device("cpu"))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=n)
    # resume: weights loaded, optimizer fresh, steps and data position continued
    capsys.readouterr()
    trainer = Trainer(assembled(run_config(tmp_path, steps=6, engine=engine), CPU))
    trainer.resume(ckpt)
    assert (
        "optimizer state starts fresh: the checkpoint holds weights only" in capsys.readouterr().out
    )
    assert trainer.step == 4 and trainer.loader.state_dict() == meta["trainer"]["data"]
    assert trainer.engine.extra_state()["optimizer_step"] == 0
    for (n, p), q in zip(weights(trainer.engine).items(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=n)
    out = trainer.fit()
    assert len(out["losses"]) == 2 and all(x == x for x in out["losses"])
    trainer.engine.close()


def test_export_reads_a_weights_only_checkpoint(tmp_path, capsys):
    from cli_refusal import run_main  # the command's path in this process: its file is the test

    train(run_config(tmp_path / "run", steps=2, save_optimizer="none"), CPU)
    code, _, err = run_main(
        capsys, "export", "--ckpt", tmp_path / "run", "--out", tmp_path / "m.safetensors"
    )
    assert code == 0, err
    from safetensors.torch import load_file

    from fitgpt.model import GPT

    GPT(TINY).load_state_dict(load_file(tmp_path / "m.safetensors"))


def test_resume_with_no_checkpoint_yet_starts_fresh(tmp_path, capsys):
    out = train(run_config(tmp_path, steps=3), CPU, resume="")
    assert "holds no checkpoint yet; starting at step 0" in capsys.readouterr().out
    assert len(out["losses"]) == 3
    with pytest.raises(UserError, match="holds no checkpoint"):  # a path that is not --out
        train(run_config(tmp_path / "b", steps=3), CPU, resume=str(tmp_path / "c"))


def test_re_run_steps_are_logged_once(tmp_path):
    cfg = run_config(tmp_path, steps=12, save_every=6, log_every=2, eval_every=4, eval_batches=1)
    train(cfg, CPU)
    shutil.rmtree(tmp_path / "step_00000012")  # as if the run died after step 6's checkpoint
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 1')  # and left a half-written line
    train(cfg, CPU, resume="")
    lines = strict_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines if r["kind"] == "train"] == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in lines if r["kind"] == "eval"] == [4, 8, 12]
    last = [r for r in lines if r["kind"] == "train"][-1]  # progress: elapsed and left
    assert last["eta_s"] == 0 and last["elapsed_s"] > 0


def test_a_diverged_run_stops_in_one_line_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    # lr 1000 reached over a long warm-up: some good steps, then the loss blows up
    args = [*TINY_ARGS, "--lr", "1000", "--min-lr", "0", "--warmup", "1000", "--steps", "80"]
    args += ["--save-every", "2", "--keep", "2", "--max-bad-steps", "4", "--log-every", "1"]
    code, _, err = run_main(capsys, "train", *args, "--out", str(tmp_path))  # its files: the test
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and "training diverged" in err
    lines = strict_lines(tmp_path / "metrics.jsonl")  # NaN/inf written as null
    bad = {x["step"] for x in lines if x["loss"] is None or x["grad_norm"] is None}
    last = lines[-1]["step"]
    start = last - 3  # the streak of 4 that stopped the run
    assert last < 80 and set(range(start, last + 1)) <= bad and start - 1 not in bad
    # nothing saved from the bad steps, nor the checkpoint whose weights gave the first one
    kept = [int(p.name[5:]) for p in ckpt_io.step_dirs(tmp_path)]
    assert start > 4 and kept and max(kept) <= start - 2, (bad, kept)
    last_good = tmp_path / f"step_{max(kept):08d}"
    assert f"the last good checkpoint is {last_good}" in err
    ckpt_io.verify(last_good)
    if (start - 1) % 2 == 0:  # step start - 1 was saved: set aside, not deleted, not resumed
        assert (tmp_path / f"diverged.step_{start - 1:08d}").is_dir()


def test_a_diverged_step_that_cannot_be_set_aside_is_named(tmp_path, capsys):
    """Where the checkpoint that gave the first bad step cannot be renamed (a file already holds
    its diverged.* name), the run still ends in one line, which names it and says not to resume
    from it; the checkpoint stays where it was."""
    tmp_path.mkdir(exist_ok=True)
    for step in range(1, 41):  # whichever step it is, its diverged.* name is taken by a file
        (tmp_path / f"diverged.step_{step:08d}").write_text("not a folder")
    args = [*TINY_ARGS, "--lr", "1000", "--min-lr", "0", "--warmup", "400", "--steps", "40"]
    args += ["--save-every", "1", "--keep", "2", "--max-bad-steps", "4", "--log-every", "1"]
    code, _, err = run_main(capsys, "train", *args, "--out", str(tmp_path))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    start = strict_lines(tmp_path / "metrics.jsonl")[-1]["step"] - 3  # the streak of 4
    suspect = f"step_{start - 1:08d}"
    assert (
        f"{suspect}, whose weights gave the first bad step, could not be set aside (node 0: " in err
    )
    assert "delete it there, never resume from it" in err
    ckpt_io.verify(tmp_path / suspect)
    kept = [p for p in ckpt_io.step_dirs(tmp_path) if p.name < suspect]
    assert f"the last good checkpoint is {kept[-1]};" in err


def test_the_divergence_guard_can_be_turned_off(tmp_path):
    cfg = run_config(tmp_path, steps=8, lr=1000, min_lr=0, warmup=0, max_bad_steps=0, save=False)
    out = train(cfg, CPU)
    assert len(out["losses"]) == 8 and out["history"][-1]["skipped"] >= 4  # not stopped
