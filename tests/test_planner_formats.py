"""The planner's choice of optimizer-state formats (plan/formats.py), their step-time terms, the
plan table's format and disk-write columns, and the capacity they buy.

Hardware is simulated (Hardware objects, as in test_plan.py): the H100 box of ANCHORS.md, models
of its benchmark protocol (hidden 4096, untied head, micro-batch 8 × 4)."""

import dataclasses
import math
import re

import pytest
import torch
from helpers import TINY, run_config

from fitgpt.bench.config import BenchConfig
from fitgpt.bench.systems import SYSTEMS, bench_run
from fitgpt.cli import main
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.factory import build_engine
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, get_preset
from fitgpt.plan import formats, planner, throughput
from fitgpt.plan.apply import Fixed, plan_run
from fitgpt.plan.capacity import predicted_largest
from fitgpt.plan.formats import LADDER, rungs
from fitgpt.plan.hardware import Hardware
from fitgpt.plan.memory import GiB, Workload, placement_of
from fitgpt.plan.planner import choose, plan, why
from fitgpt.plan.rates import DEFAULTS
from fitgpt.plan.throughput import (
    FP32_HOST_BYTES,
    host_optimizer_exposed,
    host_update_cost,
    step_time,
)
from fitgpt.train.assemble import Settings, assemble

R = DEFAULTS["H100"]
H100 = Hardware("cuda", 1, int(79.2 * GiB), "NVIDIA H100 80GB HBM3", int(118 * GiB), 16)
FP32_STATE = {"master": "fp32", "moments": "fp32", "device_moments": "fp32"}


def work(layers: int) -> Workload:
    m = ModelConfig(n_layer=layers, n_embd=4096, n_head=32, tie_embeddings=False)
    return Workload(m, 8, 1, "bf16")


def fixed_rung(fmt: tuple[str, str, str]) -> dict:
    return dict(zip(formats.FIELDS, fmt))


@pytest.fixture(autouse=True)
def every_format(monkeypatch):
    """These tests exercise the whole ladder; the shipped AUTO_FORMATS (trimmed to what the
    loss measurement allowed) is checked by test_the_shipped_default_leaves_int8_out."""
    monkeypatch.setattr(formats, "AUTO_FORMATS", ("split", "bf16", "int8"))


def test_the_shipped_default_leaves_int8_out(monkeypatch):
    monkeypatch.undo()
    assert "int8" not in formats.AUTO_FORMATS and "bf16" in formats.AUTO_FORMATS
    assert all("int8" not in rung for rung in rungs({}, "bf16"))


def test_a_refusal_names_int8_moments_where_they_would_fit(monkeypatch):
    """int8 moments are never picked by themselves; a model that only they make fit is refused
    with them named as what would fit, and not where the user fixed the moments."""
    monkeypatch.setattr(formats, "AUTO_FORMATS", ("split", "bf16"))  # as shipped
    with pytest.raises(
        UserError, match=r"what fits: 9\d layers .* or this model with --moments int8"
    ):
        choose(work(105), 4, H100, R)
    with pytest.raises(UserError) as refused:
        choose(work(105), 4, H100, R, {"moments": "bf16"})
    assert "int8" not in str(refused.value)
    with pytest.raises(UserError) as refused:  # beyond what int8 moments make fit
        choose(work(150), 4, H100, R)
    assert "int8" not in str(refused.value)


# ---- the ladder -------------------------------------------------------------------------------
def test_the_ladder_keeps_what_the_user_fixed_and_only_the_auto_formats(monkeypatch):
    assert rungs({}, "bf16") == list(LADDER)
    assert all(m == "int8" for _, m, _ in rungs({"moments": "int8"}, "bf16"))
    assert rungs({"moments": "int8"}, "bf16")[:2] == [
        ("fp32", "int8", "fp32"),
        ("split", "int8", "fp32"),
    ]
    # no split master without bf16 working weights to share
    for ladder in (rungs({}, "fp32"), rungs({}, "fp16")):
        assert ladder[0] == ("fp32", "fp32", "fp32") and all(m == "fp32" for m, _, _ in ladder)
        assert ("fp32", "int8", "int8") in ladder
    assert rungs(FP32_STATE, "bf16") == [("fp32", "fp32", "fp32")]
    # the lead trims AUTO_FORMATS after the loss measurement: the ladder then stops short
    monkeypatch.setattr(formats, "AUTO_FORMATS", ("split", "bf16"))
    assert rungs({}, "bf16") == list(LADDER[:4])
    assert rungs({"device_moments": "int8"}, "bf16")[-1] == ("split", "bf16", "int8")


