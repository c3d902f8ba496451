"""The user's path: what `fitgpt train` plans is what it builds, every launch sets up its processes
the same way, a run folder resumes by itself, and running out of memory is one line."""

import json
import os
import re
import resource
import subprocess
import sys

import pytest
import torch
from cli_refusal import assert_refused, run_in_process, run_main
from helpers import run_config

from fitgpt.dist import DistContext
from fitgpt.dist.env import configure_process
from fitgpt.plan.apply import Fixed
from fitgpt.plan.memory import Workload, zero_state
from fitgpt.train.assemble import Settings, assemble
from fitgpt.train.loop import Trainer

CPU = DistContext(0, 1, 0, torch.device("cpu"))
QUIET = {"log": lambda *_: None}
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32"]
SMALL += ["--micro-batch", "2", "--device", "cpu", "--eval-every", "0"]


def fitgpt(*argv, env=None, preexec_fn=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "fitgpt", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        preexec_fn=preexec_fn,
    )


def test_planning_sees_the_vocabulary_the_engine_builds(tmp_path, capsys):
    # the test model's own vocabulary is 96; GPT-2's tokenizer makes it 50257 (50304 rows)
    # (the trainer takes a run assembled by train/assemble.py, which sizes the vocabulary before
    # the planner prices it). The data: a few documents tokenized by GPT-2's tokenizer (stdlib's
    # 8 MB took it 7 s to tokenize).
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 8})
                            + "\n" for i in range(40)))  # fmt: skip
    prefix = tmp_path / "g"
    code, _, err = run_main(
        capsys, "data", "preprocess", "--tokenizer", "gpt2", "--workers", "1", "--quiet",
        "--input", docs, "--output-prefix", prefix,
    )  # fmt: skip
    assert code == 0, err
    data = f"{prefix}_text_document"
    run = run_config(tmp_path / "run", data=data, tokenizer="gpt2", engine="zero", micro_batch=2)
    assembled = assemble(Settings(run, Fixed.of({"engine": "zero"})), CPU, **QUIET)
    planned = assembled.config
    assert planned.model.vocab_size == 50257
    trainer = Trainer(assembled)
    try:
        assert trainer.tokenizer.vocab_size == 50257
        assert trainer.engine.model_cfg == planned.model
        predicted = zero_state(Workload(planned.model, 2, 1, "fp32", "cpu"), planned.engine)
        held = {k: v for k, v in predicted["device"].items() if v}
        assert trainer.engine.memory_report()["cpu"] == held
    finally:
        trainer.engine.close()


def _threads_under_a_launcher(rank: int, world: int) -> None:
    # what torchrun leaves in every rank's environment, on a machine with 8 cores for fitgpt
    os.environ.update(OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID="t", FITGPT_CPU_CORES="8")
    try:
        assert configure_process() == 4 and torch.get_num_threads() == 4
        assert configure_process(cpu_threads=3) == 3  # --cpu-threads wins
    finally:
        torch.set_num_threads(1)


