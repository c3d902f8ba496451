"""Faults around a run, with real processes: the run folder lock, Ctrl-C, a kill, a rank that
fails or dies while a checkpoint is written, and a disk that is really full (a small tmpfs)."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_refusal import assert_refused, run_in_process, run_main
from conftest import free_port
from test_checkpoint import ENV, TINY_ARGS

import fitgpt as fitgpt_pkg
from fitgpt.errors import UserError, print_line
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.rundir import LOCK_NAME, RunLock


def start(out: Path, *extra: str) -> subprocess.Popen:
    """A run that goes on until stopped, once it has taken the lock."""
    args = [*TINY_ARGS, "--steps", "100000", "--log-every", "1000", "--out", str(out), *extra]
    p = subprocess.Popen(
        [sys.executable, "-m", "fitgpt", "train", *args],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        try:
            if json.loads((out / LOCK_NAME).read_text())["pid"] == p.pid:
                return p
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    p.kill()
    pytest.fail(f"the run never took its lock: {p.communicate()}")


def wait_for_training(p: subprocess.Popen) -> None:
    """Until the run's training loop has started (its model line is out), and a little more."""
    for line in p.stdout:
        if line.startswith("model "):
            time.sleep(1)
            return
    pytest.fail(f"the run ended before training: {p.communicate()}")


def test_the_lock_holds_a_second_run_and_an_overwrite_off(tmp_path, capsys):
    out = tmp_path / "run"
    a = start(out)
    # stopped, it still holds the lock (its pid runs, its file is open) and leaves the CPU to
    # the three commands below
    a.send_signal(signal.SIGSTOP)
    try:
        for extra in ([], ["--overwrite"], ["--resume"]):  # in this process: a's is the other
            argv = ["train", *TINY_ARGS, "--steps", "2", "--out", str(out), *extra]
            code, err = run_in_process(capsys, *argv)
            assert_refused(code, err, f"is in use by another fitgpt run (pid {a.pid} on ")
        assert (out / LOCK_NAME).is_file() and a.poll() is None  # the first run is untouched
    finally:
        a.kill()  # SIGKILL ends a stopped process too
        a.communicate()


def test_ctrl_c_saves_the_current_step_and_says_how_to_resume(tmp_path, capsys):
    out = tmp_path / "run"
    a = start(out, "--save-every", "0")
    wait_for_training(a)
    a.send_signal(signal.SIGINT)
    _, err = a.communicate(timeout=120)
    assert a.returncode == 130, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "stopped by SIGINT at step" in err
    assert f"resume with fitgpt train --out {out} --resume" in err
    (ckpt,) = ckpt_io.step_dirs(out)
    assert f"saved {ckpt}" in err
    step = ckpt_io.verify(ckpt)["step"]
    assert not (out / LOCK_NAME).exists()  # released on the way out
    # the resume, in this process (the stopped process's files are the test)
    code, said, err = run_main(
        capsys, "train", *TINY_ARGS, "--steps", str(step + 2), "--out", out, "--resume"
    )
    assert code == 0, err
    assert f"resumed from {ckpt} at step {step}" in said


def test_a_killed_runs_lock_is_taken_over_with_a_note(tmp_path, capsys):
    out = tmp_path / "run"
    a = start(out)
    a.kill()  # SIGKILL: no handler runs, the lock file stays behind
    a.communicate()
    assert (out / LOCK_NAME).is_file()
    code, said, err = run_main(
        capsys, "train", *TINY_ARGS, "--steps", "2", "--out", out, "--resume"
    )
    assert code == 0, err
    assert f"taking over the lock of pid {a.pid} on " in said
    assert "which is no longer running" in said


def test_the_lock_in_process(tmp_path, capsys):
    lock = RunLock.acquire(tmp_path, print)
    with pytest.raises(UserError, match=f"in use by another fitgpt run \\(pid {os.getpid()}"):
        RunLock.acquire(tmp_path, print)  # a second open file: flock refuses it
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    RunLock.acquire(tmp_path, print).release()
    assert "taking over" not in capsys.readouterr().out


def torchrun(out: Path, fault: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "fitgpt", "train"]
    cmd += [*TINY_ARGS, "--steps", "4", "--save-every", "2", "--out", str(out), *extra]
    env = {**ENV, ckpt_io.FAULT_ENV: fault}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_a_rank_that_dies_during_a_checkpoint_is_named_like_other_collectives(tmp_path):
    r = torchrun(tmp_path, "1:4:die", "--dist-timeout", "8")
    assert r.returncode != 0
    assert "rank 0: collective 'checkpoint step_00000004" in r.stderr, r.stderr[-3000:]
    assert "another rank died or hangs" in r.stderr
    assert [p.name for p in ckpt_io.step_dirs(tmp_path)] == ["step_00000002"]
    assert not list(tmp_path.glob(".step_*"))