def test_a_model_that_fits_on_the_gpu_with_fp32_state_gets_it():
    """Nothing offloaded: no compact rung is priced, since on the GPU the compact update only
    adds passes (priced slower than the fused fp32 AdamW)."""
    w = Workload(get_preset("2.7b"), 8, 1, "bf16")
    chosen, cands = choose(w, 4, H100, R)
    assert chosen.formats == ("fp32", "-", "fp32") and chosen.placement.offloaded_blocks == 0
    assert {c.rung for c in cands} == {0}  # no compact rung was even priced
    assert all(getattr(chosen.ecfg, f) == "fp32" for f in formats.FIELDS)  # not "auto"
    assert "split" not in chosen.name and "moments" not in chosen.name
    compact, _ = choose(w, 4, H100, R, fixed_rung(("split", "bf16", "bf16")))
    assert compact.compared_time > chosen.compared_time  # it would not have won anyway


def test_an_offloaded_plan_gets_compact_state_where_it_is_faster(monkeypatch):
    """An fp32 plan fits only by offloading (8.07 B on the H100 box): the host AdamW steps bf16
    moments in 0.43 of fp32's time and compact state keeps more blocks on the GPU, so the
    planner takes split + bf16, still listing the fp32 plans it passed over."""
    monkeypatch.undo()  # the shipped AUTO_FORMATS: split and bf16
    w = work(38)
    fp32, _ = choose(w, 4, H100, R, FP32_STATE)
    assert fp32.placement.offloaded_blocks > 0
    chosen, cands = choose(w, 4, H100, R)
    assert chosen.formats[:2] == ("split", "bf16") and chosen.rung > 0
    assert chosen.compared_time <= (1 - planner.SPEED_MARGIN) * fp32.compared_time
    assert chosen.placement.offloaded_blocks < fp32.placement.offloaded_blocks
    listed = [c for c in cands if c.fits and c.formats == ("fp32", "fp32", "fp32")]
    assert listed and min(c.compared_time for c in listed) == fp32.compared_time
    said = why(chosen, cands)
    gain = 100 * (fp32.compared_time / chosen.compared_time - 1)
    assert said.startswith(f"compact state: {gain:.0f}% faster than fp32 state; ")
    assert "no plan fits with less compact" not in said
    # under the margin, or where the host steps compact state slowly, the fp32 plan stays
    saved = 1 - chosen.compared_time / fp32.compared_time
    monkeypatch.setattr(planner, "SPEED_MARGIN", saved + 0.01)
    kept, cands = choose(w, 4, H100, R)
    assert kept.formats == ("fp32", "fp32", "fp32") and kept.rung == 0
    assert f"takes {100 * saved:.0f}% less time, under the" in why(kept, cands)
    monkeypatch.undo()
    slow = {fmt: 3.0 for fmt in throughput.HOST_VS_FP32}  # compact host AdamW at 3× fp32's time
    monkeypatch.setattr(throughput, "HOST_VS_FP32", slow)
    assert choose(w, 4, H100, R)[0].formats == ("fp32", "fp32", "fp32")


def test_speed_keeps_the_formats_the_user_fixed(monkeypatch):
    monkeypatch.undo()
    for field, at in (("moments", 1), ("master", 0)):
        chosen, cands = choose(work(38), 4, H100, R, {field: "fp32"})
        assert getattr(chosen.ecfg, field) == "fp32" and chosen.formats[at] == "fp32"
        assert chosen.rung > 0 and "compact state:" in why(chosen, cands)  # the rest is auto
        assert all(getattr(c.ecfg, field) == "fp32" for c in cands)
    kept, _ = choose(work(38), 4, H100, R, FP32_STATE)
    assert kept.formats == ("fp32", "fp32", "fp32") and kept.placement.offloaded_blocks > 0


