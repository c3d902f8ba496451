"""Checkpoints on machines that share no disk (--node-local-checkpoints): 2 nodes x 2 gloo
processes on this one host, each node's --out a folder of its own standing for its own disk."""

import contextlib
import json
import os
import shutil
import signal
import time

import pytest
from cli_refusal import assert_refused, run_in_process
from conftest import free_port
from test_nodes import RUN, finish, losses, nodes, train, tree

from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.rundir import LOCK_NAME

STEP2, STEP4 = "step_00000002", "step_00000004"


def node_files(out, step=STEP2) -> set[str]:
    return {p.name for p in (out / step).iterdir()}


def run_nodes(outs, *flags) -> list[tuple[str, str]]:
    """The two nodes' launchers, node r with --out outs[r]; both must succeed."""
    per = lambda r: ["--out", outs[r]]  # noqa: E731
    procs = nodes(2, 2, free_port(), [*RUN, "--node-local-checkpoints", *flags], per)
    got = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in got]
    return got


def test_node_local_checkpoints_resume_on_the_same_nodes_and_gathered_on_one(tmp_path, capsys):
    """4 steps on 2 nodes x 2, node-local checkpoints at 2 and 4 (the losses of the run
    uninterrupted). Each node's folder holds its own ranks' files and the same meta.json, which
    names each file's node. From step 2: a resume on 2 nodes x 2 continues bit for bit; one on
    1 node is refused in one line naming node 1 while node 1's files are elsewhere; once they are
    copied over, 1 node x 2 processes (--grad-accum 2: the same rows per step) continues too."""
    outs = [tmp_path / "disk0", tmp_path / "disk1"]
    run_nodes(outs, "--steps", 4, "--save-every", 2)
    whole = losses(outs[0])
    assert len(whole) == 4 and not (outs[1] / "metrics.jsonl").exists()  # rank 0 logs

    mine = [node_files(o) - {"meta.json"} for o in outs]
    assert mine[0] and mine[1] and not mine[0] & mine[1]  # every file on one node only
    assert {n for n in mine[0] if "-r" in n} == {n for n in mine[0] if "-r000" in n or "-r001" in n}
    metas = [(o / STEP2 / "meta.json").read_bytes() for o in outs]
    assert metas[0] == metas[1]
    meta = json.loads(metas[0])
    assert meta["nodes"]["count"] == 2 and meta["nodes"]["per_node"] == 2
    assert meta["nodes"]["files"] == {n: r for r in (0, 1) for n in mine[r]}
    assert not any((o / "run.lock").exists() for o in outs)  # each node's lock was released

    for o in outs:  # back to step 2 on both machines
        shutil.rmtree(o / STEP4)
    run_nodes(outs, "--steps", 4, "--resume")
    assert losses(outs[0]) == whole
    assert all((o / STEP4 / "meta.json").is_file() for o in outs)

    shutil.rmtree(outs[0] / STEP4)
    shutil.rmtree(outs[1] / STEP4)
    before = sorted(p.name for p in (outs[0] / STEP2).iterdir())
    code, err = run_in_process(capsys, "train", *RUN, "--steps", 4, "--out", outs[0], "--resume")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "the files of node(s) 1 are not here" in lines[0] and "rsync -a NODE1:" in lines[0]
    assert sorted(p.name for p in (outs[0] / STEP2).iterdir()) == before

    for name in mine[1]:  # what `rsync -a NODE1:...` does between machines
        shutil.copy2(outs[1] / STEP2 / name, outs[0] / STEP2 / name)
    one = train("--gpus", 2, *RUN, "--steps", 4, "--grad-accum", 2, "--out", outs[0], "--resume")
    [(out, err)] = finish([one])
    assert one.returncode == 0, err[-3000:]
    assert "world size 4 → 2" in out, out
    got = losses(outs[0])
    assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, whole)) < 1e-5, (got, whole)


