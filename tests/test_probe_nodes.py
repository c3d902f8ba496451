"""The link between machines: `fitgpt probe` started on several nodes measures it (plan/rates.py),
`fitgpt train --inter-node-gbps` states it, and the plan a multi-node run trains prices its
collectives at whichever the run has (its log names the figure and where it came from)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from cli_refusal import assert_refused, run_in_process
from conftest import free_port
from test_nodes import ENV, RUN, finish


def probe_worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    from fitgpt.dist import init_distributed
    from fitgpt.plan import rates

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 machines of 2 processes, as torchrun sets it
    init_distributed("cpu")
    inside, across = rates._node_groups(2, 2)
    out = {
        "inside": dist.get_process_group_ranks(inside),
        "across": dist.get_process_group_ranks(across),
        "gbit": rates._probe_between_nodes(across, 2, nbytes=1 << 20),
        "bus": rates._probe_collectives(inside, 2, nbytes=1 << 20),
    }
    (Path(tmp) / f"r{rank}.json").write_text(json.dumps(out))


def test_probe_measures_inside_each_machine_and_between_them(tmp_path, gloo):
    """Ranks 0,1 are machine 0 and 2,3 machine 1 (torchrun's order); the link between machines
    is measured by each machine's GPUs at once, each with its counterpart, and every rank caches
    the same figure (the slowest rank's, as a step waits for it)."""
    gloo(4, probe_worker, str(tmp_path))
    res = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(4)]
    assert [r["inside"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["across"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert len({r["gbit"] for r in res}) == 1 and res[0]["gbit"] > 0
    assert all(r["bus"] > 0 for r in res)


def between_line(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith("between nodes:"))


def test_train_prices_the_link_as_stated_else_as_probed(tmp_path):
    """A 2-machine run's plan is priced at --inter-node-gbps when given, else at the probe's
    cached figure (FITGPT_CACHE), and says which."""
    cache = tmp_path / "cache"
    cache.mkdir()
    from fitgpt.plan.rates import DEFAULTS, cache_path

    probed = {**DEFAULTS["cpu"].to_dict(), "inter_node_gbit": 7.5,
              "inter_node_source": "probe across 2 nodes"}  # fmt: skip
    os.environ["FITGPT_CACHE"] = str(cache)
    try:
        cache_path("cpu").write_text(json.dumps(probed))
    finally:
        del os.environ["FITGPT_CACHE"]
    args = [a for a in RUN if a not in ("--plan", "off")] + ["--steps", "1", "--no-save"]
    for extra, want in (([], "7.5 Gb/s per GPU (probe across 2 nodes)"),
                        (["--inter-node-gbps", "25"], "25 Gb/s per GPU (--inter-node-gbps)")):  # fmt: skip
        port, out = free_port(), tmp_path / f"o{len(extra)}"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fitgpt",
                    "train",
                    "--gpus",
                    "1",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(r),
                    "--master-port",
                    str(port),
                    *args,
                    *extra,
                    "--out",
                    str(out),
                ],
                env={**ENV, "FITGPT_CACHE": str(cache)},
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for r in range(2)
        ]
        outs = finish(procs)
        assert [p.returncode for p in procs] == [0, 0], outs
        assert between_line(outs[0][0]) == f"between nodes: {want}"


def test_a_link_that_is_not_positive_is_refused_in_one_line(tmp_path, capsys):
    for cmd in (["train", "--out", str(tmp_path)], ["plan", "--nnodes", "2"]):
        code, err = run_in_process(capsys, *cmd, "--preset", "tiny", "--inter-node-gbps", "0")
        assert_refused(code, err, "--inter-node-gbps 0 must be positive")