@pytest.mark.slow
def test_a_save_that_fails_in_one_rank_ends_every_rank_in_one_line(tmp_path):
    r = torchrun(tmp_path, "1:4:enospc")
    # torchrun prints its own ChildFailedError traceback when a rank exits non-zero; no frame of
    # fitgpt's own package may show (matched by the package's folder, not by a "fitgpt/" that
    # the clone's or the venv's path may hold as well)
    ours = re.escape(str(Path(fitgpt_pkg.__file__).parent) + os.sep)
    assert r.returncode != 0 and not re.search(rf'File "{ours}', r.stderr), r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("fitgpt train")]
    assert len(lines) == 2, r.stderr[-3000:]
    assert "the disk is full" in r.stderr  # rank 1's own line
    assert "another rank failed to write its files" in r.stderr  # rank 0's
    assert [p.name for p in ckpt_io.step_dirs(tmp_path)] == ["step_00000002"]
    assert not list(tmp_path.glob(".step_*"))


class CountingFile(io.FileIO):
    """A file that records each write call it gets: what one process puts on a shared pipe
    at once (a write under the pipe's 4 KiB is never split by another process's)."""

    calls: list[bytes]

    def write(self, b):
        self.calls.append(bytes(b))
        return super().write(b)


def test_an_error_line_goes_out_in_one_write_as_python_u_sets_stderr(tmp_path):
    # how Python -u (PYTHONUNBUFFERED) builds stderr: a text layer writing through to the file
    raw = CountingFile(tmp_path / "stderr", "w")
    raw.calls = []
    err = io.TextIOWrapper(raw, line_buffering=True, write_through=True)
    print("rank 1's cause", file=err, flush=True)
    assert raw.calls == [b"rank 1's cause", b"\n"]  # two ranks' prints interleave: "AB\n\n"
    raw.calls.clear()
    print_line("rank 0's cause", err)
    assert raw.calls == [b"rank 0's cause\n"]
    err.close()


def small_disk_script(mnt: Path, size: str, commands: str) -> list[str]:
    """bash running `commands` with a tmpfs of `size` mounted at `mnt`, in a private mount
    namespace (unshare: no root needed where user namespaces are allowed; gone at exit)."""
    body = f"mount -t tmpfs -o size={size} tmpfs {mnt} && {commands}"
    return ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", body]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_real_full_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    probe = subprocess.run(small_disk_script(mnt, "64k", "true"), capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.decode()[:200]}")
    py = f"{sys.executable} -m fitgpt train {' '.join(TINY_ARGS)} --save-every 2 --keep 1"
    # a checkpoint of the tiny model is ~0.38 MB: 600 kB hold one, not the two at once that a
    # run writing two needs (keep 1 and the one being written)
    run_a = f"{py} --steps 4 --out {mnt}/a; echo rc=$?"
    # the same run told the disk is large: its second save hits the real ENOSPC
    run_b = f"FITGPT_FAKE_FREE_BYTES=10000000000 {py} --steps 4 --out {mnt}/b; echo rc=$?"
    verify = f"from fitgpt.train.checkpoint import verify; verify(Path('{mnt}/b/step_00000002'))"
    check = f'echo left: $(ls -A {mnt}/b); {sys.executable} -c "from pathlib import Path; {verify}"'
    r = subprocess.run(
        small_disk_script(mnt, "600k", f"{run_a}; {run_b}; {check} && echo verified"),
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV,
    )
    out, err = r.stdout, r.stderr
    errs = [x for x in err.strip().splitlines() if x.startswith("fitgpt")]
    assert "Traceback" not in err and len(errs) == 2, err
    assert "one checkpoint of this run is" in errs[0] and "free" in errs[0]
    assert "step_00000004 could not be written: the disk is full" in errs[1]
    assert "needs" in errs[1] and "free" in errs[1]
    assert out.count("rc=2") == 2, out
    left = next(x for x in out.splitlines() if x.startswith("left:")).split()[1:]
    assert sorted(left) == ["metrics.jsonl", "step_00000002"], left  # no .tmp, no lock
    assert "verified" in out, err


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_an_export_to_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    """export --format fitgpt onto a real full disk (a 64 kB tmpfs; the tiny model's file is
    ~0.2 MB): one line naming --out, no safetensors traceback, no temporary file left."""
    run = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "fitgpt", "train", *TINY_ARGS, "--steps", "1", "--out", str(run)],
        capture_output=True, text=True, env=ENV, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    mnt = tmp_path / "disk"
    mnt.mkdir()
    py = f"{sys.executable} -m fitgpt export --ckpt {run} --format fitgpt --out {mnt}/m.safetensors"
    r = subprocess.run(
        small_disk_script(mnt, "64k", f"{py}; echo rc=$?; echo left: $(ls -A {mnt})"),
        capture_output=True, text=True, env=ENV, timeout=240,
    )  # fmt: skip
    if "rc=" not in r.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr[:200]}")
    err = r.stderr.strip().splitlines()
    assert "rc=2" in r.stdout and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert err[0].startswith(f"fitgpt export: error: --out {mnt}/m.safetensors: no space left")
    assert r.stdout.strip().endswith("left:"), r.stdout  # nothing written, nothing beside it
