"""The links a collective crosses, and what it costs on them (docs/planner.md "Several machines").

A job of N nodes of G GPUs: W = N·G ranks, ranks r·G..r·G+G-1 on node r (torchrun's order,
dist/nodes.py). Inside a node GPUs talk over NVLink at the probe's bus bandwidth (Rates.bus_gbps,
GB/s); between nodes each GPU has its own NIC (a rail: DGX H100, AWS p5) at Rates.inter_node_gbit
(Gb/s per GPU, as network links are sold: /8 for bytes).

A ring collective over a group moves (k-1)/k of its bytes through every member's link (twice for
an all-reduce: reduce-scatter then all-gather), and a ring is as fast as its slowest hop: a group
that spans nodes, g of its ranks on each, runs at min(intra, g·inter): NCCL runs g rings, each
leaving the node through another GPU's NIC, so each NIC carries 1/g of the bytes. That is the whole model; NCCL's
trees, latency per launch and link contention between the G rings of one node are not priced.

    all_reduce(B)      = 2·(k-1)/k · B / bw        bw: intra if the group is on one node,
    reduce_scatter(B)  =   (k-1)/k · B / bw            else min(intra, g·inter)
    all_gather(B)      =   (k-1)/k · B / bw

Hierarchical sharding (HSDP: ZeRO inside a node, replicas across nodes) reduce-scatters the
gradients over the node's G ranks (intra), then all-reduces each 1/G shard over the N replicas
(inter, every GPU its own shard on its own NIC at once), and gathers weights inside the node only:

    hsdp_reduce(B)     = (G-1)/G · B / intra  +  2·(N-1)/N · (B/G) / inter
"""

from __future__ import annotations

from dataclasses import dataclass

# The inter-node link priced when neither --inter-node-gbps nor a probe says: 400 Gb/s per GPU,
# one 400 Gb/s InfiniBand NDR or RoCE NIC per GPU as on DGX H100 and AWS p5 (3,200 Gb/s per 8
# GPUs). An assumption, not a measurement: a cluster with fewer NICs per node must say its own.
INTER_NODE_GBIT = 400.0


def stated_link(gbit: float | None, flag: str = "--inter-node-gbps") -> float | None:
    """--inter-node-gbps judged, once for `plan` and `train`: a positive number of Gb/s per
    GPU, else one line naming the flag."""
    if gbit is not None and not gbit > 0:
        from fitgpt.errors import UserError

        raise UserError(
            f"{flag} {gbit:g} must be positive: the Gb/s of each GPU's link to the other "
            "nodes (leave it out to use `fitgpt probe`'s measurement, or the assumed "
            f"{INTER_NODE_GBIT:g})"
        )
    return gbit


@dataclass(frozen=True)
class Links:
    """A collective group of `ranks` ranks, `per_node` of them on each node it spans."""

    ranks: int
    per_node: int
    intra_gbps: float  # GB/s bus bandwidth inside a node
    inter_gbit: float  # Gb/s per GPU between nodes

    @classmethod
    def of(cls, ranks: int, per_node: int, rates) -> Links:
        """`ranks` consecutive ranks of a job whose nodes hold `per_node` ranks each."""
        return cls(ranks, min(ranks, max(1, per_node)), rates.bus_gbps, rates.inter_node_gbit)

    @property
    def nodes(self) -> int:
        """How many nodes the group spans."""
        return -(-self.ranks // self.per_node)

    @property
    def ring_bytes_per_s(self) -> float:
        """A ring's rate: its slowest hop's. Once it leaves the node that is the network, but
        not one NIC's: NCCL runs one ring per local GPU of the group, each leaving the node
        through a different GPU (and so a different NIC), so each NIC carries 1/per_node of
        the bytes. Priced at one NIC, a flat ZeRO-3 step of 20 B on two 2-GPU machines came
        out at 80.4 s against the 36.9 measured (benchmarks/results/nodes_x4_h200_2026-11-28)."""
        intra = self.intra_gbps * 1e9
        if self.nodes == 1:
            return intra
        return min(intra, self.per_node * self.inter_gbit / 8 * 1e9)

    def all_reduce(self, nbytes: float) -> float:
        k = self.ranks
        return 2 * (k - 1) / k * nbytes / self.ring_bytes_per_s if k > 1 else 0.0

    def reduce_scatter(self, nbytes: float) -> float:
        k = self.ranks
        return (k - 1) / k * nbytes / self.ring_bytes_per_s if k > 1 else 0.0

    all_gather = reduce_scatter  # the same bytes over the same ring, the other way

    def inside_node(self) -> Links:
        """This group's ranks on one node: the first stage of a hierarchical collective."""
        return Links(self.per_node, self.per_node, self.intra_gbps, self.inter_gbit)

    def across_nodes(self) -> Links:
        """One rank per node, the replicas of a shard: each on its own NIC."""
        return Links(self.nodes, 1, self.intra_gbps, self.inter_gbit)

    def hsdp_reduce(self, nbytes: float) -> float:
        """Gradients reduce-scattered inside the node, then each 1/G shard all-reduced across
        the nodes (HSDP's backward)."""
        node = self.inside_node()
        return node.reduce_scatter(nbytes) + self.across_nodes().all_reduce(nbytes / node.ranks)