def test_int8_is_never_chosen_for_speed(monkeypatch):
    """Even where the model prices int8 moments far below everything else: int8 is not in the
    shipped AUTO_FORMATS, so only its flag stores moments so."""
    cheap = {("split", "int8"): 0.01, ("fp32", "int8"): 0.01}
    monkeypatch.setattr(throughput, "HOST_VS_FP32", {**throughput.HOST_VS_FP32, **cheap})
    allowed, _ = choose(work(50), 4, H100, R)  # the lead's override (every_format) allows it
    assert "int8" in allowed.formats
    monkeypatch.setattr(formats, "AUTO_FORMATS", ("split", "bf16"))  # as shipped
    for layers in (38, 50):
        chosen, cands = choose(work(layers), 4, H100, R)
        assert chosen.rung > 0 and all("int8" not in c.formats for c in cands)


def test_a_model_that_needs_the_room_gets_the_least_compact_formats_that_fit_or_faster():
    for layers in (60, 70, 90, 100, 114):  # first fit at rungs 1 to 5
        chosen, _ = choose(work(layers), 4, H100, R)
        fmt = tuple(getattr(chosen.ecfg, f) for f in formats.FIELDS)
        r = LADDER.index(fmt)
        assert r > 0 and chosen.rung == r and chosen.fits
        assert formats.label(chosen.formats) in chosen.name and "master" in chosen.name
        # the first rung with which some plan fits; below it none does
        fitting = [
            [c for c in plan(work(layers), 4, H100, R, fixed_rung(f)) if c.fits] for f in LADDER
        ]
        first = next(i for i, cs in enumerate(fitting) if cs)
        assert first > 0 and r >= first
        best = min(c.compared_time for c in fitting[first])
        if r == first:  # of the first rung's plans, the fastest
            assert chosen.compared_time == best
        else:  # a more compact rung only for a margin of speed, and its fastest plan
            assert chosen.compared_time <= (1 - planner.SPEED_MARGIN) * best
            assert chosen.compared_time == min(c.compared_time for c in fitting[r])


def test_the_formats_the_user_fixed_are_kept():
    big = work(70)  # needs compact state
    chosen, _ = choose(big, 4, H100, R, {"master": "fp32"})
    assert chosen.ecfg.master == "fp32" and chosen.formats[0] == "fp32"
    assert chosen.ecfg.moments != "fp32"  # the ladder climbs with the fields left auto
    small, _ = choose(work(4), 4, H100, R, {"moments": "int8", "device_moments": "bf16"})
    # int8 for the offloaded blocks of a plan that offloads none stores nothing: the plan says
    # fp32 (as flags, --moments int8 with no tier would be refused as changing nothing)
    assert (small.ecfg.moments, small.ecfg.device_moments) == ("fp32", "bf16")
    assert small.formats == ("fp32", "-", "bf16")  # master left auto: fp32, since it fits
    with pytest.raises(UserError, match="do not fit"):
        choose(work(70), 4, H100, R, FP32_STATE)  # fixed formats are never made more compact


# ---- capacity and the disk --------------------------------------------------------------------
def test_the_largest_model_grows_with_the_formats(monkeypatch):
    """`fitgpt capacity`'s prediction: fitgpt (formats auto) against fitgpt-no-compact (--master
    fp32 --moments fp32 --device-moments fp32) and fitgpt-int8 (--moments int8), on the same
    simulated H100 box."""
    bench = BenchConfig(hidden=6144, heads=48)

    def largest(system: str) -> int:
        s = SYSTEMS[system]
        run = bench_run(bench.model(1), bench, s.precision, "cuda")
        return predicted_largest(run, H100, R, Fixed.of(s.plan_fixed(bench)))

    monkeypatch.setattr(formats, "AUTO_FORMATS", ("split", "bf16"))  # as shipped
    fp32, auto, int8 = largest("fitgpt-no-compact"), largest("fitgpt"), largest("fitgpt-int8")
    monkeypatch.setattr(formats, "AUTO_FORMATS", ("split",))
    split = largest("fitgpt")
    assert fp32 < split < auto < int8  # int8 moments: an opt-in beyond the default formats
    assert bench.model(auto).num_params() > 1.5 * bench.model(fp32).num_params()
    assert bench.model(int8).num_params() > 1.8 * bench.model(fp32).num_params()


