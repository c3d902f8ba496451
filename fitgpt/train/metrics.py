"""One log line per interval on rank 0, and the same figures in metrics.jsonl.

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
import time
from pathlib import Path

import torch

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
    if "eta_s" in r:
        parts.append(f"{duration(r['elapsed_s'])} elapsed, {duration(r['eta_s'])} left")
    return " | ".join(parts)
