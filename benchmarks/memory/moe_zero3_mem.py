"""Where a ZeRO-3 mixture-of-experts step's GPU memory goes, against the planner's items.

Qwen3-MoE-30B-A3B's width (2048 hidden, 128 experts of 768, top 8) with a few layers, trained by
the chunk engine at ZeRO stage 3 with activation checkpointing `full`, one rank, random tokens: the
same fetch/free hooks, gradient reductions and recompute as the 4-GPU runs that ran out of memory
on 2026-11-28 (benchmarks/results/moe_x4_h200_2026-11-28/before_fix).
torch.cuda.memory._record_memory_history records every allocation from before the engine is built;
the trace is replayed to the moment of the step's peak, and the blocks alive then are printed
largest first with their short Python stacks, grouped by what allocated them (state, gathered
weights, gradient reductions, the recompute, the forward, autograd's backward). Also printed: the
bytes allocated at each block's backward (they should not grow as the backward goes down the
blocks) and which blocks' weights are resident then (at most two), and the planner's items
(plan/memory.py estimate) beside what was measured: the state per kind (engine.memory_report) and
the rest.

--as-before puts back what activation checkpointing did before 2026-11-28 (a recompute's
routing kept on its SparseMoe until the next forward), to see the leak this fixed: the
allocated bytes then climb by about one layer's attention activations per block.

    PYTHONPATH=. python3 benchmarks/memory/moe_zero3_mem.py                  # one H200, ~1 min
    PYTHONPATH=. python3 benchmarks/memory/moe_zero3_mem.py --as-before      # the leak
    PYTHONPATH=. python3 benchmarks/memory/moe_zero3_mem.py --device cpu --tiny   # a smoke run

Writes moe_zero3_mem[_before].json (and .txt, the printed report) into $OUT (else --out, else
the working directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.engine.transforms import activation
from fitgpt.model import get_preset
from fitgpt.plan.memory import Workload, estimate

GiB = 2**30
TINY = dict(n_embd=64, n_head=4, n_kv_head=2, head_size=16, moe_ffn_hidden=32, num_experts=8,
            experts_per_token=2, vocab_size=512)  # fmt: skip
# what allocated a block: the first of these (file part, function or None) found anywhere in
# its stack, in this order (a recompute's stack holds model frames too, a fetch's a forward's)
SITES = [
    (("engine/chunked/fetch.py", None), "gathered_weights"),
    (("engine/chunked/chunk.py", "alloc_weight"), "gathered_weights"),
    (("engine/chunked/reduce.py", None), "grad_transients"),
    (("engine/chunked/update.py", None), "update"),
    (("engine/chunked/chunk", None), "state"),
    (("engine/formats/", None), "state"),
    (("torch/utils/checkpoint.py", None), "recompute"),
    (("fitgpt/model/", None), "forward"),
]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2, help="the peak is taken over all of them")
    ap.add_argument("--master", default="split", choices=["fp32", "split"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="width 64, 8 experts: a smoke run")
    ap.add_argument("--top", type=int, default=20, help="largest blocks at the peak to print")
    ap.add_argument("--as-before", action="store_true", help="the recompute's routing kept")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.layers < 2 or a.micro_batch < 1 or a.seq < 8 or a.steps < 1:
        ap.error("--layers at least 2, --micro-batch and --steps at least 1, --seq at least 8")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu --tiny for a smoke run")
    return a


def short(frames: list[dict], n: int = 4) -> list[str]:
    """The first n frames in fitgpt or torch.utils.checkpoint, as 'file:line fn'."""
    keep = [f for f in frames if "fitgpt/" in f["filename"] or "checkpoint.py" in f["filename"]]
    return [f"{f['filename'].split('fitgpt/')[-1]}:{f['line']} {f['name']}" for f in keep[:n]]


def site(frames: list[dict]) -> str:
    for (file, fn), what in SITES:
        if any(file in f["filename"] and fn in (None, f["name"]) for f in frames):
            return what
    return "backward (autograd, no Python frame)" if not frames else "other"


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replay the allocator's trace: (the most bytes allocated at once, the blocks alive then).
    Two passes: the peak's position, then the live set up to it."""
    total, peak, at = 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] == "free_completed":
            total -= e["size"]
    live: dict[int, dict] = {}
    for e in trace[: at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return peak, sorted(live.values(), key=lambda e: -e["size"])


def model_config(a: argparse.Namespace):
    cfg = get_preset("qwen3-moe-30b-a3b").replace(n_layer=a.layers, seq_len=a.seq)
    return cfg.replace(**TINY) if a.tiny else cfg


def main() -> int:
    a = parse()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.as_before:  # the recompute's side effects kept (activation.py before 2026-11-28)
        activation._Recompute.__call__ = lambda self, *args, **kw: self.inner(*args, **kw)
    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    cfg = model_config(a)
    ecfg = EngineConfig(engine="zero", zero_stage=3, checkpointing="full", compile="off",
                        master=a.master)  # fmt: skip
    precision = "bf16"
    est = estimate(Workload(cfg, a.micro_batch, 1, precision, a.device), ecfg)
    predicted = est.compute if a.device == "cuda" else est.host
    cuda = dev.type == "cuda"
    if cuda:  # before the engine: every block alive at the peak is in the trace
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    t0 = time.perf_counter()
    e = build_engine(cfg, ecfg, PrecisionConfig(precision=precision), OptimConfig(),
                     DistContext(0, 1, 0, dev))  # fmt: skip
    by_block = []

    def at_backward(i: int) -> None:
        by_block.append({
            "block": i,
            "allocated_gib": torch.cuda.memory_allocated(dev) / GiB if cuda else 0.0,
            "resident": [c.spec.name for c in e.blocks if c.resident],
            "routes_held": sum(m.route is not None for m in e.model.sparse_mlps()),
        })  # fmt: skip

    for i, block in enumerate(e.model.blocks):
        block.register_full_backward_pre_hook(lambda _m, _g, i=i: at_backward(i))
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(a.steps):
        by_block.clear()  # the last step's
        x = torch.randint(0, cfg.vocab_size, (a.micro_batch, a.seq + 1), generator=g)
        losses.append(e.train_step([(x[:, :-1].to(dev), x[:, 1:].to(dev))], 1e-5).loss)
    report = {"args": vars(a), "losses": losses, "by_block": by_block,
              "predicted_gib": {k: v / GiB for k, v in predicted.items()},
              "state_gib": {k: v / GiB for k, v in e.memory_report().get(dev.type, {}).items()}}  # fmt: skip
    if cuda:
        torch.cuda.synchronize(dev)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][dev.index or 0]
        peak, live = live_at_peak(trace)
        report["measured_peak_gib"] = torch.cuda.max_memory_allocated(dev) / GiB
        report["trace_peak_gib"] = peak / GiB
        groups: dict[str, int] = defaultdict(int)
        for b in live:
            groups[site(b.get("frames", []))] += b["size"]
        report["at_peak_gib"] = {
            k: v / GiB for k, v in sorted(groups.items(), key=lambda kv: -kv[1])
        }
        report["largest_at_peak"] = [
            {"mib": b["size"] / 2**20, "site": site(b.get("frames", [])),
             "stack": short(b.get("frames", []))}
            for b in live[: a.top]
        ]  # fmt: skip
    e.close()
    report["seconds"] = time.perf_counter() - t0
    text = render(report)
    print(text)
    name = "moe_zero3_mem_before" if a.as_before else "moe_zero3_mem"
    for suffix, body in ((".json", json.dumps(report, indent=1)), (".txt", text)):
        tmp = out / f"{name}{suffix}.tmp"
        tmp.write_text(body)
        tmp.rename(out / f"{name}{suffix}")
    return 0