def test_compact_formats_keep_state_off_the_disk():
    w = work(68)
    hw = dataclasses.replace(
        H100, cpu_mem=int(122 * GiB), nvme_path="(planned)", nvme_free=int(51 * GiB)
    )
    # fp32 state would fit only with the disk: a compact rung in RAM comes first
    chosen, _ = choose(w, 4, hw, R)
    assert chosen.rung > 0 and chosen.placement.nvme_blocks == 0 and chosen.disk_written == 0
    fp32, _ = choose(w, 4, hw, R, FP32_STATE)  # fp32 fixed: the disk holds what RAM cannot
    assert fp32.formats == ("fp32", "fp32", "fp32") and fp32.ecfg.nvme_blocks > 0
    per = fp32.placement.disk_traffic()[1] / fp32.placement.on_disk_elems()
    assert fp32.disk_written == fp32.placement.disk_traffic()[1] and per == 12
    # bf16 moments (the user's choice): host RAM holds what fp32 state spilled to the disk (the
    # master split where that is faster at all: it trains as the fp32 master does)
    bf16, _ = choose(w, 4, hw, R, {"moments": "bf16"})
    assert bf16.formats[1:] == ("bf16", "fp32") and bf16.placement.nvme_blocks == 0
    # and where the disk is used anyway, it holds 8 bytes per element, not 12
    nvme = {"offload_optimizer": "nvme", "nvme_path": "/x"}
    forced, _ = choose(w, 4, hw, R, {"moments": "bf16", **nvme})
    assert forced.fits and forced.placement.on_disk_elems() > 0
    assert forced.placement.disk_traffic()[1] == 8 * forced.placement.on_disk_elems()
    # the disk ruled out: the ladder climbs until host RAM holds the state
    ram, _ = choose(w, 4, hw, R, {"offload_optimizer": "cpu"})
    assert ram.fits and ram.rung > 0 and ram.disk_written == 0 and ram.est.nvme == {}


# ---- the step-time model ------------------------------------------------------------------------
def offloaded(
    fmt: tuple[str, str, str], tier: str = "cpu", speculative: bool = False
) -> tuple[Workload, EngineConfig]:
    """A small model with every block's optimizer state on `tier` (no forward to hide behind,
    and without the speculative update, no backward either)."""
    w = Workload(ModelConfig(n_layer=4, n_embd=256, n_head=4, seq_len=64), 2, 1, "bf16")
    e = EngineConfig(offload_optimizer=tier, nvme_path="/x" if tier == "nvme" else "",
                     speculative_update=speculative)  # fmt: skip
    return w, formats.with_formats(e, fmt)


def exposed(fmt, rates, tier: str = "cpu", speculative: bool = False) -> float:
    w, e = offloaded(fmt, tier, speculative)
    return host_optimizer_exposed(w, 1, 1.0, rates, placement_of(w, e))


def test_the_speculative_update_is_priced_as_the_clipped_step():
    """Measured runs clip nearly every early step, where the guess gives no overlap
    (docs/offload.md): the step model must not promise one."""
    slow = dataclasses.replace(R, cpu_adam_params_per_s=1e5)  # the host's work exceeds the step
    # through the step model's entry point, which sees the whole engine config
    (w, plain), (_, spec) = (offloaded(("fp32",) * 3, speculative=s) for s in (False, True))
    t_plain, t_spec = (step_time(w, e, 1, slow) for e in (plain, spec))
    assert t_plain["host_optimizer"] > 0 and t_spec == pytest.approx(t_plain)


def test_the_host_update_costs_the_bytes_its_formats_move(monkeypatch):
    monkeypatch.setattr(throughput, "HOST_VS_FP32", {})  # formats not measured: their bytes
    w, e = offloaded(("split", "bf16", "fp32"))
    chunk = next(c for c in placement_of(w, e).hosted)
    assert host_update_cost(chunk, 2) == (2 + 8 + 2 * 4) / FP32_HOST_BYTES
    w, e = offloaded(("fp32", "fp32", "fp32"))
    assert host_update_cost(next(c for c in placement_of(w, e).hosted), 2) == 1.0
    # all blocks offloaded, so nothing overlaps: the host term is the pipeline's time itself
    assert exposed(("split", "bf16", "fp32"), R) == pytest.approx(
        exposed(("fp32", "fp32", "fp32"), R) * 18 / FP32_HOST_BYTES
    )
    assert exposed(("split", "int8", "fp32"), R) < exposed(("split", "bf16", "fp32"), R)


