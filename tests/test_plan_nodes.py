"""The planner on several nodes (plan/links.py, docs/planner.md "Several machines"): each
collective priced on the links it crosses, per-node host RAM, `fitgpt plan --nnodes`."""

import dataclasses

import pytest
from cli_refusal import assert_refused, run_in_process, run_main

from fitgpt.engine.config import EngineConfig
from fitgpt.model import get_preset
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.links import Links
from fitgpt.plan.memory import GiB, Workload, layout_of
from fitgpt.plan.planner import plan
from fitgpt.plan.rates import DEFAULTS
from fitgpt.plan.throughput import step_time

H100 = DEFAULTS["H100"]


def test_a_ring_that_leaves_the_node_runs_at_the_inter_node_link():
    """The docs' formulas, from the inputs: inside a node the bus bandwidth, across nodes the
    slower of it and the node's G NICs' Gb/s over 8 (a ring per local GPU, each leaving by
    another NIC); HSDP's reduce is the node's reduce-scatter plus the cross-node all-reduce of a
    1/G shard, each GPU on its own NIC."""
    r = dataclasses.replace(H100, inter_node_gbit=100.0)
    B, G, N = 3e9, 8, 4
    intra, inter = r.bus_gbps * 1e9, r.inter_node_gbit / 8 * 1e9
    one = Links.of(G, G, r)
    assert one.nodes == 1 and one.all_reduce(B) == pytest.approx(2 * (G - 1) / G * B / intra)
    many = Links.of(N * G, G, r)
    W = N * G
    assert many.nodes == N
    assert many.all_reduce(B) == pytest.approx(2 * (W - 1) / W * B / min(intra, G * inter))
    assert many.reduce_scatter(B) == pytest.approx((W - 1) / W * B / min(intra, G * inter))
    # a group with fewer ranks on each node leaves it through fewer NICs
    strided = Links.of(N * 2, 2, r)
    assert strided.reduce_scatter(B) == pytest.approx((2 * N - 1) / (2 * N) * B / (2 * inter))
    assert many.all_gather(B) == many.reduce_scatter(B)
    hsdp = (G - 1) / G * B / intra + 2 * (N - 1) / N * (B / G) / inter
    assert many.hsdp_reduce(B) == pytest.approx(hsdp)
    assert many.hsdp_reduce(B) < many.all_reduce(B)  # the slow link carries 1/G of the bytes
    # a link faster than the node's bus does not make the ring faster than its slowest hop
    fast = Links.of(N * G, G, dataclasses.replace(r, inter_node_gbit=8 * 10 * r.bus_gbps))
    assert fast.all_reduce(B) == pytest.approx(2 * (W - 1) / W * B / intra)


@pytest.mark.parametrize("stage", [0, 3])
def test_the_step_prices_the_data_parallel_collectives_on_the_links_they_cross(stage):
    """Two nodes of 8 at a slow 25 Gb/s: the step's exposed communication is the formula's
    collective over all 16 ranks at the inter-node rate, less what the backward hides; one node
    of 16 (NVLink throughout) prices the same collective at the bus bandwidth."""
    m = get_preset("gpt2-1.5b")
    r = dataclasses.replace(H100, inter_node_gbit=25.0)
    e = EngineConfig(engine="zero", zero_stage=stage, checkpointing="full")
    ga, G, N = 2, 8, 2
    work = Workload(m, 4, G * N, "bf16", nodes=N)
    t = step_time(work, e, ga, r)
    n, W = sum(c.numel for c in layout_of(m)), G * N
    inter = min(r.bus_gbps * 1e9, G * r.inter_node_gbit / 8 * 1e9)  # the node's 8 NICs
    if stage == 0:  # all-reduced once, behind the last micro-batch's backward
        hidden = 0.9 * t["compute"] / ga * 0.6
        want = 2 * (W - 1) / W * n * work.w / inter - hidden
    else:  # reduce-scattered every micro-batch, gathered before each forward and backward
        moved = (W - 1) / W * n * work.w / inter
        want = moved * ga + 2 * moved * ga - 0.9 * t["compute"] * 0.6
    assert want > 0 and t["comm"] == pytest.approx(want)
    flat = step_time(dataclasses.replace(work, nodes=1), e, ga, r)
    assert flat["comm"] < t["comm"] and flat["compute"] == t["compute"]


def test_host_ram_and_the_host_optimizer_are_each_nodes_own():
    """--cpu-mem is one node's: 2 nodes of 4 fit a plan whose host state one node of 8 could not
    hold, and the host optimizer shares one node's DRAM among that node's ranks only."""
    m = get_preset("2.7b")
    r = H100
    offload = {"offload_optimizer": "cpu", "offload_blocks": m.n_layer, "zero_stage": 1,
               "master": "fp32", "moments": "fp32", "device_moments": "fp32"}  # fmt: skip
    e = EngineConfig(engine="zero", checkpointing="full", **offload)
    one_node = Workload(m, 2, 8, "bf16")
    need = plan(one_node, 1, Hardware("cuda", 8, 80 * GiB, "H100", 0, 16), r, offload)[0]
    host = need.est.host_total  # per rank
    ram = int(host * 6)  # room for 6 ranks' host state on a node
    on_one = plan(one_node, 1, Hardware("cuda", 8, 80 * GiB, "H100", ram, 16), r, offload)
    two = Hardware("cuda", 4, 80 * GiB, "H100", ram, 16, nnodes=2)
    on_two = plan(Workload(m, 2, 8, "bf16", nodes=2), 1, two, r, offload)
    assert not any(c.fits for c in on_one) and on_two[0].fits
    shared = step_time(one_node, e, 1, r)["host_optimizer"]
    apart = step_time(dataclasses.replace(one_node, nodes=2), e, 1, r)["host_optimizer"]
    assert apart < shared