def render(r: dict) -> str:
    a = r["args"]
    lines = [
        f"qwen3-moe-30b-a3b width, {a['layers']} layers, micro-batch {a['micro_batch']} x "
        f"{a['seq']}, zero-3, checkpointing full, master {a['master']}, one rank"
        f"{', as before 2026-11-28' if a['as_before'] else ''}; losses {r['losses']}",
        "allocated at each block's backward (last step), resident weights, routes held:",
    ]
    for b in r["by_block"]:
        lines.append(f"  block {b['block']:3d}  {b['allocated_gib']:8.2f} GiB  "
                     f"routes {b['routes_held']}  {' '.join(b['resident'])}")  # fmt: skip
    pred, state = r["predicted_gib"], r["state_gib"]
    lines.append(f"{'item':28} {'planned GiB':>12} {'measured GiB':>13}")
    for k in sorted(set(pred) | set(state), key=lambda k: -pred.get(k, 0)):
        m = f"{state[k]:13.2f}" if k in state else f"{'':>13}"
        lines.append(f"{k:28} {pred.get(k, 0):12.2f} {m}")
    if "measured_peak_gib" in r:
        planned_peak = sum(v for k, v in pred.items() if not k.startswith("outside:"))
        rest_planned = planned_peak - sum(pred.get(k, 0) for k in state)
        rest = r["measured_peak_gib"] - sum(state.values())
        lines += [
            f"{'peak (max_memory_allocated)':28} {planned_peak:12.2f} {r['measured_peak_gib']:13.2f}",
            f"{'  of it beside the state':28} {rest_planned:12.2f} {rest:13.2f}",
            f"alive at the trace's peak ({r['trace_peak_gib']:.2f} GiB), by what allocated it:",
        ]  # fmt: skip
        for k, v in r["at_peak_gib"].items():
            planned = f"  (planned {pred[k]:.2f})" if k in pred else ""
            lines.append(f"  {k:40} {v:8.2f} GiB{planned}")
        # the activation items against what the forward, the recompute and autograd held
        act = ("activations", "block_backward", "working_gradients", "final_norm", "logits")
        held = ("forward", "recompute", "backward (autograd, no Python frame)")
        lines.append(
            f"  activations, block_backward, working_gradients, final_norm, logits planned "
            f"{sum(pred.get(k, 0) for k in act):.2f} GiB; forward, recompute and backward "
            f"held {sum(r['at_peak_gib'].get(k, 0) for k in held):.2f}"
        )
        lines.append(f"the {len(r['largest_at_peak'])} largest blocks alive at the peak:")
        for b in r["largest_at_peak"]:
            lines.append(f"  {b['mib']:9.1f} MiB  {b['site']:22} {' < '.join(b['stack'])}")
    lines.append(f"{r['seconds']:.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