def test_measured_host_rates_replace_the_byte_count(monkeypatch):
    w, e = offloaded(("split", "bf16", "fp32"))
    chunk = next(c for c in placement_of(w, e).hosted)
    monkeypatch.setitem(throughput.HOST_VS_FP32, ("split", "bf16"), 1.3)  # slower than fp32
    assert host_update_cost(chunk, 2) == 1.3
    assert exposed(("split", "bf16", "fp32"), R) == pytest.approx(
        exposed(("fp32", "fp32", "fp32"), R) * 1.3
    )


def test_a_split_master_brings_the_weights_down_and_the_disk_moves_the_formats_bytes():
    slow_pcie = dataclasses.replace(R, d2h_gbps=1e-3, h2d_gbps=1e-3)  # the copies dominate
    # fp32: gradients down, weights up; split: the working weights down too (its high half)
    ratio = exposed(("split", "fp32", "fp32"), slow_pcie) / exposed(("fp32",) * 3, slow_pcie)
    assert ratio == pytest.approx(1.5)
    slow_disk = dataclasses.replace(R, nvme_read_gbps=1e-3, nvme_write_gbps=1e-3)
    fp32 = exposed(("fp32",) * 3, slow_disk, "nvme")
    w, e = offloaded(("fp32", "fp32", "fp32"), "nvme")
    read, written = placement_of(w, e).disk_traffic()
    assert fp32 == pytest.approx(read / 1e6 + written / 1e6)
    assert exposed(("split", "int8", "fp32"), slow_disk, "nvme") == pytest.approx(
        fp32 * (2 + 2 * (1 + 4 / 2048)) / 12, rel=1e-3
    )


# ---- `fitgpt plan`'s table ------------------------------------------------------------------
def plan_cli(capsys, *extra: str) -> str:
    args = ["plan", "--preset", "6.7b", "--layers", "68", "--no-tie-embeddings", "--device"]
    args += ["cuda", "--gpu-mem", "79.2GiB", "--cpu-mem", "122GiB", "--nvme", "51GiB", *extra]
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 0
    return capsys.readouterr().out


def chosen_row(out: str) -> list[str]:
    return next(line for line in out.splitlines() if line.startswith(">")).split()


def test_the_plan_table_shows_formats_and_disk_writes(capsys):
    fp32 = ["--master", "fp32", "--moments", "fp32", "--device-moments", "fp32"]
    out = plan_cli(capsys, *fp32)  # fp32 state: only the disk makes room
    head = next(line for line in out.splitlines() if "fits" in line)
    assert "state" in head and "disk GB/step" in head and "TB/1k steps" in head
    row = chosen_row(out)
    assert row[1] == "yes" and row[4] == "fp32/fp32/fp32"
    hw = Hardware("cuda", 1, int(79.2 * GiB), "(planned GPU)", 122 * GiB, 1, "(planned)", 51 * GiB)
    # the run the CLI planned: train's batch defaults, and with no --data the preset's own
    # vocabulary (it priced train's default data's 256 bytes before: cli/plan.py planned_run)
    mb, ga = map(int, re.search(r"micro-batch (\d+) × (\d+) accumulation", out).groups())
    m = work(68).model
    chosen, _ = choose(Workload(m, mb, 1, "bf16"), ga, hw, R, FP32_STATE)
    gb = f"{chosen.disk_written / 1e9:.1f}"
    assert row[5] == gb and row[6] == gb  # GB per step = TB per 1,000 steps
    assert re.search(rf"disk tier: {gb} GB written per step .* {gb} TB per 1,000 steps", out)
    # formats left to the planner: compact state in RAM before the disk; no disk figures
    for extra in ((), ("--offload-optimizer", "cpu")):
        out = plan_cli(capsys, *extra)
        row = chosen_row(out)
        assert row[4] != "fp32/fp32/fp32" and row[4].startswith("split/")
        said = next(ln for ln in out.splitlines() if ln.startswith("chosen:"))
        assert "split master" in said and "disk tier:" not in out


