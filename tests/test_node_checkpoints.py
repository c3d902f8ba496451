"""Checkpoints on machines that share no disk (--node-local-checkpoints): 2 nodes x 2 gloo
processes on this one host, each node's --out a folder of its own standing for its own disk."""

import json
import shutil

import pytest
from cli_refusal import run_in_process
from conftest import free_port
from test_nodes import RUN, finish, losses, nodes, train

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
