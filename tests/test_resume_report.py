"""Resuming says what it changes and works from anywhere (issue 33): every setting that differs
from the saved run is named once the run is planned (world size, tokens per step, ZeRO stage,
placement, precision, flags); checkpoints store absolute paths, and older ones with relative
paths are read against the folder their run started in; data named at a new place with --data
is recognised by its fingerprint and read, other data is refused; a preset named again is not
taken for flags the user never typed. The refusals themselves are rows in
tests/test_cli_bad_inputs.py."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_refusal import run_main, run_process
from helpers import run_config, train

from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.resume import portable, saved_config

CPU = DistContext(0, 1, 0, torch.device("cpu"))
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SMALL = [
    *("--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--micro-batch", "2"),
    *("--eval-every", "0", "--log-every", "1", "--device", "cpu"),
]


def fitgpt(*argv, cwd=None) -> subprocess.CompletedProcess:
    return run_process(*argv, cwd=cwd, timeout=300, env=ENV)


def here(capsys, *argv, cwd=None) -> subprocess.CompletedProcess:
    """`fitgpt ARGV` run in this process from `cwd`, as fitgpt() would in a new one: for a
    resume, whose files and lines are the test, not its process (~2 s of torch's import each)."""
    old = os.getcwd()
    os.chdir(cwd or old)
    try:
        code, out, err = run_main(capsys, *argv)
    finally:
        os.chdir(old)
    return subprocess.CompletedProcess(argv, code, out, err)


def resumed_line(stdout: str) -> str:
    return next(ln for ln in stdout.splitlines() if ln.startswith("resumed from"))


def losses(stdout: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"step +(\d+) \| loss (\S+)", stdout)}


