"""Several machines (dist/nodes.py): `fitgpt train --gpus G --nnodes N --node-rank R
--master-addr A --master-port P`, with N "nodes" as processes on this one CPU host (gloo)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_refusal import assert_refused, run_in_process
from conftest import free_port

ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
}
RUN = ["--preset", "tiny", "--data", "synthetic", "--layers", "2", "--hidden", "32",
       "--heads", "4", "--seq-len", "32", "--vocab-size", "96", "--micro-batch", "2",
       "--log-every", "1", "--eval-every", "0", "--device", "cpu", "--engine", "zero",
       "--zero-stage", "1", "--plan", "off"]  # fmt: skip
TIMEOUT = 6  # --dist-timeout where a test waits it out: seconds asleep, not work


def train(*argv, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fitgpt", "train", *map(str, argv)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(cmd, env=ENV, text=True, **pipes)


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[str, str]]:
    """Every process's (stdout, stderr), their pipes drained at once (one node blocked on a full
    pipe would hold the others); a hang kills them all and fails with what they printed."""
    with ThreadPoolExecutor(len(procs)) as pool:
        waits = [pool.submit(p.communicate, timeout=timeout) for p in procs]
        try:
            return [w.result() for w in waits]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"the job hung: {[p.communicate() for p in procs]}")


def losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def node(r: int, nnodes: int, gpus: int, port: int, args: list, **popen) -> subprocess.Popen:
    """Node r's launcher of `gpus` processes, of `nnodes`."""
    flags = ["--gpus", gpus, "--nnodes", nnodes, "--node-rank", r,
             "--master-addr", "127.0.0.1", "--master-port", port]  # fmt: skip
    return train(*flags, *args, **popen)


def nodes(nnodes: int, gpus: int, port: int, args: list, per_node=lambda r: []):
    """Every node's launcher, node r given `per_node(r)`'s flags too."""
    return [node(r, nnodes, gpus, port, [*args, *per_node(r)]) for r in range(nnodes)]


def test_two_nodes_of_two_train_as_four_ranks_of_one_node(tmp_path):
    """2 nodes x 2 processes: the same 4-rank job as one node's 4, loss for loss, bit for bit."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = [*RUN, "--steps", "3"]
    single = train("--gpus", 4, *args, "--out", one)
    [(_, err)] = finish([single])
    assert single.returncode == 0, err[-3000:]
    procs = nodes(2, 2, free_port(), [*args, "--out", two])
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "4 rank(s)" in outs[0][0]
    assert len(losses(one)) == 3 and losses(two) == losses(one)


def test_nodes_that_settled_different_runs_are_refused_naming_the_node(tmp_path):
    """Each node settles its own run from its own command line: node 1's other --seed is
    refused at start, on one line naming node 1 and the setting, before a step is taken."""
    seed = lambda r: ["--seed", 1 + r]  # noqa: E731
    procs = nodes(2, 1, free_port(), [*RUN, "--steps", "3", "--out", tmp_path], seed)
    outs = finish(procs)
    assert all(p.returncode == 2 for p in procs), outs
    err = outs[0][1]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "node(s) 1 settled a different run" in lines[0], err[-3000:]
    assert "seed 1 on node 0, 2 on node 1" in lines[0], lines[0]  # the difference, named
    assert not (tmp_path / "metrics.jsonl").exists() or losses(tmp_path) == []


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--nnodes", "2", "--master-port", "29500"], ["--nnodes", "--gpus"]),
        (["--gpus", "1", "--nnodes", "2", "--node-rank", "2", "--master-port", "1"],
         ["--node-rank 2", "0..1"]),
        (["--gpus", "1", "--node-rank", "-1"], ["--node-rank -1"]),
        (["--gpus", "1", "--nnodes", "0"], ["--nnodes 0"]),
        (["--gpus", "1", "--master-port", "70000"], ["--master-port 70000", "1-65535"]),
        (["--gpus", "1", "--nnodes", "2"], ["--nnodes 2", "--master-port"]),
        (["--gpus", "1", "--master-addr", " ", "--master-port", "2"], ["--master-addr"]),
    ],
)  # fmt: skip
def test_bad_node_flags_are_refused_in_one_line(capsys, tmp_path, flags, names):
    code, err = run_in_process(capsys, "train", *RUN, "--out", tmp_path, *flags)
    assert_refused(code, err, *names)
    assert not any(tmp_path.iterdir())


def test_the_launcher_hands_torchrun_the_static_rendezvous():
    from fitgpt.dist.launch import command
    from fitgpt.dist.nodes import Nodes
    from fitgpt.dist.torchrun import launcher_args

    n = Nodes(3, 2, "10.0.0.7", 29400)
    cmd = command(4, "fitgpt", ["train", "--steps", "2"], torchrun=True, nodes=n)
    a = launcher_args(cmd[3:])
    assert (a.nnodes, a.node_rank, a.master_addr, a.master_port) == ("3", 2, "10.0.0.7", 29400)
    assert (a.nproc_per_node, a.standalone, a.rdzv_backend) == ("4", False, "static")
    assert a.training_script_args == ["train", "--steps", "2"]


def test_a_node_missing_on_either_side_is_named_within_the_timeout(tmp_path):
    """Node 0 alone of 3 ends within --dist-timeout on one line naming nodes 1 and 2; node 1 of
    2 with no node 0 at --master-addr, on one line naming the address. Both wait out their
    timeout at once (each is a launcher and torchrun's, asleep)."""
    alone, lost, t0 = free_port(), free_port(), time.monotonic()
    run = [*RUN, "--steps", "3", "--dist-timeout", str(TIMEOUT)]
    procs = [node(0, 3, 1, alone, [*run, "--out", tmp_path / "0"]),
             node(1, 2, 1, lost, [*run, "--out", tmp_path / "1"])]  # fmt: skip
    outs = finish(procs)
    took = time.monotonic() - t0
    for p, (_, err) in zip(procs, outs):
        assert p.returncode not in (0, None) and "Traceback" not in err, err[-3000:]
    lines = [[ln for ln in err.splitlines() if ln.strip()] for _, err in outs]
    assert len(lines[0]) == 1 and "node(s) 1, 2 of 3 did not join" in lines[0][0], outs[0][1]
    assert len(lines[1]) == 1, outs[1][1]
    assert f"node 1 could not reach node 0 at 127.0.0.1:{lost}" in lines[1][0]
    assert TIMEOUT <= took < TIMEOUT + 25  # the timeout, and the launchers' start (torch's import)


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc): torchrun starts each rank in a session of its
    own, so node 1's process group would not hold its ranks."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        kids = []
    return [pid] + [d for k in kids for d in tree(k)]