@pytest.mark.slow
def test_each_rank_gets_its_share_of_the_cores_not_torchruns_one(gloo, tmp_path):
    gloo(2, _threads_under_a_launcher)
    r = fitgpt(
        "train", "--gpus", "2", "--data", "synthetic", "--vocab-size", "64", *SMALL,
        "--steps", "2", "--out", str(tmp_path), "--no-save",
        env={"FITGPT_CPU_CORES": "8"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 rank(s) on cpu" in r.stdout and "4 CPU threads per rank" in r.stdout, r.stdout


def test_a_rank_refusing_under_gpus_is_one_line_not_torchruns_traceback(tmp_path):
    """Both ranks refuse (streamed weights on 2 ranks need ZeRO-3): the user sees the refusal
    once, exit status 2, and neither torchrun's traceback nor its failure records."""
    r = fitgpt(
        "train", "--gpus", "2", "--data", "synthetic", "--vocab-size", "64", *SMALL,
        "--engine", "zero", "--zero-stage", "2", "--offload-optimizer", "cpu",
        "--offload-params", "cpu", "--steps", "1", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "use --zero-stage 3" in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def losses(stdout: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"step +(\d+) \| loss (\S+)", stdout)}


@pytest.mark.slow
def test_a_run_on_megatron_data_resumes_by_its_folder_alone(tmp_path, capsys):
    # the data and the first run: made in this process; the resumes, processes of their own
    prefix, run = str(tmp_path / "d" / "corpus"), tmp_path / "run"
    code, _, err = run_main(
        capsys, "data", "fake", "--output-prefix", prefix, "--tokens", "60000", "--vocab", "256",
        "--doc-len", "64",
    )  # fmt: skip
    assert code == 0, err
    code, first_out, err = run_main(
        capsys, "train", "--data", prefix, "--tokenizer", "bytes", *SMALL, "--steps", "8",
        "--save-every", "4", "--log-every", "1", "--out", run,
    )  # fmt: skip
    assert code == 0, err[-2000:]
    # as if the run had died after step 4's checkpoint
    import shutil

    shutil.rmtree(run / "step_00000008")
    again = fitgpt("train", "--out", str(run), "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "with its own config" in again.stdout
    before, after = losses(first_out), losses(again.stdout)
    assert sorted(after) == [5, 6, 7, 8] and all(after[s] == before[s] for s in after)
    # what the data order or the saved state depend on must agree
    for flags, field in (
        (["--hidden", "64", "--heads", "4"], "--hidden 32"),
        (["--data", "stdlib"], "--data"),
        (["--seed", "3"], "--seed"),
    ):
        # refused before anything is read but the folder: in this process (~2 s less each)
        code, err = run_in_process(capsys, "train", "--out", str(run), "--resume", *flags)
        assert_refused(code, err, field)


@pytest.mark.slow
@pytest.mark.parametrize("data", ["stdlib", "synthetic", "uniform"])
def test_every_built_in_data_kind_resumes_by_its_folder_alone(tmp_path, data, capsys):
    run = tmp_path / "run"
    extra = ["--vocab-size", "64"] if data != "stdlib" else []
    code, first_out, err = run_main(  # in this process; the resume is a process of its own
        capsys, "train", "--data", data, *extra, *SMALL, "--steps", "4", "--save-every", "2",
        "--log-every", "1", "--out", run,
    )  # fmt: skip
    assert code == 0, err[-2000:]
    import shutil

    shutil.rmtree(run / "step_00000004")
    again = fitgpt("train", "--out", str(run), "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    before, after = losses(first_out), losses(again.stdout)
    assert sorted(after) == [3, 4] and all(after[s] == before[s] for s in after)


def test_resume_with_no_checkpoint_yet_starts_the_run(tmp_path, capsys):
    code, out, err = run_main(
        capsys, "train", "--data", "synthetic", "--vocab-size", "64", *SMALL, "--steps", "2",
        "--out", tmp_path / "new", "--resume",
    )  # fmt: skip
    assert code == 0, err[-2000:]
    assert "holds no checkpoint yet; starting a new run" in out
    assert (tmp_path / "new" / "step_00000002" / "meta.json").is_file()


def _limit_memory() -> None:
    # ~1.2 GiB of address space: torch and fitgpt load in ~0.65 GiB, the run below needs ~1.9
    resource.setrlimit(resource.RLIMIT_AS, (1200 << 20, 1200 << 20))


def test_running_out_of_host_memory_is_one_line_naming_the_phase_and_prediction(tmp_path):
    r = fitgpt(
        "train", "--data", "synthetic", "--layers", "8", "--hidden", "1024", "--heads", "8",
        "--seq-len", "64", "--vocab-size", "1000", "--micro-batch", "2", "--steps", "2",
        "--device", "cpu", "--out", str(tmp_path),
        preexec_fn=_limit_memory,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "ran out of host RAM during" in r.stderr and "the plan predicted" in r.stderr