@pytest.mark.parametrize(
    "engine, flag",
    [(dict(engine="zero", zero_stage=0), "--zero-stage 0"),
     (dict(engine="zero", zero_stage=3, shard_within="node"), "--shard-within node"),
     (dict(engine="ddp"), "--engine ddp")],
)  # fmt: skip
def test_node_local_checkpoints_where_a_rank_would_read_another_machines_files_are_refused(
    monkeypatch, engine, flag
):
    """Where a rank saves or reads more than its own shard (a replicated state, HSDP's machine
    0), another machine would need its files: refused in one line naming the setting."""
    import dataclasses

    import torch

    from fitgpt.data.config import DataConfig
    from fitgpt.dist import DistContext
    from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
    from fitgpt.errors import UserError
    from fitgpt.model import ModelConfig
    from fitgpt.train.assemble import check_node_local
    from fitgpt.train.config import RunConfig, TrainConfig

    model = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=32, vocab_size=96)
    train_cfg = TrainConfig(node_local_checkpoints=True)
    config = RunConfig(model, DataConfig(), train_cfg, EngineConfig(**engine), PrecisionConfig(),
                       OptimConfig())  # fmt: skip
    ctx = DistContext(rank=0, world=4, local_rank=0, device=torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's: 2 machines of 2
    with pytest.raises(UserError) as e:
        check_node_local(config, ctx)
    assert "--node-local-checkpoints needs each rank to save its own shard" in str(e.value)
    assert flag in str(e.value) and "\n" not in str(e.value)
    check_node_local(dataclasses.replace(config, engine=EngineConfig(zero_stage=1)), ctx)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one machine holds every file
    check_node_local(config, ctx)


def test_a_node_missing_its_own_files_is_refused_before_loading(tmp_path, capsys):
    """A resume in the saving shape whose node lacks a file it wrote itself (its --out is another
    folder, or the file was deleted): refused in one line naming the node, nothing loaded."""
    from cli_refusal import run_main

    out = tmp_path / "run"
    args = ["train", *RUN, "--steps", 1, "--out", out, "--node-local-checkpoints"]
    code, _, err = run_main(capsys, *args)
    assert code == 0, err
    meta = json.loads((out / "step_00000001" / "meta.json").read_text())
    assert meta["nodes"] == {"count": 1, "per_node": 1, "files": dict.fromkeys(meta["files"], 0)}
    (out / "step_00000001" / "rng-r000.pt").unlink()
    code, err = run_in_process(capsys, *args[:-1], "--steps", 2, "--resume")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "node(s) 0 lack the files they saved there (rng-r000.pt)" in lines[0]
    assert not (out / "step_00000002").exists()


def lock_owner(out) -> int | None:
    """The pid that RUN/run.lock names, once its owner has written it."""
    try:
        return json.loads((out / LOCK_NAME).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def rank_env(pid: int) -> dict[str, str]:
    """torchrun's variables of a running rank (Linux /proc)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode() for k, v in pairs if k in (b"GROUP_RANK", b"LOCAL_RANK")}


def test_each_node_locks_its_own_out_and_a_second_run_there_is_refused(tmp_path, capsys):
    """2 nodes x 1 with node-local checkpoints: each node's first rank (node 1's is not rank 0)
    holds the lock of its own --out (its pid, on its node). While the job runs, a second run on
    either node's folder is refused in one line naming that node's owner; the job goes on."""
    outs = [tmp_path / "disk0", tmp_path / "disk1"]
    run = [*RUN, "--node-local-checkpoints", "--steps", 100000, "--log-every", 100000]
    procs = nodes(2, 1, free_port(), run, lambda r: ["--out", outs[r]])
    try:
        deadline, owners = time.monotonic() + 120, [None, None]
        while time.monotonic() < deadline and None in owners:
            assert all(p.poll() is None for p in procs), finish(procs)
            owners = [o if o in tree(p.pid) else None for o, p in zip(map(lock_owner, outs), procs)]
            time.sleep(0.2)
        assert None not in owners, f"the locks were never taken: {owners}"
        # each lock is held by its own node's first rank, never by the other node's
        assert [rank_env(pid) for pid in owners] == [
            {"GROUP_RANK": str(r), "LOCAL_RANK": "0"} for r in (0, 1)
        ]
        every = [pid for p in procs for pid in tree(p.pid)]
        for pid in every:  # stopped, the ranks hold their locks and leave the CPU to the refusals
            os.kill(pid, signal.SIGSTOP)
        for out, pid in zip(outs, owners):
            argv = ["train", *RUN, "--node-local-checkpoints", "--steps", 2, "--out", out]
            code, err = run_in_process(capsys, *argv)
            assert_refused(code, err, f"--out {out} is in use by another fitgpt run (pid {pid} on ")
        assert list(map(lock_owner, outs)) == owners and all(p.poll() is None for p in procs)
    finally:  # SIGKILL ends a stopped process too
        for pid in [pid for p in procs if p.poll() is None for pid in tree(p.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in procs:
            p.communicate()


def test_a_diverged_step_is_set_aside_on_every_node(tmp_path):
    """lr 1000 over a long warm-up diverges after some good steps. With node-local checkpoints
    on 2 nodes x 1, the step whose weights gave the first bad step is set aside on both nodes'
    folders, so both keep the same last good step with the same meta.json, each with its own
    files; the job ends in one line naming it."""
    outs = [tmp_path / "disk0", tmp_path / "disk1"]
    run = [*RUN, "--node-local-checkpoints", "--lr", 1000, "--min-lr", 0, "--warmup", 400,
           "--steps", 80, "--save-every", 1, "--keep", 2, "--max-bad-steps", 4]  # fmt: skip
    procs = nodes(2, 1, free_port(), run, lambda r: ["--out", outs[r]])
    got = finish(procs)
    assert [p.returncode for p in procs] == [2, 2], [err[-3000:] for _, err in got]
    rows = [json.loads(x) for x in (outs[0] / "metrics.jsonl").read_text().splitlines()]
    bad = {r["step"] for r in rows if r["loss"] is None or r["grad_norm"] is None}
    last = rows[-1]["step"]
    start = last - 3  # the streak of 4 that stopped the run
    assert last < 80 and set(range(start, last + 1)) <= bad and start - 1 not in bad, bad
    suspect = f"step_{start - 1:08d}"
    lines = [ln for ln in got[0][1].splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in got[0][1], got[0][1][-3000:]
    assert f"{suspect}, whose weights gave the first bad step, is now " in lines[0]
    assert f"{outs[0] / ('diverged.' + suspect)} on every machine" in lines[0]
    assert "Traceback" not in got[1][1], got[1][1][-3000:]
    kept = [[p.name for p in ckpt_io.step_dirs(o)] for o in outs]
    assert kept[0] == kept[1] and kept[0] and kept[0][-1] < suspect, kept
    assert f"the last good checkpoint is {outs[0] / kept[0][-1]}" in lines[0]
    for name in (kept[0][-1], f"diverged.{suspect}"):  # the same meta.json on both nodes
        metas = [(o / name / "meta.json").read_bytes() for o in outs]
        assert metas[0] == metas[1], name
    for r, o in enumerate(outs):  # each node's last good step holds that node's own files
        ckpt_io.verify(o / kept[0][-1], node=r)
        assert not (o / suspect).exists()
