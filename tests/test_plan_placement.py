"""The planner prices the Placement, not the ZeRO stage number (issue 49).

`Placement.of` (engine/chunked/placement.py) decodes the engine config once into per-chunk flags: the
optimizer state sharded (ZeRO-1), the gradients reduce-scattered every micro-batch (ZeRO-2),
a block's weights kept as shards and gathered before each use (ZeRO-3), and whether the chunk
engine runs at all (ddp: plain PyTorch). The step-time and memory models (plan/throughput.py,
plan/memory.py) and the planner's streaming rule (plan/enumeration.py can_stream) read those
flags; these tests hold the flags to the stages' meaning at every stage and world, and show that
a price follows the placement it is given whatever stage number the config carries.
"""

import dataclasses
import itertools

import pytest
from helpers import TINY

from fitgpt.engine.chunked.placement import stream_refusal
from fitgpt.engine.config import EngineConfig
from fitgpt.plan.enumeration import can_stream
from fitgpt.plan.fixed import Fixed
from fitgpt.plan.memory import Workload, estimate, placement_of
from fitgpt.plan.rates import DEFAULTS
from fitgpt.plan.throughput import step_time

ENGINES = [("ddp", 0)] + [("zero", s) for s in range(4)]
WORLDS = (1, 2, 4)
# where the blocks' state lives: all on the device, the last block's optimizer state on the
# host, every block's optimizer state on the host with its weights streamed from there
OFFLOADS = {
    "device": {},
    "optimizer": {"offload_optimizer": "cpu", "offload_blocks": 1},
    "streamed": {"offload_optimizer": "cpu", "offload_params": "cpu"},
}
RATES = DEFAULTS["H100"]


def configs(offload: str, **fields) -> list[EngineConfig]:
    """Every engine and stage with these offload fields (ddp offloads nothing: left out)."""
    off = OFFLOADS[offload]
    return [
        EngineConfig(engine=engine, zero_stage=stage, **off, **fields)
        for engine, stage in ENGINES
        if engine == "zero" or not off
    ]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("offload", OFFLOADS)
def test_placement_flags_mean_the_stage(world, offload):
    for e in configs(offload):
        stage = e.zero_stage
        p = placement_of(Workload(TINY, 2, world, "bf16"), e)
        assert p.chunked == (e.engine == "zero")
        assert p.replicated == (stage == 0)  # ZeRO-1 shards the optimizer state
        assert p.scatters_grads == (stage >= 2)  # ZeRO-2 the gradients, every micro-batch
        assert p.gathers_weights == (stage == 3)  # ZeRO-3 the blocks' weights
        assert p.fetches_weights == (stage == 3 or p.streams)
        for c in p.chunks:
            # the embedding and head stay whole at stage 3 (the tied one is used twice)
            assert c.gather_weights == (stage == 3 and c.block)
            if c.gather_weights:
                # a device shard, or (streamed) a host one: gathered either way on W ranks
                assert c.weights in ("sharded", "host") and c.shard * world == c.N
        if offload == "streamed" and stage == 3:
            # no chunk's weights are "sharded" on the device, yet every block is gathered
            assert not any(c.weights == "sharded" for c in p.chunks) and p.gathers_weights


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_prices_follow_the_placement_not_the_stage_number(world, precision):
    """Priced with another engine's or stage's config but this config's placement, a plan's
    step time (every term) and memory estimate (every item) are this config's."""
    work = Workload(TINY, 2, world, precision)
    for offload, compile in itertools.product(OFFLOADS, ("off", "blocks")):
        for a, b in itertools.permutations(configs(offload, compile=compile), 2):
            p = placement_of(work, a)
            assert step_time(work, b, 3, RATES, p) == step_time(work, a, 3, RATES), (a, b)
            want, got = estimate(work, a), estimate(work, b, placement=p)
            assert (got.compute, got.host, got.peak_phase) == (
                want.compute,
                want.host,
                want.peak_phase,
            ), (a, b)


def test_streamed_stage_3_blocks_are_still_gathered():
    """Streaming a stage-3 block's shard in from host RAM does not spare its all-gathers
    (engine/chunked/fetch.py): the communication priced is the unstreamed plan's."""
    work = Workload(TINY, 2, 4, "bf16")
    held = EngineConfig(zero_stage=3, offload_optimizer="cpu")
    streamed = dataclasses.replace(held, offload_params="cpu")
    t_held, t_streamed = (step_time(work, e, 3, RATES) for e in (held, streamed))
    assert t_streamed["comm"] == t_held["comm"] > 0
    once = step_time(work, EngineConfig(zero_stage=2, offload_optimizer="cpu"), 3, RATES)
    assert t_held["comm"] > once["comm"]  # the gathers are what stage 3 adds


@pytest.mark.parametrize("world", WORLDS)
def test_the_planner_streams_where_the_engine_would(world):
    """can_stream says yes exactly where the engine runs the streamed placement."""
    work = Workload(TINY, 2, world, "bf16")
    for e in configs("optimizer"):
        streamed = dataclasses.replace(e, offload_params="cpu")
        runs = placement_of(work, streamed).refusal("bf16") is None
        assert runs == (stream_refusal(world, e.zero_stage) is None)
        assert can_stream(work, e, Fixed.of({})) == runs, e
        assert not can_stream(work, e, Fixed.of({"offload_params": "none"}))
