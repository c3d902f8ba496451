"""Parameter streaming on the GPU: the same batches through the zero engine with the host tier in
several placements, recording losses, median step time, peak GPU memory, the step breakdown and
host RSS of each, as JSON lines.

Two models of hidden 4096 (ANCHORS shapes, untied head, micro-batch 8 x 4, bf16, full
checkpointing):
  8 layers (2.03 B): every block's optimizer on the host, with and without streamed weights
    (their losses must be identical: the same arithmetic, only where the weights wait differs);
  38 layers (8.07 B): the planner's placement at that size (24 of 38 blocks' optimizer on the
    host, as in the sweep), and every block streamed (the smallest GPU footprint).
The cases with the delayed update (removed after commit 104145a; docs/offload.md) are in git.

Usage (device): python3 benchmarks/history/tiers_gpu_check.py OUT.jsonl
"""

from __future__ import annotations

import gc
import json
import resource
import statistics
import sys
import time

import torch

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.model import ModelConfig

MICRO, ACCUM = 8, 4
CASES = [
    (8, dict(), 5),  # every block offloaded
    (8, dict(offload_params="cpu"), 5),
    (38, dict(offload_blocks=24), 4),
    (38, dict(offload_params="cpu"), 4),
]


def run(layers: int, placement: dict, steps: int) -> dict:
    model = ModelConfig(
        n_layer=layers, n_embd=4096, n_head=32, seq_len=1024, vocab_size=50257, tie_embeddings=False
    )
    dev = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    ecfg = EngineConfig(engine="zero", checkpointing="full", offload_optimizer="cpu", **placement)
    t0 = time.perf_counter()
    e = build_engine(model, ecfg, PrecisionConfig("bf16"), OptimConfig(), DistContext(0, 1, 0, dev))
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    losses, times, phases = [], [], []
    for _ in range(steps):
        micro = []
        for _ in range(ACCUM):
            x = torch.randint(0, model.vocab_size, (MICRO, model.seq_len + 1), generator=g)
            micro.append((x[:, :-1], x[:, 1:]))
        t0 = time.perf_counter()
        losses.append(e.train_step(micro, 1e-4).loss)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        phases.append(e.breakdown())
    step_s = statistics.median(times[1:])
    out = {
        "layers": layers,
        "params": model.num_params(),
        "placement": placement,
        "losses": losses,
        "step_s": step_s,
        "tflops": model.flops_per_token() * MICRO * ACCUM * model.seq_len / step_s / 1e12,
        "init_s": init_s,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "host_rss_peak_so_far_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "breakdown_last": phases[-1],
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    e.close()
    del e
    gc.collect()  # the engine's hooks hold cycles: free its host state before the next case
    torch.cuda.empty_cache()
    return out


def main(path: str) -> None:
    with open(path, "w") as f:
        for layers, placement, steps in CASES:
            try:
                r = run(layers, placement, steps)
            except Exception as e:  # record and go on: a refusal is a result too
                r = {"layers": layers, "placement": placement, "error": str(e)[:500]}
                print(layers, placement, "error:", r["error"], flush=True)
                f.write(json.dumps(r) + "\n")
                gc.collect()
                continue
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(
                f"{layers:>3} {json.dumps(placement):<75} step {r['step_s']:6.2f} s "
                f"{r['tflops']:5.0f} TF  GPU {r['gpu_peak_gib']:5.1f} GiB  "
                f"losses {' '.join(f'{x:.4f}' for x in r['losses'])}",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1])
