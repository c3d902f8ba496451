"""Sizes and speeds print in the unit that shows them (fitgpt/units.py), everywhere (issue 33:
a tiny model was "0.00 B" parameters at "0 TFLOP/s"); bench lines stay whole in a pipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fitgpt import units
from fitgpt.bench.report import sweep_table
from fitgpt.bench.sweep import describe
from fitgpt.train.metrics import format_line


def test_params_pick_their_unit():
    assert units.params(39.08e9) == "39.08 B"
    assert units.params(124_439_808) == "124.44 M"
    assert units.params(41_024) == "41.0 K"
    assert units.params(512) == "512"


def test_flops_rates_pick_their_unit():
    assert units.flops_rate(4.5e14) == "450 TFLOP/s"
    assert units.flops_rate(1.25e12) == "1.25 TFLOP/s"
    assert units.flops_rate(3e11) == "300 GFLOP/s"
    assert units.flops_rate(4.2e9) == "4.20 GFLOP/s"
    assert units.tflops(0.0473) == "47.3 GFLOP/s"


TRIAL = {
    "system": "fitgpt",
    "status": "ok",
    "params": 41_024,
    "layers": 2,
    "step_s": 0.01,
    "tokens_per_s": 3200.0,
    "tflops": 0.0021,
    "host_rss_peak_gib": 0.4,
}


def test_a_tiny_models_figures_are_not_zero_in_any_report():
    line = describe(TRIAL)
    assert "41.0 K" in line and "2.10 GFLOP/s" in line and "0.00 B" not in line
    table = sweep_table([TRIAL])
    assert "41.0 K" in table and "2.10 GFLOP/s" in table and "0 TFLOP/s" not in table
    rec = {
        "step": 1,
        "loss": 2.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "ms_per_step": 5.0,
        "tokens_per_s": 3200.0,
        "tflops": 0.0021,
    }
    assert "2.10 GFLOP/s" in format_line(rec)


def test_a_cpu_trial_without_flops_names_none():
    cpu = {k: v for k, v in TRIAL.items() if k != "tflops"}
    assert "FLOP/s" not in describe(cpu) and "FLOP/s" not in sweep_table([cpu])


def test_bench_lines_stay_whole_in_a_pipe():
    """The sweep's console prints to stderr; into a pipe, rich would cut at 80 columns."""
    code = (
        "from fitgpt.bench.sweep import console;"
        "console.print('[1/1] ' + 'x' * 150 + ' 3,200 tok/s', highlight=False, markup=False)"
    )
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["[1/1] " + "x" * 150 + " 3,200 tok/s"]


def test_the_sweep_tables_last_column_tells_a_failed_peer_from_none_tried():
    # a ratio, "no peer fits" (a peer was tried at that size and did not train) or "no peer
    # run" (none was tried: a scaling stage runs fitgpt alone)
    def row(system, status, tps=1000.0):
        r = {"system": system, "layers": 4, "params": 1e9, "status": status, "tokens_per_s": tps}
        return r if status == "ok" else {**r, "reason": "out of memory"}

    assert "no peer run" in sweep_table([row("fitgpt", "ok")])
    table = sweep_table([row("fitgpt", "ok"), row("deepspeed-z3-offload", "oom")])
    assert "no peer fits" in table and "no peer run" not in table
    assert "2.00×" in sweep_table([row("fitgpt", "ok", 2000.0), row("ddp", "ok", 1000.0)])
