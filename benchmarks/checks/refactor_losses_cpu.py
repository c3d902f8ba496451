"""Issue 35's "no behaviour change" on CPU: the exact losses of every engine, ZeRO stage,
placement, tensor-parallel, context-parallel and compile setting, and of every model family,
written to one JSON file, so a tree after a refactor is compared with the tree before it bit for
bit.

Each case is a `fitgpt train` command (`python3 -m fitgpt train`, `--gpus 2` for the two-rank
cases: torchrun and gloo) on the same synthetic tokens, 4 steps of a 4-layer model with the plan
given (`--plan off`), every loss logged. Run it in each tree and compare:

    PYTHONPATH=. python3 benchmarks/checks/refactor_losses_cpu.py --out before.json   # old tree
    PYTHONPATH=. python3 benchmarks/checks/refactor_losses_cpu.py --out after.json --against before.json

`--against` exits 1 naming every case whose losses differ in any bit (or that failed in only one
tree). About 4 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "64"]
MODEL += ["--vocab-size", "256", "--data", "synthetic", "--device", "cpu", "--plan", "off"]
RUN = ["--micro-batch", "2", "--grad-accum", "2", "--steps", "4", "--log-every", "1"]
RUN += ["--eval-every", "0", "--no-save", "--lr", "1e-3", "--warmup", "1", "--seed", "3"]
Z0 = "--engine zero --zero-stage 0"
OFF = "--offload-optimizer cpu --offload-blocks 2"
# name -> (ranks, flags): every engine and stage, the host and disk tiers, streamed weights,
# the compact formats, each checkpointing mode, the other GPT-2 layouts, compile, TP 2 (+SP)
CASES: dict[str, tuple[int, str]] = {
    "ddp": (1, "--engine ddp"),
    "ddp_bf16": (1, "--engine ddp --precision bf16"),
    "zero0": (1, Z0),
    "zero0_ckpt_off": (1, f"{Z0} --checkpointing off"),
    "zero0_ckpt_cpu": (1, f"{Z0} --checkpointing cpu"),
    "zero0_offload": (1, f"{Z0} {OFF}"),
    "zero0_offload_split_int8": (1, f"{Z0} {OFF} --master split --moments int8 --precision bf16"),
    "zero0_nvme": (1, f"{Z0} --offload-optimizer nvme --offload-blocks 2 --nvme-path {{tmp}}"),
    "alibi_untied_embnorm": (1, f"{Z0} --position alibi --no-tie-embeddings --embed-norm"),
    "nobias": (1, f"{Z0} --no-bias"),
    "compile": (1, f"{Z0} --compile on"),
    "x2_ddp": (2, "--engine ddp"),
    "x2_zero1": (2, "--engine zero --zero-stage 1"),
    "x2_zero2": (2, "--engine zero --zero-stage 2"),
    "x2_zero3": (2, "--engine zero --zero-stage 3"),
    "x2_zero3_stream": (
        2,
        f"--engine zero --zero-stage 3 {OFF} --offload-params cpu --master split --moments bf16 "
        "--precision bf16",
    ),
    "x2_tp2_ddp": (2, "--engine ddp --tensor-parallel 2"),
    "x2_tp2_zero0_sp": (2, f"{Z0} --tensor-parallel 2 --sequence-parallel"),
    # the other families (issue 49: a family is a folder) and context parallelism
    "llama_zero0": (1, f"--preset tiny-llama {Z0}"),
    "llama_offload_ckpt_cpu": (1, f"--preset tiny-llama {Z0} {OFF} --checkpointing cpu"),
    "qwen3_qknorm": (1, f"--preset qwen3-8b --kv-heads 2 --ffn-hidden 128 {Z0}"),
    "qwen2_qkv_bias": (1, f"--preset qwen2.5-0.5b --kv-heads 2 --ffn-hidden 128 {Z0}"),
    "mistral_window": (
        1,
        f"--preset mistral-7b --kv-heads 2 --ffn-hidden 128 --sliding-window 16 {Z0}",
    ),
    "x2_llama_zero3": (2, "--preset tiny-llama --engine zero --zero-stage 3"),
    "x2_llama_cp2": (2, f"--preset tiny-llama {Z0} --context-parallel 2"),
}


def run_case(name: str, ranks: int, flags: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        flags = flags.replace("{tmp}", tmp).split()
        gpus = ["--gpus", str(ranks)] if ranks > 1 else []
        cmd = [sys.executable, "-m", "fitgpt", "train", *gpus, *MODEL, *RUN, *flags]
        cmd += ["--out", f"{tmp}/run"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        metrics = Path(tmp, "run", "metrics.jsonl")
        recs = (
            [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
        )
    losses = [r["loss"] for r in recs if r.get("kind") == "train"]
    out = {"flags": flags, "ranks": ranks, "exit": p.returncode, "losses": losses}
    out["seconds"] = round(time.time() - t0, 1)
    if p.returncode:
        out["error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:300]
    print(f"{name}: exit {p.returncode}, losses {losses}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--against", help="a file this script wrote in the other tree")
    ap.add_argument("--only", help="comma-separated case names")
    a = ap.parse_args()
    names = a.only.split(",") if a.only else list(CASES)
    got = {n: run_case(n, *CASES[n]) for n in names}
    Path(a.out).write_text(json.dumps(got, indent=1) + "\n")
    if not a.against:
        return 0
    ref = json.loads(Path(a.against).read_text())
    bad = []
    for n in names:
        r, g = ref.get(n), got[n]
        if r is None:
            bad.append(f"{n}: not in {a.against}")
        elif (r["exit"], r["losses"]) != (g["exit"], g["losses"]):
            bad.append(f"{n}: {r['exit']} {r['losses']} before, {g['exit']} {g['losses']} now")
    print("\n".join(bad) or f"all {len(names)} cases bit-identical to {a.against}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
