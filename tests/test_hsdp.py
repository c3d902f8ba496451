"""Hierarchical sharding (--shard-within node, HSDP) on 2 "machines" of 2 gloo processes each:
the ZeRO state sharded over a machine's 2 ranks and replicated on the other machine, against the
same 4 ranks sharded flat."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import TINY

from fitgpt.dist import init_distributed
from fitgpt.dist.mesh import node_ranks, replica_ranks
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.errors import UserError

STEPS, MICRO, ROWS = 6, 2, 2  # rows per rank per micro-batch


def batches(step: int, rank: int, world: int):
    """Rank `rank`'s micro-batches of step `step`: its rows of one global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, TINY.vocab_size, (MICRO, world * ROWS, TINY.seq_len + 1), generator=g)
    rows = x[:, rank * ROWS : (rank + 1) * ROWS]
    return [(m[:, :-1], m[:, 1:]) for m in rows]


def run(ecfg: EngineConfig, ctx, steps=range(STEPS), engine=None):
    e = engine or build_engine(TINY, ecfg, PrecisionConfig("fp32"), OptimConfig(), ctx)
    stats = [e.train_step(batches(s, ctx.rank, ctx.world), 3e-3) for s in steps]
    return e, [(s.loss, s.grad_norm) for s in stats]


def worker(rank: int, world: int, tmp: str) -> None:
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 machines of 2 (torchrun sets it per machine)
    ctx = init_distributed("cpu")
    out = {}
    for stage in (1, 2, 3):
        flat = EngineConfig(engine="zero", zero_stage=stage)
        node = EngineConfig(engine="zero", zero_stage=stage, shard_within="node")
        e, out[f"flat{stage}"] = run(flat, ctx)
        out[f"flat{stage}_opt"] = e.memory_report()["cpu"]["optimizer"]
        e.close()
        e, out[f"node{stage}"] = run(node, ctx)
        out[f"node{stage}_opt"] = e.memory_report()["cpu"]["optimizer"]
        e.close()
    # the planner's 70 B plan on 2-16 machines (docs/planner.md): stage 3 within the node, the
    # last block's optimizer on the host and its weights streamed from there
    host = dict(engine="zero", zero_stage=3, offload_optimizer="cpu", offload_blocks=1)
    for name, within in (("flat_host", "world"), ("node_host", "node")):
        e, out[name] = run(EngineConfig(**host, offload_params="cpu", shard_within=within), ctx)
        e.close()  # the host optimizer's worker
    # saved half-way by machine 0's ranks alone, resumed by the 4: the same last steps
    node = EngineConfig(engine="zero", zero_stage=3, shard_within="node")
    e, _ = run(node, ctx, range(STEPS // 2))
    folder = Path(tmp) / "ckpt"
    if rank == 0:
        folder.mkdir()
    dist.barrier()
    e.save_state(folder)
    extra = e.extra_state()
    e.close()
    dist.barrier()
    out["files"] = sorted(p.name for p in folder.iterdir())
    again = build_engine(TINY, node, PrecisionConfig("fp32"), OptimConfig(), ctx)
    again.load_state(folder, extra)
    out["resumed"] = run(node, ctx, range(STEPS // 2, STEPS), engine=again)[1]
    (Path(tmp) / f"r{rank}.json").write_text(json.dumps(out))


def test_the_groups_are_machines_and_their_replicas():
    assert node_ranks(4, 2) == [[0, 1], [2, 3]] and replica_ranks(4, 2) == [[0, 2], [1, 3]]
    assert node_ranks(6, 3) == [[0, 1, 2], [3, 4, 5]] and replica_ranks(6, 3)[2] == [2, 5]


@pytest.mark.slow
def test_two_machines_of_two_shard_inside_each_and_train_as_four_flat(tmp_path, gloo):
    """Stages 1-3, and stage 3 with a block's optimizer on the host and its weights streamed:
    the losses and gradient norms of 4 ranks sharded flat, within fp32's
    reduction order (a sum over 4 ranks taken as 2 + 2: (a+b)+(c+d) against gloo's ring
    order, ~1 ulp per element, which Adam's steps carry on at that size); each rank holds 1/2 of
    the optimizer state, not 1/4; a checkpoint written by machine 0 alone resumes all 4."""
    gloo(4, worker, str(tmp_path))
    res = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(4)]
    r0 = res[0]
    for stage in (1, 2, 3, "_host"):
        flat, node = r0[f"flat{stage}"], r0[f"node{stage}"]
        assert len(set(x[0] for x in flat)) == STEPS  # the loss moves
        for (lf, nf), (ln, nn) in zip(flat, node):
            assert ln == pytest.approx(lf, rel=1e-6) and nn == pytest.approx(nf, rel=1e-6)
        if stage != "_host":  # the optimizer state: a machine's 2 hold it all, twice 1/4
            assert r0[f"node{stage}_opt"] == pytest.approx(2 * r0[f"flat{stage}_opt"], rel=0.05)
    # every rank agrees on the loss (it is averaged over the 4, across the machines)
    assert all(r["node3"] == r0["node3"] for r in res)
    assert all(".r002" not in f and "-r002" not in f for f in r0["files"])  # machine 0's ranks
    assert r0["resumed"] == r0["node3"][STEPS // 2 :]


def test_shard_within_node_is_refused_where_it_is_not_built():
    with pytest.raises(UserError, match="--shard-within node"):
        EngineConfig(engine="zero", shard_within="node", tensor_parallel=2)
    with pytest.raises(UserError, match="--shard-within node"):
        EngineConfig(engine="ddp", shard_within="node")
