"""Checkpoint save time per GB on this machine's CPU and disk (issue 10, item 3).

Builds the chunked engine for a ~150 M-parameter GPT on the CPU (no training needed: the state
is what it is), then times `checkpoint.save` of full and weights-only checkpoints (the trainer's
own call: state files with their CRCs, RNG files, indexes, meta.json with its checksums, rename),
and separately the `sync` that follows (the page cache written back to the disk), and the CRC-32
rate alone. Usage: PYTHONPATH=. python benchmarks/history/ckpt_save_cpu.py OUT_DIR SCRATCH_DIR
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.model import ModelConfig
from fitgpt.train import checkpoint as ckpt_io

MODEL = ModelConfig(n_layer=8, n_embd=1024, n_head=16, seq_len=1024, vocab_size=50257)
CTX = DistContext(0, 1, 0, torch.device("cpu"))


def timed_save(scratch: Path, engine, optimizer: bool, step: int) -> dict:
    t0 = time.perf_counter()
    path = ckpt_io.save(scratch, step, engine, {"config": {}}, CTX, keep=1, optimizer=optimizer)
    t1 = time.perf_counter()
    os.sync()
    t2 = time.perf_counter()
    size = sum(f.stat().st_size for f in path.iterdir())
    return {
        "optimizer": optimizer,
        "bytes": size,
        "save_s": t1 - t0,
        "sync_s": t2 - t1,
        "save_gb_per_s": size / 1e9 / (t1 - t0),
        "save_and_sync_gb_per_s": size / 1e9 / (t2 - t0),
    }


def main(out: Path, scratch: Path) -> None:
    torch.set_num_threads(1)
    engine = build_engine(
        MODEL,
        EngineConfig(engine="zero", zero_stage=0),
        PrecisionConfig(precision="fp32"),
        OptimConfig(),
        CTX,
        seed=0,
    )
    buf = torch.randn(100_000_000).view(torch.uint8).numpy()  # 400 MB
    t0 = time.perf_counter()
    zlib.crc32(buf)
    crc_rate = buf.nbytes / 1e9 / (time.perf_counter() - t0)
    runs = []
    for i, optimizer in enumerate([True, False] * 4):
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        runs.append(timed_save(scratch, engine, optimizer, i + 1))
        print(json.dumps(runs[-1]), flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    median = {
        kind: {
            key: statistics.median(r[key] for r in runs[2:] if r["optimizer"] == (kind == "full"))
            for key in ("bytes", "save_s", "sync_s", "save_gb_per_s", "save_and_sync_gb_per_s")
        }
        for kind in ("full", "weights")
    }
    record = {
        "what": "checkpoint.save of the chunked engine's state, fp32, 1 rank, CPU",
        "params": MODEL.num_params(),
        "crc32_gb_per_s": crc_rate,
        "median_after_the_first_pair": median,
        "runs": runs,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "save_rate.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