def refused(r: subprocess.CompletedProcess, *words: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(w in lines[0] for w in words), lines[0]


def rewrite_meta(ckpt: Path, edit) -> None:
    """Edit a checkpoint's meta.json as an older fitgpt would have written it (new checksum)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    for key in ("format", "version", "files", "file_sha256", "checksum"):
        meta.pop(key)
    edit(meta)
    (ckpt / "meta.json").unlink()
    ckpt_io.write_meta(ckpt, meta)


@pytest.mark.slow
def test_a_two_process_zero3_run_resumed_on_one_names_world_tokens_and_stage(tmp_path, capsys):
    out = tmp_path / "run"
    two = fitgpt(
        "train", "--gpus", "2", "--data", "synthetic", "--vocab-size", "64", *SMALL,
        "--plan", "off", "--engine", "zero", "--zero-stage", "3", "--steps", "2", "--out", out,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    one = here(capsys, "train", "--out", out, "--resume", "--steps", "3")  # planned for one rank
    assert one.returncode == 0, one.stderr[-3000:]
    line = resumed_line(one.stdout)
    assert "world size 2 → 1" in line and "tokens per step 64 → 32" in line, line
    assert "--grad-accum 2 keeps 64" in line  # the fix, when one exists
    stage = int(re.search(r"placement: ZeRO stage (\d)", one.stdout).group(1))
    # whatever the planner chose for one process, the line says it
    assert (f"--zero-stage 3 → {stage}" in line) == (stage != 3), line
    assert "--steps 2 → 3" in line


@pytest.mark.slow
def test_a_context_parallel_run_resumes_on_fewer_ranks_unless_its_degree_is_typed(tmp_path, capsys):
    out = tmp_path / "run"
    two = fitgpt(
        "train", "--gpus", "2", "--context-parallel", "2", "--data", "synthetic",
        "--vocab-size", "64", *SMALL, "--steps", "2", "--out", out,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    # C splits the sequence, not the state: on one process the untyped C falls to 1, said once
    one = here(capsys, "train", "--out", out, "--resume", "--steps", "3")
    assert one.returncode == 0, one.stderr[-3000:]
    assert "--context-parallel 2 does not divide 1 rank(s); resuming with 1" in one.stdout
    assert "--context-parallel 2 → 1" in resumed_line(one.stdout)
    # typed again, the degree is the user's and is refused as given, in one line
    typed = here(
        capsys, "train", "--out", out, "--resume", "--steps", "4", "--context-parallel", "2"
    )
    refused(typed, "--context-parallel 2", "does not divide")


def test_every_setting_the_new_run_differs_in_is_named_asked_or_not(tmp_path, capsys):
    train(run_config(tmp_path, steps=2, engine="zero", zero_stage=3, micro_batch=4), CPU)
    capsys.readouterr()
    # as a planner would make it: another engine and batch split, the same tokens per step
    again = dict(engine="ddp", micro_batch=2, grad_accum=2, lr=1e-3)
    train(run_config(tmp_path, steps=3, **again), CPU, resume="")
    line = resumed_line(capsys.readouterr().out)
    for said in ("--engine zero → ddp", "--micro-batch 4 → 2", "--grad-accum 1 → 2"):
        assert said in line, line
    assert "--lr 0.003 → 0.001" in line and "--steps 2 → 3" in line
    assert "tokens per step" not in line and "world size" not in line  # unchanged: not named
    # dropout is a setting a run may change (not the weights' shape): applied and named
    train(run_config(tmp_path, steps=4, dropout=0.1, **again), CPU, resume="")
    line = resumed_line(capsys.readouterr().out)
    assert line.endswith("changed --steps 3 → 4, --dropout 0 → 0.1"), line
    # the host RAM a command states (--cpu-mem) is the machine's, not a setting of the run
    stated = run_config(tmp_path, steps=5, dropout=0.1, cpu_mem=64 << 30, **again)
    train(stated, CPU, resume="")
    assert resumed_line(capsys.readouterr().out).endswith("changed --steps 4 → 5")


def test_checkpoints_store_absolute_paths_and_old_ones_read_from_where_their_run_started(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    config = {
        "data": {"data": "d/corpus", "tokenizer": "tok/v.json,tok/m.txt"},
        "engine": {"nvme_path": "nv"},
        "train": {"out": "runs/a"},
    }
    stored = portable(config)
    assert stored["data"] == {
        "data": str(tmp_path / "d/corpus"),
        "tokenizer": f"{tmp_path}/tok/v.json,{tmp_path}/tok/m.txt",
    }
    assert stored["engine"]["nvme_path"] == str(tmp_path / "nv")
    kept = {"data": {"data": "stdlib", "tokenizer": "gpt2"}, "engine": {"nvme_path": ""}}
    assert portable(kept) == kept  # names, not paths
    # a checkpoint of an older fitgpt, read from anywhere: relative to the folder the run started in
    meta = {"config": config}
    monkeypatch.chdir("/")
    ckpt = tmp_path / "runs" / "a" / "step_00000002"
    assert saved_config(meta, ckpt)["data"] == stored["data"]
    assert saved_config(meta, ckpt)["engine"]["nvme_path"] == str(tmp_path / "nv")
    moved = tmp_path / "elsewhere" / "step_00000002"  # a run folder renamed: no guess is made
    assert saved_config(meta, moved)["data"]["data"] == "d/corpus"


@pytest.mark.slow
def test_a_run_folder_resumes_from_another_directory_and_with_its_data_moved(
    tmp_path, monkeypatch, capsys
):
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir(), elsewhere.mkdir()
    # the data and the first run made in `start` (their paths relative to it), every resume
    # below run from elsewhere (in this process: the working folder is the test, not a process)
    monkeypatch.chdir(start)
    code, _, err = run_main(
        capsys, "data", "fake", "--output-prefix", "d/corpus", "--tokens", "20000", "--vocab",
        "256", "--doc-len", "64",
    )  # fmt: skip
    assert code == 0, err
    code, out, err = run_main(
        capsys, "train", "--data", "d/corpus", "--tokenizer", "none", "--vocab-size", "256",
        "--split", "9,1,0", *SMALL, "--plan", "off", "--engine", "zero", "--steps", "4",
        "--save-every", "2", "--out", "runs/a",
    )  # fmt: skip
    assert code == 0, err[-2000:]
    monkeypatch.chdir(tmp_path)
    full, run = losses(out), Path("..") / "start" / "runs" / "a"

    def resume(*extra):
        shutil.rmtree(start / "runs" / "a" / "step_00000004", ignore_errors=True)
        r = here(capsys, "train", "--out", run, "--resume", *extra, cwd=elsewhere)
        if r.returncode == 0:
            again = losses(r.stdout)
            assert sorted(again) == [3, 4] and all(again[s] == full[s] for s in again)
        return r

    r = resume()  # its paths are absolute
    assert r.returncode == 0, r.stderr[-2000:]
    assert "changed" not in resumed_line(r.stdout)

    # the data moved: named at its new place, recognised by its fingerprint, and read there
    (start / "d").rename(start / "moved")
    r = resume()
    refused(r, "no longer exist", "--data")
    r = resume("--data", "../start/moved/corpus")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"--data {start}/d/corpus → {start}/moved/corpus" in resumed_line(r.stdout)

    # other data of the same size is refused: one token differs in the .bin's last MiB
    other = start / "other"
    shutil.copytree(start / "moved", other)
    tokens = np.fromfile(other / "corpus.bin", dtype=np.uint16)
    tokens[-1] = (tokens[-1] + 1) % 256
    tokens.tofile(other / "corpus.bin")
    refused(resume("--data", "../start/other/corpus"), "--data", "other content")

    # a checkpoint of an older fitgpt: paths relative to where the run started, no fingerprints
    (start / "moved").rename(start / "d")

    def as_older(meta):
        meta["config"]["data"]["data"], meta["config"]["train"]["out"] = "d/corpus", "runs/a"
        for key in ("data_fingerprint", "tokenizer_fingerprint", "device"):
            meta.pop(key)

    rewrite_meta(start / "runs" / "a" / "step_00000002", as_older)
    r = resume()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "changed" not in resumed_line(r.stdout)


def test_a_preset_named_again_is_not_taken_for_flags_never_typed(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["--preset", "tiny", "--data", "synthetic", "--micro-batch", "1", "--eval-every", "0"]
    base += ["--device", "cpu", "--plan", "off", "--engine", "zero", "--out", out]
    code, _, err = run_main(capsys, "train", *base, "--dropout", "0.1", "--steps", "1")
    assert code == 0, err[-2000:]  # the first run; the resume reads only its folder
    # the preset's own dropout (0) is not a flag: the run keeps the 0.1 it was trained with
    again = here(capsys, "train", *base, "--resume", "--steps", "2")
    assert again.returncode == 0, again.stderr[-2000:]
    meta = json.loads((out / "step_00000002" / "meta.json").read_text())
    assert meta["config"]["model"]["dropout"] == 0.1


def test_a_tokenizer_named_at_another_place_is_recognised_by_its_fingerprint(tmp_path):
    from fitgpt.data.tokenizer import gpt2_files, load_tokenizer
    from fitgpt.train.resume import resumed_config, saved_run

    # a tokenizer folder (GPT-2's files), the run's record of it, then the folder moved
    tok, moved = tmp_path / "tok", tmp_path / "moved"
    tok.mkdir()
    for src, name in zip(gpt2_files(), ("vocab.json", "merges.txt")):
        shutil.copy(src, tok / name)
    run = run_config(tmp_path / "run", data="stdlib", tokenizer=str(tok))
    meta = {"step": 2, "trainer": {"step": 2}, **saved_run(run, load_tokenizer(str(tok)), None)}
    ckpt = tmp_path / "run" / "step_00000002"
    tok.rename(moved)
    resumed, _ = resumed_config(meta, ckpt, {"data": {"tokenizer": str(moved)}}, None)
    assert resumed.data.tokenizer == str(moved)
    with pytest.raises(UserError, match="--tokenizer bytes"):  # another tokenizer: refused
        resumed_config(meta, ckpt, {"data": {"tokenizer": "bytes"}}, None)