# ---- the chosen formats reach the engine ----------------------------------------------------
def test_train_builds_the_engine_in_the_formats_the_planner_chose(tmp_path):
    """`fitgpt train`'s path (train/assemble.py: rank 0 plans, the EngineConfig is handed over)
    on a CPU whose stated RAM (--cpu-mem) holds the tiny model's state only in compact formats."""
    run = run_config(tmp_path, engine="zero", precision="bf16")
    ctx = DistContext(0, 1, 0, torch.device("cpu"))
    cpu = Hardware("cpu", 1, 0, "cpu", 64 * GiB, 1)

    def need(fixed: dict) -> int:  # the leanest plan's
        return min(c.est.host_total for c in plan_run(run, cpu, R, Fixed.of(fixed)).candidates)

    fp32, least = need(FP32_STATE), need(fixed_rung(LADDER[-1]))
    stated = (fp32 + least) // 2  # --cpu-mem, as the run's config carries it
    run = dataclasses.replace(run, engine=dataclasses.replace(run.engine, cpu_mem=stated))
    said = []
    planned = assemble(Settings(run, Fixed()), ctx, log=said.append).config
    e = planned.engine
    assert e.device_moments != "fp32" and e.master == "split" and "split master" in said[0]
    assert e.cpu_mem == stated  # the plan's EngineConfig carries it on to the engine
    engine = build_engine(planned.model, e, planned.precision, planned.optim, ctx)
    assert all(c.compact is not None for c in engine.chunks)  # every chunk in compact formats
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1))
    assert math.isfinite(engine.train_step([(x[:, :-1], x[:, 1:])], 1e-3).loss)


def test_on_several_ranks_the_planner_streams_weights_only_at_stage_3():
    """The engine refuses --offload-params cpu at stages 1-2 on several ranks: no plan the
    planner offers may need it (found on 2×H200 at 40.64 B: zero-2 with streamed weights)."""
    m = get_preset("20b").replace(n_layer=89, vocab_size=50304)
    hw = Hardware("cuda", 2, 143771 * 2**20, "NVIDIA H200", 230 * GiB, 32)  # as measured
    _, cands = choose(Workload(m, 8, 2, "bf16"), 4, hw, R)
    streamed = [c for c in cands if c.ecfg.offload_params == "cpu"]
    assert streamed and all(c.ecfg.zero_stage == 3 for c in streamed)
    assert cands[0].fits


def test_the_streamed_variant_is_priced_when_the_optimizer_alone_fits_too():
    """13b on one H100, compiled: all 40 blocks' optimizer state on the host fits without
    streaming, and that variant used to be the only one priced (6.3 s per step measured); the
    streamed variant (fewer blocks on the host, 5.2-5.3 s) is priced beside it and chosen
    (results/offload_compile_h100_2026-11-24)."""
    hw = Hardware("cuda", 1, int(79.2 * GiB), "NVIDIA H100 80GB HBM3", int(125 * GiB), 16)
    work = Workload(get_preset("13b"), 8, 1, "bf16", device="cuda")
    best, cands = choose(work, 4, hw, DEFAULTS["H100"], {"compile": "on"})
    offloaded = [c for c in cands if c.fits and c.placement and c.placement.offloaded_blocks]
    kinds = {c.ecfg.offload_params for c in offloaded}
    assert kinds == {"cpu", "none"}  # both variants were priced
    assert best.ecfg.offload_params == "cpu"
    unstreamed = min(c.compared_time for c in offloaded if c.ecfg.offload_params == "none")
    assert best.compared_time < unstreamed


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_work_overlaps_the_next_forward_only_where_no_gather_waits_for_it(stage):
    """Stages 1-2 on several ranks all-gather the host's new shards inside the step, so the
    host's work cannot hide behind the next forward (engine/chunked/update.py); on one rank, or at
    stage 3 (blocks gathered as they run), the device-homed blocks' forward comes first."""
    m = ModelConfig(n_layer=8, n_embd=256, n_head=4, seq_len=64)
    e = EngineConfig(engine="zero", zero_stage=stage, offload_optimizer="cpu", offload_blocks=2,
                     speculative_update=False)  # fmt: skip
    slow = dataclasses.replace(R, cpu_adam_params_per_s=1e5)  # host work longer than the window

    def hidden(world: int) -> float:
        """Seconds of the host's work the next forward hides (1 s of compute against none)."""
        w = Workload(m, 2, world, "bf16")
        p = placement_of(w, e)
        alone = host_optimizer_exposed(w, 1, 0.0, slow, p)
        assert alone > 1.0  # the host's whole work, longer than any window here
        return alone - host_optimizer_exposed(w, 1, 1.0, slow, p)

    window = 1.0 / 3 * 6 / 8  # a third of the micro-batch, over the 6 device-homed blocks
    assert hidden(1) == pytest.approx(window)
    assert hidden(2) == pytest.approx(0.0 if stage < 3 else window)


