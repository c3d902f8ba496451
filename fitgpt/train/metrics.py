"""One log line per interval on rank 0, and the same figures in metrics.jsonl.

StepMetrics makes the records from the steps' stats and the engine's counters (its time
breakdown, the compiled regions): a train record per logging interval, an eval record per
evaluation, one compile record after the first step.

Model FLOPs follow the ANCHORS protocol: (6·N + 12·L·h·S) per token, recompute not counted, so
MFU here compares directly with the peers' figures.

metrics.jsonl is strict JSON, one object per line: a NaN or infinite value (a diverging loss,
an fp16 overflow's gradient norm) is written as null. On a resume the records of steps after
the checkpoint's are dropped (the file is rewritten and renamed into place), so re-run steps
appear once.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from fitgpt.dist import DistContext
from fitgpt.engine.base import Engine, StepStats
from fitgpt.engine.timing import PHASES
from fitgpt.engine.transforms.compile import report_line
from fitgpt.errors import UserError
from fitgpt.units import tflops

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, matched by substring of the device name.
PEAK_BF16 = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
}


def say(ctx: DistContext, msg: str) -> None:
    """One line on rank 0's stdout."""
    if ctx.is_main:
        print(msg, flush=True)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak
    return None


class MetricsLog:
    """Appends JSON lines to run_dir/metrics.jsonl (rank 0) and mirrors to TensorBoard if present."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))
            except Exception:  # tensorboard is optional
                self.tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        line = json.dumps(strict(record), allow_nan=False)
        try:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        except OSError as e:
            raise UserError(f"{self.path}: cannot append a record ({e.strerror})") from None
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self.tb.add_scalar(
                        f"{record.get('kind', 'train')}/{k}", v, record.get("step", 0)
                    )

    def drop_after(self, step: int) -> None:
        """Keep the records of steps <= `step` (a resume from that step logs the rest again);
        a line a killed run left half-written goes too."""
        if not self.enabled or not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or rec.get("step", 0) <= step:
                kept.append(line + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class StepMetrics:
    """The records of one run's steps, each written to `log` and said as one line on rank 0.
    `flops_per_token`: the run's model FLOPs per token (RunConfig.flops_per_token), what its
    TFLOP/s and MFU count; `tokens` per step counts every data-parallel rank's; `steps` is the
    run's length (the ETA)."""

    def __init__(
        self,
        log: MetricsLog,
        ctx: DistContext,
        engine: Engine,
        flops_per_token: float,
        steps: int,
        tokens: int,
    ) -> None:
        self.log, self.ctx, self.engine = log, ctx, engine
        self.flops_per_token = flops_per_token
        self.steps, self.tokens_per_step = steps, tokens
        self.peak = peak_flops(ctx.device)
        self._counts: dict[str, float] = {}  # the engine's counters at the last train record

    def train(
        self, stats: StepStats, step: int, lr: float, skipped: int, window: list[float], t0: float
    ) -> dict:
        """One log line and metrics record for the steps whose seconds are `window`, the last
        one `step`; `skipped`: fp16 steps skipped in the whole run; `t0`: when fit() began. The
        ETA is the steps left at the median step time."""
        ctx, ms = self.ctx, 1000 * statistics.median(window)
        rec = {
            "kind": "train",
            "step": step,
            "loss": stats.loss,
            "lr": lr,
            "loss_scale": stats.loss_scale,
            "skipped": skipped,
            "grad_norm": stats.grad_norm,
            "ms_per_step": ms,
            "tokens_per_s": self.tokens_per_step / (ms / 1000),
        }
        flops = self.flops_per_token * rec["tokens_per_s"] / ctx.world
        if ctx.device.type == "cpu":  # the count can change while the run trains
            rec["cpu_threads"] = torch.get_num_threads()
        if ctx.device.type == "cuda":
            rec["tflops"] = flops / 1e12  # per GPU
            rec["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
            if self.peak:
                rec["mfu"] = flops / self.peak
        report = self.engine.compile_report()
        rec["compiled"] = bool(report and report["regions"])
        if report is not None:
            rec["compile_s"] = report["compile_s"]  # so far: ms_per_step is a median beside it
        rec.update(self.breakdown(len(window)))
        rec.update(router_record(self.engine))
        rec["elapsed_s"] = time.perf_counter() - t0
        rec["eta_s"] = (self.steps - step) * ms / 1000
        self.log.write(rec)
        say(ctx, format_line(rec))
        return rec

    def breakdown(self, steps: int) -> dict:
        """Where the steps' time went (engine.breakdown): the last step's phases in seconds, the
        host optimizer's counters as seconds per step over the steps since the last record
        (worker busy, main-thread waits, copies), and the speculative update's run totals."""
        counts, out = self.engine.breakdown(), {}
        run_totals = ("speculated_steps_total", "rollbacks_total")
        out.update({f"{k}_s": counts[k] for k in PHASES if k in counts})
        for key, v in counts.items():
            if key in run_totals:
                out[key.removesuffix("_total")] = v
            elif key.endswith("_total"):
                name = key.removesuffix("_total")
                name += "" if name.endswith("_gb") else "_s"
                out[name] = (v - self._counts.get(key, 0.0)) / max(steps, 1)
        self._counts = counts
        return out

    def eval(self, rec: dict) -> None:
        """An evaluation's record (Trainer.evaluate) and its line."""
        self.log.write(rec)
        say(
            self.ctx,
            f"eval step {rec['step']} | val loss {rec['val_loss']:.4f} | ppl {rec['val_ppl']:.2f}",
        )

    def compiled(self, step: int) -> None:
        """--compile on: one log line and one metrics record of the compiled regions, their
        graph breaks, recompiles and compile seconds (engine/transforms/compile.py)."""
        report = self.engine.compile_report()
        if report is not None:
            self.log.write({"kind": "compile", "step": step, **report})
            say(self.ctx, report_line(report))


def router_record(engine: Engine) -> dict:
    """A mixture of experts' router figures since the last record (model/families/qwen3_moe
    MoeLlama.router_report: the mean aux loss, each sparse layer's share of the assignments
    per expert, the busiest expert over the even share), this rank's batches; {} for a dense
    model. Read from the engine's model, whose forwards keep them (the engines return only
    the loss)."""
    report = getattr(getattr(engine, "model", None), "router_report", None)
    return report() if report is not None else {}


def strict(value):
    """`value` with every NaN/inf float replaced by None (JSON null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def duration(seconds: float) -> str:
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


def format_line(r: dict) -> str:
    parts = [f"step {r['step']:>6}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}"]
    parts.append(f"scale {r.get('loss_scale', 1.0):.0f}")
    if r.get("skipped"):
        parts.append(f"skipped {r['skipped']}")
    parts += [
        f"gnorm {r['grad_norm']:.3f}",
        f"{r['ms_per_step']:.0f} ms/step",
        f"{r['tokens_per_s']:,.0f} tok/s",
    ]
    if "tflops" in r:
        parts.append(tflops(r["tflops"]))
    if "mfu" in r:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if "peak_gib" in r:
        parts.append(f"peak {r['peak_gib']:.1f} GiB")
    if "router_aux_loss" in r:  # a mixture of experts: a collapsing router shows here
        parts.append(f"aux {r['router_aux_loss']:.4f}, busiest expert {r['expert_load_max']:.2f}×")
    if "eta_s" in r:
        parts.append(f"{duration(r['elapsed_s'])} elapsed, {duration(r['eta_s'])} left")
    return " | ".join(parts)