def test_a_node_killed_mid_run_is_named_by_the_others_within_the_timeout(tmp_path):
    """Node 1 (its launcher, torchrun and ranks) killed after step 1: node 0 ends within
    --dist-timeout, its last line naming node 1, no traceback."""
    port, args = free_port(), [*RUN, "--steps", "100000", "--dist-timeout", "20"]
    args += ["--out", tmp_path]
    n1 = node(1, 2, 1, port, args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    n0 = node(0, 2, 1, port, args)
    try:
        for line in n0.stdout:  # rank 0's step lines
            if line.startswith("step      1 "):
                break
        else:
            pytest.fail(f"node 0 ended before step 1: {n0.communicate()}")
        t0 = time.monotonic()
        for pid in tree(n1.pid):  # node 1 whole, as a machine that goes down
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, err = n0.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:  # whatever is left of either node (a failed test's); an exited one's pid may be reused
        for pid in [pid for p in (n0, n1) if p.poll() is None for pid in tree(p.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        n1.wait()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert n0.returncode != 0 and "Traceback" not in err, err[-3000:]
    assert lines and lines[-1] == "fitgpt: node(s) 1 stopped answering; the job ends", err[-3000:]
    assert took < 20 + 10, took


def test_a_node_rank_given_twice_is_refused_at_once_and_the_job_goes_on(tmp_path):
    """A third launcher with node 1's --node-rank, while nodes 0 and 1 train: one line naming
    the rank, at once (it waited out --dist-timeout in gloo's connect, then printed a
    62-line traceback and "node(s) 0 stopped answering"); the job it tried to join trains on."""
    port, args = free_port(), [*RUN, "--steps", "100000", "--dist-timeout", "60"]
    args += ["--out", tmp_path]
    n1 = node(1, 2, 1, port, args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    n0 = node(0, 2, 1, port, args, stderr=subprocess.DEVNULL)
    procs = [n0, n1]
    try:
        for line in n0.stdout:  # rank 0's step lines: both nodes have joined
            if line.startswith("step      1 "):
                break
        else:
            pytest.fail(f"node 0 ended before step 1: {n0.communicate()}")
        t0 = time.monotonic()
        again = node(1, 2, 1, port, [*RUN, "--steps", "3", "--out", tmp_path / "again"])
        procs.append(again)
        _, err = again.communicate(timeout=120)
        took = time.monotonic() - t0
        assert n0.poll() is None and n1.poll() is None  # the job trains on
    finally:
        for pid in [pid for p in procs if p.poll() is None for pid in tree(p.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in procs:
            p.wait()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert again.returncode == 1 and len(lines) == 1, err[-3000:]
    assert "--node-rank 1" in lines[0] and "already" in lines[0], lines[0]
    assert took < 30, took  # the launcher's start, not --dist-timeout