def test_plan_cli_prices_nodes_and_a_slower_network_slows_the_step(capsys):
    """`fitgpt plan --nnodes 2 --gpus 8 --inter-node-gbps G` plans 16 ranks of 2 machines
    without launching anything: it says so, and a slower network never makes a step faster."""
    base = ["plan", "--preset", "gpt2-1.5b", "--gpu-mem", "80GB", "--cpu-mem", "1TB",
            "--device", "cuda", "--gpus", "8", "--nnodes", "2", "--breakdown"]  # fmt: skip

    def step(gbit: str) -> tuple[float, str]:
        code, out, err = run_main(capsys, *base, "--inter-node-gbps", gbit)
        assert code == 0, err
        line = next(x for x in out.splitlines() if x.startswith("step "))
        return float(line.split()[1]), out

    fast, out = step("400")
    assert "2 nodes of 8×" in out and "between nodes: 400 Gb/s per GPU" in out
    slow, _ = step("10")
    assert slow > fast


@pytest.mark.parametrize(
    "flags, names",
    [(["--nnodes", "0"], ["--nnodes 0"]), (["--inter-node-gbps", "0"], ["--inter-node-gbps 0"])],
)
def test_bad_node_figures_are_refused_in_one_line(capsys, flags, names):
    code, err = run_in_process(capsys, "plan", "--device", "cuda", "--gpu-mem", "80GB", *flags)
    assert_refused(code, err, *names)


def test_sharding_within_a_node_is_priced_as_the_docs_say_and_chosen_where_faster():
    """HSDP's step: the node's reduce-scatter and all-gathers at the bus bandwidth and one
    all-reduce of a 1/G shard across the nodes (links.hsdp_reduce); the state is 1/G per rank,
    not 1/W. On a slow network the planner shards within the node when that fits; when only
    the whole job's sharding fits, that is the plan."""
    m = get_preset("gpt2-1.5b")
    r = dataclasses.replace(H100, inter_node_gbit=25.0)
    G, N, ga = 8, 2, 1
    work = Workload(m, 4, G * N, "bf16", nodes=N)
    e = EngineConfig(engine="zero", zero_stage=1, checkpointing="full", shard_within="node")
    t = step_time(work, e, ga, r)
    n = sum(c.numel for c in layout_of(m))
    intra, inter = r.bus_gbps * 1e9, r.inter_node_gbit / 8 * 1e9
    rs = (G - 1) / G * n * work.w / intra
    across = 2 * (N - 1) / N * (n * work.w / G) / inter
    hidden = 0.9 * t["compute"] / ga * 0.6
    assert t["comm"] == pytest.approx(max(0.0, rs + across - hidden) + rs * 0.5)
    flat = step_time(work, dataclasses.replace(e, shard_within="world"), ga, r)
    assert t["comm"] < flat["comm"] and t["optimizer"] == pytest.approx(flat["optimizer"] * N)
    hw = Hardware("cuda", G, 80 * GiB, "H100", 1024 * GiB, 16, nnodes=N)
    chosen = plan(work, ga, hw, r, {})[0]
    assert chosen.fits and chosen.ecfg.shard_within == "node", chosen.name
    assert "sharded within each node" in chosen.name
    # a GPU that holds 1/16 of the state but not 1/8: the whole job's sharding (each one's
    # need: its peak with no block's activations kept, the count fit is decided at)
    state = {"master": "fp32", "moments": "fp32", "device_moments": "fp32",
             "offload_optimizer": "none", "checkpointing": "full"}  # fmt: skip
    need = {w: plan(work, ga, hw, r, {**state, "zero_stage": 3, "shard_within": w,
                                      "keep_activations": 0})[0]
            for w in ("world", "node")}  # fmt: skip
    budget = (need["world"].est.compute_total + need["node"].est.compute_total) // 2
    small = dataclasses.replace(hw, gpu_mem=int(budget / 0.98))
    tight = plan(work, ga, small, r, state)[0]
    assert tight.fits and tight.ecfg.shard_within == "world", tight.name


def test_a_fixed_shard_within_node_is_planned_on_one_node_too():
    """--shard-within node given on one node: the planner prices the plans that shard so (there
    the same bytes as the whole job's), not the defaults with the flag pasted on."""
    work = Workload(get_preset("gpt2-1.5b"), 4, 8, "bf16")
    hw = Hardware("cuda", 8, 80 * GiB, "H100", 1024 * GiB, 16)
    cands = plan(work, 1, hw, H100, {"shard_within": "node"})
    assert cands[0].fits and all(c.ecfg.shard_within == "node" for c in cands)
    assert len({(c.ecfg.zero_stage, c.ecfg.checkpointing) for c in cands}) > 2
