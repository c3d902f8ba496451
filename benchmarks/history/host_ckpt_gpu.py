"""`--checkpointing cpu` on the GPU: the same model and batches with checkpoints kept on the GPU
(`full`) and in pinned host memory (`cpu`), for the zero engine (bf16) and the ddp engine. Records
losses, median step time and peak GPU memory of each, as JSON lines.

Usage (device): python3 benchmarks/history/host_ckpt_gpu.py OUT.jsonl
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

import torch

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.model import ModelConfig

MODEL = ModelConfig(n_layer=8, n_embd=4096, n_head=32, seq_len=1024, tie_embeddings=False)
STEPS, MICRO, ACCUM = 5, 8, 4


def run(engine: str, ckpt: str) -> dict:
    dev = torch.device("cuda")
    ctx = DistContext(0, 1, 0, dev)
    torch.cuda.reset_peak_memory_stats()
    e = build_engine(
        MODEL,
        EngineConfig(engine=engine, checkpointing=ckpt),
        PrecisionConfig("bf16"),
        OptimConfig(),
        ctx,
    )
    g = torch.Generator().manual_seed(0)
    losses, times = [], []
    for _ in range(STEPS):
        micro = []
        for _ in range(ACCUM):
            x = torch.randint(0, MODEL.vocab_size, (MICRO, MODEL.seq_len + 1), generator=g)
            micro.append((x[:, :-1].to(dev), x[:, 1:].to(dev)))
        t0 = time.perf_counter()
        losses.append(e.train_step(micro, 1e-4).loss)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {
        "engine": engine,
        "checkpointing": ckpt,
        "params": MODEL.num_params(),
        "losses": losses,
        "step_s": statistics.median(times[1:]),
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    e.close()  # removes the engine's hooks, so the next run starts from an empty GPU
    del e
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(path: str) -> None:
    with open(path, "w") as f:
        for engine in ("zero", "ddp"):
            for ckpt in ("full", "cpu"):
                r = run(engine, ckpt)
                f.write(json.dumps(r) + "\n")
                f.flush()
                print(
                    f"{engine:<5} {ckpt:<5} step {r['step_s']:.3f} s  GPU {r['gpu_peak_gib']:.1f} GiB"
                    f"  losses {' '.join(f'{x:.4f}' for x in r['losses'])}",
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1])
