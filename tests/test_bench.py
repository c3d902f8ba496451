"""The benchmark harness on CPU: real trials in their own processes, gloo for two ranks."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cli_refusal import run_main

TINY = [
    "--hidden",
    "64",
    "--heads",
    "4",
    "--seq-len",
    "32",
    "--vocab-size",
    "256",
    "--micro-batch",
    "2",
    "--grad-accum",
    "2",
    "--warmup",
    "1",
    "--steps",
    "2",
    "--device",
    "cpu",
]


@pytest.fixture
def sweep(capsys):
    """`fitgpt bench sweep` run in this process (its trials are processes of their own, the
    test; the sweep's own costs ~2 s of torch's import), as a CompletedProcess. The sweep turns
    SIGTERM into KeyboardInterrupt for its trials' sake: pytest's handler is put back."""

    def run(out, *args) -> subprocess.CompletedProcess:
        argv = ["bench", "sweep", "--out", str(out), *TINY, *args]
        term = signal.getsignal(signal.SIGTERM)
        try:
            code, stdout, stderr = run_main(capsys, *argv)
        finally:
            signal.signal(signal.SIGTERM, term)
        return subprocess.CompletedProcess(argv, code, stdout, stderr)

    return run


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# One size here: each trial at world 2 is a torchrun job (~10 s); the sweep over several sizes is
# the tests below (one process per trial), and a second size took the same path at world 2.
@pytest.mark.slow
def test_sweep_two_systems_with_gloo_and_report(tmp_path, sweep):
    out = tmp_path / "r.jsonl"
    r = sweep(out, "--systems", "fitgpt,ddp", "--sizes", "1", "--gpus", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    recs = records(out)
    assert sorted((x["system"], x["layers"]) for x in recs) == [("ddp", 1), ("fitgpt", 1)]
    for x in recs:
        assert x["status"] == "ok" and x["world"] == 2
        assert x["tokens_per_s"] > 0 and x["step_s_min"] <= x["step_s"] <= x["step_s_max"]
        assert x["params"] > 0 and len(x["losses"]) == 3 and x["host_rss_peak_gib"] > 0
        assert {"device", "versions", "date", "bench"} <= set(x) and x["cpu_threads"] >= 1
        assert x["compiled"] is False and x["bench"]["compile"] == "auto"  # auto: off on CPUs
        if x["system"] == "fitgpt":  # the planner's step time beside the measured one
            terms = x["predicted_terms_s"]
            assert x["predicted_step_s"] == terms["total"] > terms["compute"] > 0
    # the same data and initial weights: the two systems' first losses agree
    first = {(x["system"], x["layers"]): x["losses"][0] for x in recs}
    assert abs(first[("fitgpt", 1)] - first[("ddp", 1)]) < 1e-4
    from fitgpt.cli import main  # the report's own path, in this process (its files are the test)

    with pytest.raises(SystemExit) as rep:
        main(["bench", "report", str(out)])
    assert rep.value.code in (0, None)
    png, md = tmp_path / "r.png", tmp_path / "r.md"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = md.read_text()
    assert "| fitgpt | " in table and "largest model trained" in table and "(r.png)" in table


@pytest.mark.slow
def test_a_failing_size_is_recorded_with_its_reason_and_ends_the_line(tmp_path, sweep):
    out = tmp_path / "r.jsonl"
    # in fp32, 1 layer holds ~1.4 MB of state, 2 layers ~2.2 MB: a 1.8 MB budget stops the line at 2
    r = sweep(out, "--systems", "zero0", "--sizes", "1,2,3", "--cap", "1.8MB")
    assert r.returncode == 0, r.stderr[-2000:]
    recs = records(out)
    assert [(x["layers"], x["status"]) for x in recs] == [(1, "ok"), (2, "oom-cap")]
    assert "over the cap" in recs[1]["reason"]
    assert "oom-cap" in r.stderr  # and the progress line says so


@pytest.mark.slow
def test_an_interrupted_sweep_keeps_what_it_finished(tmp_path, sweep):
    out = tmp_path / "r.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "fitgpt",
        "bench",
        "sweep",
        "--out",
        str(out),
        *TINY,
        "--systems",
        "zero0",
        "--sizes",
        "1,2,3",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 240
    while time.time() < deadline and (not out.exists() or len(records(out)) < 1):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # as if the machine went away mid-sweep
    proc.wait()
    kept = records(out)
    assert 1 <= len(kept) < 3 and all(x["status"] == "ok" for x in kept)
    with open(out, "a") as f:
        f.write('{"system": "zero0", "lay')  # a line cut by the crash
    r = sweep(out, "--systems", "zero0", "--sizes", "1,2,3")
    assert r.returncode == 0, r.stderr[-2000:]
    done = [x for x in records_tolerant(out)]
    assert sorted(x["layers"] for x in done) == [1, 2, 3]
    # what had finished was not run again: its record is the same object, written once
    assert [x for x in done if x["layers"] == kept[0]["layers"]] == [kept[0]]


def records_tolerant(path):
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@pytest.mark.slow
def test_a_sweep_under_a_budget_stops_early_and_the_same_command_resumes(tmp_path, sweep):
    out = tmp_path / "r.jsonl"
    # a 1-second budget: the first trial (predicted a minute) is not started
    r = sweep(out, "--systems", "zero0", "--sizes", "1", "--budget", "1")
    assert r.returncode != 0 or not out.exists() or records(out) == []
    assert "not started" in r.stderr and "resume" in r.stderr
    r = sweep(out, "--systems", "zero0", "--sizes", "1", "--budget", "600")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["layers"] for x in records(out)] == [1]


@pytest.mark.slow
def test_stopping_a_sweep_with_sigterm_kills_its_running_trial(tmp_path):
    out = tmp_path / "r.jsonl"
    cmd = [sys.executable, "-m", "fitgpt", "bench", "sweep", "--out", str(out), *TINY]
    cmd += ["--systems", "zero0", "--sizes", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    logs = tmp_path / "r.logs"
    deadline = time.time() + 60
    while time.time() < deadline and not list(logs.glob("*.log")):
        time.sleep(0.05)
    time.sleep(0.5)  # the trial process is running
    proc.terminate()
    assert proc.wait(timeout=60) != 0
    # no trial process of this sweep is left behind
    spec = str(logs / "zero0-1.json")
    left = subprocess.run(["pgrep", "-f", spec], capture_output=True, text=True).stdout
    assert left.strip() == ""
    assert not out.exists() or records(out) == []  # the unfinished trial was not recorded


@pytest.mark.slow
def test_an_ablation_that_changes_the_batch_is_not_rerun_on_resume(tmp_path, sweep):
    out = tmp_path / "r.jsonl"
    for _ in range(2):
        r = sweep(out, "--systems", "fitgpt-no-accum", "--sizes", "1")
        assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(out)
    assert rec["bench"]["grad_accum"] == 2 and rec["bench_effective"]["grad_accum"] == 1