def test_the_ranks_of_one_host_share_its_disk():
    """Every rank's disk-homed state goes through the one disk under --nvme-path: at W ranks on
    a host each gets 1/W of the bandwidth one process probed; on two hosts each has its own."""
    slow_disk = dataclasses.replace(R, nvme_read_gbps=1e-3, nvme_write_gbps=1e-3)
    m = ModelConfig(n_layer=4, n_embd=256, n_head=4, seq_len=64)
    e = formats.with_formats(
        EngineConfig(engine="zero", zero_stage=3, offload_optimizer="nvme", nvme_path="/x",
                     speculative_update=False), ("fp32",) * 3,
    )  # fmt: skip

    def disk_s(world: int, nodes: int = 1) -> tuple[float, int]:
        w = Workload(m, 2, world, "bf16", nodes=nodes)
        p = placement_of(w, e)
        read, written = p.disk_traffic()
        return host_optimizer_exposed(w, 1, 0.0, slow_disk, p), read + written

    one, moved1 = disk_s(1)
    four, moved4 = disk_s(4)
    assert one == pytest.approx(moved1 / 1e6)  # the disk is the pipeline's slowest stage
    assert four == pytest.approx(4 * moved4 / 1e6)  # 4 ranks' traffic through one disk
    two_hosts, moved = disk_s(4, nodes=2)
    assert two_hosts == pytest.approx(2 * moved / 1e6)  # 2 ranks a host, a disk each


def test_a_split_master_alone_is_taken_for_any_speed_it_saves(capsys):
    """A rung that changes only the master to split trains as fp32 state does (bf16 weights
    unchanged, the master exact but for one-ulp ties), so it needs no margin: Qwen3-30B-A3B on
    4 H200-sized GPUs with fp32 moments, where the fp32 master's plan offloads three blocks'
    experts and the split master's, priced 5% faster, offloads nothing, takes the split master.
    bf16 moments (lossy) still need SPEED_MARGIN
    (test_an_offloaded_plan_gets_compact_state_where_it_is_faster)."""
    from cli_refusal import run_main

    argv = ("plan", "--preset", "qwen3-moe-30b-a3b", "--gpus", "4", "--gpu-mem", "139GiB",
            "--cpu-mem", "470GB", "--seq-len", "4096", "--device", "cuda",
            "--moments", "fp32", "--device-moments", "fp32")  # fmt: skip

    def chosen(*more: str) -> tuple[str, float]:
        code, out, err = run_main(capsys, *argv, *more)
        assert code == 0, err
        line = next(x for x in out.splitlines() if x.startswith("chosen:"))
        plan = r"chosen: (.*?) \(predicted [0-9.]+ GiB per rank, ([0-9.]+) s/step"
        name, seconds = re.match(plan, line).groups()
        return name, float(seconds)

    name, fast = chosen()
    assert name.endswith("split master") and "offloaded" not in name and "moments" not in name
    kept, fp32 = chosen("--master", "fp32")
    assert "split" not in kept and fast < fp32 < fast / (1 - planner.SPEED_MARGIN)
    plain = ("fp32", "fp32", "fp32")
    assert formats.lossless(("split", "fp32", "-"), plain)
    assert not formats.lossless(("split", "bf16", "fp32"), plain)
    assert formats.lossless(("split", "int8", "fp32"), ("fp32", "int8", "fp32"))  # int8 fixed
