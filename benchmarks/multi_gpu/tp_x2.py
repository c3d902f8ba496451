"""Issue 20 on nvidia-h200-x2: tensor parallelism (T=2) against ZeRO-3 and DDP, through the harness.

Part "speed": GPT-2 1.5 B (48×1600) and the 6.7b preset (32×4096), bf16, seq 1024, 50 steps
(2 warm-up + 48 timed; every step's loss recorded), checkpointing off. The same global batch of
the same samples for every system: ZeRO-3 and DDP take --micro-batch M on each of the 2 ranks,
T=2 takes 2M on its one data-parallel rank (both GPUs share each micro-batch), so the losses
agree step by step and are printed side by side. GPT-2 1.5 B's 25 heads do not split in two: it
runs with 20 heads of 80 (the same parameters and FLOPs) for every system. DDP runs only at
1.5 B: at 6.7 B its 16 bytes per parameter (107 GB) and activations do not fit 141 GB.

Part "seq": the longest sequence (doubling from 2048; 1024 trains in part "speed") that trains
at micro-batch 1 for the 6.7b preset, T=2 against ZeRO-3, checkpointing off (the block
activations, which T splits, dominate), each series stopping at its first failure; then T=2 with
sequence parallelism (tp2sp) if the budget has room left.

Everything is appended to DIR/tp_x2.jsonl (one line per trial, `fitgpt bench sweep`'s records;
re-running resumes) and summarised in DIR/tp_x2_summary.json. Each trial has a time limit, and
no trial starts once --budget seconds have passed (default 540: ~9 minutes on 2×H200). Trials
already in DIR/tp_x2.jsonl are not run again, so `--parts seq` (or the same command) continues
where a spent budget stopped.

Usage (device):  python3 benchmarks/multi_gpu/tp_x2.py --out DIR
Check on CPU:    python3 benchmarks/multi_gpu/tp_x2.py --out DIR --tiny   (gloo, a tiny model, seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SPEED = [  # (label, layers, hidden, heads, micro-batch per rank, systems, trial time limit s)
    ("gpt2-1.5b", 48, 1600, 20, 8, ("tp2", "zero3", "ddp"), 150),
    ("6.7b", 32, 4096, 32, 4, ("tp2", "zero3"), 180),
]
SEQ = (
    "6.7b",
    32,
    4096,
    32,
    ("tp2", "zero3", "tp2sp"),
    2048,
    65536,
    150,
)  # label … first, last, limit
TINY_SPEED = [("tiny", 2, 64, 4, 2, ("tp2", "zero3", "ddp"), 120)]
TINY_SEQ = ("tiny", 2, 64, 4, ("tp2", "zero3", "tp2sp"), 64, 128, 120)


class Harness:
    """`fitgpt bench sweep` trials into one JSONL, within a wall-clock budget."""

    def __init__(self, out: Path, tiny: bool, budget: float) -> None:
        self.out, self.tiny, self.budget, self.t0 = out, tiny, budget, time.time()
        self.jsonl = out / "tp_x2.jsonl"

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def trial(self, system, layers, hidden, heads, mb, seq, steps, warmup, limit) -> dict | None:
        """One trial; its record (None: skipped, the budget is spent)."""
        if self.left() < min(limit, 60):
            print(f"skip {system} {hidden}×{layers} seq {seq}: the budget is spent", flush=True)
            return None
        args = [
            sys.executable, "-m", "fitgpt", "bench", "sweep", "--gpus", "2",
            "--systems", system, "--sizes", str(layers), "--hidden", str(hidden),
            "--heads", str(heads), "--seq-len", str(seq), "--micro-batch", str(mb),
            "--grad-accum", "1", "--checkpointing", "off", "--warmup", str(warmup),
            "--steps", str(steps), "--time-limit", str(int(min(limit, self.left()))),
            "--out", str(self.jsonl),
        ]  # fmt: skip
        if self.tiny:
            args += ["--device", "cpu", "--vocab-size", "512", "--compile", "off"]
        subprocess.run(args, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return last_record(self.jsonl, system, layers, hidden, seq, mb)


def last_record(path: Path, system, layers, hidden, seq, mb) -> dict | None:
    if not path.exists():
        return None
    found = None
    for line in path.read_text().splitlines():
        r = json.loads(line)
        b = r.get("bench", {})
        if (r["system"], r["layers"], b.get("hidden"), b.get("seq_len"), b.get("micro_batch")) == (
            system,
            layers,
            hidden,
            seq,
            mb,
        ):
            found = r
    return found


def speed(h: Harness, rows, steps: int) -> dict:
    """Tokens/s, peak memory and losses per system at the same global batch."""
    out = {}
    for label, layers, hidden, heads, mb, systems, limit in rows:
        recs = {}
        for system in systems:
            per_rank = 2 * mb if system.startswith("tp") else mb  # one DP rank under T=2
            r = h.trial(system, layers, hidden, heads, per_rank, 1024 if not h.tiny else 64,
                        steps - 2, 2, limit)  # fmt: skip
            if r is not None:
                recs[system] = {
                    k: r.get(k)
                    for k in ("status", "reason", "tokens_per_s", "gpu_peak_gib", "step_s")
                }
                recs[system]["losses"] = r.get("losses")
        out[label] = recs
        print_losses(label, recs)
    return out


def print_losses(label: str, recs: dict) -> None:
    names = [s for s in recs if recs[s].get("losses")]
    print(f"\n{label}: " + ", ".join(
        f"{s} {recs[s]['status']} {recs[s].get('tokens_per_s') or 0:,.0f} tok/s "
        f"{recs[s].get('gpu_peak_gib') or 0:.1f} GiB" for s in recs))  # fmt: skip
    if not names:
        return
    print("step " + " ".join(f"{s:>10}" for s in names))
    for i in range(max(len(recs[s]["losses"]) for s in names)):
        cells = [recs[s]["losses"][i] if i < len(recs[s]["losses"]) else float("nan")
                 for s in names]  # fmt: skip
        print(f"{i + 1:4d} " + " ".join(f"{c:10.4f}" for c in cells))


def longest_seq(h: Harness, row) -> dict:
    """Per system, the longest sequence (doubling) that trains at micro-batch 1. The systems
    take turns at each length, so a budget that runs out leaves them at the same depth."""
    label, layers, hidden, heads, systems, first, last, limit = row
    out = {s: {"longest_seq": None, "tried": []} for s in systems}
    alive, seq = list(systems), first
    while alive and seq <= last:
        for system in list(alive):
            r = h.trial(system, layers, hidden, heads, 1, seq, 1, 1, limit)
            if r is None:
                alive.remove(system)
                continue
            out[system]["tried"].append(
                {"seq": seq, "status": r["status"], "gpu_peak_gib": r.get("gpu_peak_gib")}
            )
            if r["status"] == "ok":
                out[system]["longest_seq"] = seq
            else:
                alive.remove(system)
        seq *= 2
    for system, res in out.items():
        print(f"{label} {system}: longest sequence at micro-batch 1: {res['longest_seq']} "
              f"({res['tried']})", flush=True)  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for tp_x2.jsonl and the summary")
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (gloo): a check")
    p.add_argument("--budget", type=float, default=540.0, help="wall seconds for all trials")
    p.add_argument("--parts", default="speed,seq", help="speed, seq or both")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    h = Harness(out, a.tiny, a.budget)
    summary = {"device": "cpu (gloo)" if a.tiny else "2 GPUs"}
    if "speed" in a.parts:
        summary["speed"] = speed(h, TINY_SPEED if a.tiny else SPEED, 5 if a.tiny else 50)
    if "seq" in a.parts:
        summary["longest_seq"] = longest_seq(h, TINY_SEQ if a.tiny else SEQ)
    summary["wall_s"] = time.time() - h.t0
    tmp = out / "tp_x2_summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out / "tp_x2_summary.json")
    print(f"\nwrote {h.jsonl} and {out / 'tp_x2_summary.json'} in {summary['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
