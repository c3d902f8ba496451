"""Launching: torchrun across two "machines" on localhost, and a dead or hung rank."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import free_port

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
RUN = [
    "--preset",
    "tiny",
    "--data",
    "synthetic",
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--seq-len",
    "32",
    "--vocab-size",
    "96",
    "--micro-batch",
    "2",
    "--log-every",
    "2",
    "--eval-every",
    "0",
    "--device",
    "cpu",
    "--engine",
    "zero",
]


def torchrun(nnodes: int, node_rank: int, nproc: int, port: int, args: list[str], env=ENV):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "-m",
        "fitgpt",
        "train",
        *args,
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_machines_on_localhost_train_together(tmp_path):
    port = free_port()
    args = [*RUN, "--steps", "4", "--zero-stage", "2", "--out", str(tmp_path)]
    nodes = [torchrun(2, r, 1, port, args) for r in (0, 1)]
    # both nodes' pipes drained at once: one node blocked on a full pipe would hold the other at
    # the job's end; a hang ends in both nodes' outputs, not in one node's timeout
    with ThreadPoolExecutor(2) as pool:
        waits = [pool.submit(p.communicate, timeout=240) for p in nodes]
        try:
            outs = [w.result() for w in waits]
        except subprocess.TimeoutExpired:
            for p in nodes:
                p.kill()
            pytest.fail(f"the two-node job hung: {[p.communicate() for p in nodes]}")
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert "2 rank(s)" in outs[0][0]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == [2, 4]
    assert (tmp_path / "step_00000004" / "index-r001.json").is_file()  # rank 1 wrote its shards


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hang", "die"])
def test_a_dead_or_hung_rank_ends_the_job_naming_rank_and_collective(tmp_path, kind):
    args = [
        *RUN,
        "--steps",
        "50",
        "--zero-stage",
        "1",
        "--dist-timeout",
        "8",
        "--out",
        str(tmp_path),
    ]
    t0 = time.time()
    p = torchrun(1, 0, 2, free_port(), args, env={**ENV, "FITGPT_FAULT": f"1:3:{kind}"})
    _, err = p.communicate(timeout=240)
    assert p.returncode != 0
    assert "rank 0: collective '" in err or "rank 0: a collective" in err, err[-2000:]
    assert "another rank died or hangs" in err
    assert time.time() - t0 < 120


@pytest.mark.slow
def test_an_error_on_one_rank_is_printed_with_its_rank_and_ends_the_job(tmp_path):
    """A rank that raises alone (a bug, an out-of-memory, a check only it failed) prints why at
    once and the job ends, long before --dist-timeout: its peer waits in the step's collectives."""
    args = [*RUN, "--steps", "50", "--zero-stage", "3", "--dist-timeout", "300"]
    t0 = time.time()
    p = torchrun(
        1,
        0,
        2,
        free_port(),
        [*args, "--out", str(tmp_path)],
        env={**ENV, "FITGPT_FAULT": "1:3:error"},
    )
    _, err = p.communicate(timeout=280)
    assert p.returncode != 0
    assert "RuntimeError: injected fault (FITGPT_FAULT=1:3:error)" in err, err[-3000:]
    assert "rank 1 of 2 failed alone (RuntimeError); the job ends" in err, err[-3000:]
    assert time.time() - t0 < 200  # the peer's collective would have waited 300 s


def test_a_refused_plan_is_one_line_on_two_ranks(tmp_path):
    """The planner's refusal is rank 0's, broadcast to every rank (plan/apply.py): `fitgpt
    train --gpus 2` prints it once, not once per rank, exits 2 and shows no traceback."""
    cmd = [sys.executable, "-m", "fitgpt", "train", "--gpus", "2", *RUN, "--steps", "2",
           "--cpu-mem", "10MiB", "--out", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=200)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert len(lines) == 1 and "host RAM" in lines[0], p.stderr[-3000:]


def test_the_ranks_get_their_flags_untouched_by_torchrun():
    """torchrun's parser took fitgpt's --master for an abbreviation of its --master-addr."""
    from fitgpt.dist.launch import command
    from fitgpt.dist.torchrun import launcher_args

    train = ["train", "--master", "split", "--nnodes", "3", "--gpus=2", "--data", "x"]
    cmd = command(2, "fitgpt", train, torchrun=True)
    args = launcher_args(cmd[3:])  # after `python -m fitgpt.dist.torchrun`
    assert (args.training_script, args.module, args.training_script_args) == ("fitgpt", True, train)
    assert (args.nproc_per_node, args.standalone, args.nnodes) == ("2", True, "1:1")
