"""Stopping a `fitgpt train --gpus 2` job, with real processes: a SIGTERM or Ctrl-C to its
launcher (a scheduler, `timeout`, `kill`), a Ctrl-C at the terminal (every process of the
foreground group), a signal to one rank, a SIGKILL to the launcher. Each ends the whole job, saves the step it stopped at,
and says so in one line; no process of the job outlives the launcher."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_checkpoint import ENV, TINY_ARGS

from fitgpt.dist.launch import children
from fitgpt.procs import pid_alive
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.rundir import LOCK_NAME


def descendants(pid: int) -> list[int]:
    """Every process below `pid` now: torchrun's agent and its ranks."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def launch(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    """A 2-rank run that goes on until stopped, in a session of its own (as a terminal's job
    is): the launcher, its --out and its stdout's file."""
    out, log = tmp_path / "run", tmp_path / "stdout"
    args = [
        *TINY_ARGS,
        "--gpus",
        "2",
        "--steps",
        "100000",
        "--log-every",
        "1",
        "--out",
        str(out),
        *extra,
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "fitgpt", "train", *args],
        env=ENV,
        stdout=log.open("w"),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return p, out, log


def start_job(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """launch(), once it is training (its first step line is out)."""
    p, out, log = launch(tmp_path, *extra)
    deadline = time.time() + 120
    while "step " not in log.read_text():
        if p.poll() is not None or time.time() > deadline:
            p.kill()
            pytest.fail(f"the job never trained: {p.communicate()}")
        time.sleep(0.2)
    return p, out


def first_checkpoint(out: Path) -> None:
    """Until a job saving every step has its first checkpoint in place (step 1's line comes
    before its save is renamed into place)."""
    deadline = time.time() + 60
    while not ckpt_io.step_dirs(out):
        assert time.time() < deadline, f"no checkpoint in {out} after 60 s"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "target, sig",
    [
        ("launcher", signal.SIGTERM),  # a scheduler's stop, `timeout`, `kill PID` (a SIGINT
        # to the launcher alone takes the same path: wait_job forwards either)
        ("group", signal.SIGINT),  # Ctrl-C at the terminal
        ("rank", signal.SIGTERM),  # one rank stopped by hand
        ("launcher", signal.SIGKILL),  # the agent gets a SIGTERM (its pdeathsig)
    ],
)
def test_a_stopped_job_saves_ends_every_process_and_says_one_line(tmp_path, target, sig):
    p, out = start_job(tmp_path)
    job = descendants(p.pid)
    assert len(job) == 3, job  # torchrun's agent and 2 ranks
    if target == "launcher":
        os.kill(p.pid, sig)
    elif target == "group":
        os.killpg(p.pid, sig)
    else:  # the last rank started
        os.kill(max(job), sig)
    try:  # the ranks hold stderr: its end is theirs, after a SIGKILLed launcher too
        _, err = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        for pid in job:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail("the launcher did not end after the stop")
    # the launcher waits for its job; a SIGKILLed one cannot: then the job ends on its own
    deadline = time.time() + (30 if sig == signal.SIGKILL else 0)
    while (alive := [pid for pid in job if pid_alive(pid)]) and time.time() < deadline:
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes of the job outlived its launcher: {alive}"
    assert p.returncode == (-9 if sig == signal.SIGKILL else 130), err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "saved" in lines[0] and "--resume" in lines[0], err
    step = int(lines[0].split(" at step ")[1].split(";")[0])
    assert [d.name for d in ckpt_io.step_dirs(out)] == [f"step_{step:08d}"]
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_live_run_is_exported_whole_and_its_out_refused_to_another_job(tmp_path):
    """While RUN's 2 ranks save every step and keep one: `fitgpt export --ckpt RUN` reads a
    whole checkpoint (the newest it picks is no longer pruned from under it: it failed, "has
    no index-r*.json", 12 times in 12), and another `--gpus 2` run on RUN, --overwrite too, is
    refused in rank 0's one line naming the owner (rank 1 added "rank 0 could not open it (see
    its message)")."""
    p, out = start_job(tmp_path, "--save-every", "1", "--keep", "1")
    try:
        first_checkpoint(out)
        args = [*TINY_ARGS, "--gpus", "2", "--steps", "2", "--out", str(out), "--overwrite"]
        r = subprocess.run(
            [sys.executable, "-m", "fitgpt", "train", *args],
            env=ENV, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "is in use by another fitgpt run" in lines[0], r.stderr
        for i in range(2):
            r = subprocess.run(
                [sys.executable, "-m", "fitgpt", "export", "--ckpt", str(out),
                 "--out", str(tmp_path / f"e{i}.safetensors")],
                env=ENV, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
    finally:
        os.kill(p.pid, signal.SIGTERM)
        p.communicate(timeout=90)
    assert p.returncode == 130
    assert len(ckpt_io.step_dirs(out)) == 1  # the held ones went at later saves


def rank_pid(job: list[int], rank: int) -> int:
    """The pid among `job` whose torchrun RANK is `rank`."""
    for pid in job:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    raise AssertionError(f"no rank {rank} among {job}")


@pytest.mark.slow
def test_a_rank_killed_outright_is_the_one_the_job_names(tmp_path):
    """kill -9 of rank 1 while the job saves every step: the last line names rank 1 and the
    signal (it named rank 0, which only saw its collective fail), and no partial save is left."""
    p, out = start_job(tmp_path, "--save-every", "1", "--keep", "2")
    first_checkpoint(out)
    os.kill(rank_pid(descendants(p.pid), 1), signal.SIGKILL)
    _, err = p.communicate(timeout=90)
    lines = err.strip().splitlines()
    assert p.returncode == 1 and "Traceback" not in err, err
    assert lines[-1].startswith("fitgpt: rank 1 ") and "SIGKILL" in lines[-1], err
    assert ckpt_io.step_dirs(out) and not list(out.glob(".step_*"))


@pytest.mark.slow
def test_a_job_stopped_in_start_up_says_so_in_one_line_and_leaves_no_folder(tmp_path):
    """SIGTERM to the launcher once rank 0 has created and locked --out, about a second before
    the first step (the ranks build the run meanwhile): one line, from the launcher, exit 143,
    every process ended and no folder left (it said nothing, and left run.json and run.lock)."""
    p, out, log = launch(tmp_path)
    deadline = time.time() + 120
    while not (out / LOCK_NAME).exists():
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.01)
    job = descendants(p.pid)
    # the agent gives the ranks --dist-timeout (600 s), not torch's 30 s, to end after a stop:
    # a save of the stopped step that took longer was killed and the run ended without a line
    agent_env = Path(f"/proc/{children(p.pid)[0]}/environ").read_bytes().split(b"\0")
    assert b"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600" in agent_env
    os.kill(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=90)
    lines = err.strip().splitlines()
    assert p.returncode == 143 and len(lines) == 1, err
    assert "stopped by SIGTERM during start-up" in lines[0], err
    assert "step " not in log.read_text()  # it never trained: a stop in start-up indeed
    assert not [pid for pid in job if pid_alive(pid)]
    assert not out.exists()
