"""Compact optimizer state on the GPU: the CUDA paths of engine/formats/compact.py, checked on real
runs.

A small bf16 model (4 layers, hidden 512) through the zero engine on CUDA, the same batches for
every case, each tier (device-homed state, host RAM, host RAM with streamed weights, the disk):
  - split master against fp32 master on the same tier: losses and final weights must be equal
    to the bit (the working weights are torch's cast of the master either way);
  - bf16 and int8 moments: losses within 2% of fp32 moments, and not identical (really used);
  - the engine's memory_report() against the Placement's state_bytes() (the planner's bytes);
  - a checkpoint saved in split + int8 on the host, loaded into fp32 state on the device: the
    same weights, and the next steps' losses close to the run that saved it.
One JSON line per case on stdout and in OUT; exit status 1 if any check fails.

Usage (device): python3 benchmarks/history/compact_check.py OUT.jsonl
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.model import ModelConfig

DEV = torch.device(os.environ.get("COMPACT_CHECK_DEVICE", "cuda"))  # cpu: a smoke test
MODEL = ModelConfig(n_layer=4, n_embd=512, n_head=8, seq_len=256, vocab_size=4096)
if DEV.type == "cpu":
    MODEL = MODEL.replace(n_embd=64, n_head=4, seq_len=32, vocab_size=256)
NVME = "/tmp/fitgpt-nvme"
TIERS = {
    "device": dict(),
    "cpu": dict(offload_optimizer="cpu"),
    "streamed": dict(offload_optimizer="cpu", offload_params="cpu"),
    "nvme": dict(offload_optimizer="nvme", nvme_path=NVME),
}


def engine(**kw):
    ecfg = EngineConfig(engine="zero", **kw)
    return build_engine(
        MODEL, ecfg, PrecisionConfig("bf16"), OptimConfig(), DistContext(0, 1, 0, DEV)
    )


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, MODEL.vocab_size, (4, MODEL.seq_len + 1), generator=g) for _ in range(n)
    ]


def train(e, data) -> list[float]:
    return [e.train_step([(x[:, :-1], x[:, 1:])], 1e-3).loss for x in data]


def weights(e) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().cpu() for p in e.inference_model().parameters()])


def bytes_match(e) -> bool:
    """The engine's bytes (memory_report) against the Placement's (the planner's figures)."""
    rep = e.memory_report()
    pred = e.placement.state_bytes()
    got = {
        "device": rep.get(DEV.type, {}),
        "host": rep.get("host", {}),
        "nvme": rep.get("nvme", {}),
    }
    return all(
        {k: v for k, v in got[t].items() if v} == {k: v for k, v in pred.get(t, {}).items() if v}
        for t in got
    )


def case(name: str, **kw) -> tuple[list[float], torch.Tensor, bool]:
    e = engine(**kw)
    losses = train(e, batches(12))
    w, ok = weights(e), bytes_match(e)
    e.close()
    torch.cuda.empty_cache()
    return losses, w, ok


def main(out: str) -> int:
    Path(NVME).mkdir(parents=True, exist_ok=True)
    recs, failed = [], 0
    for tier, kw in TIERS.items():
        ref_l, ref_w, ref_ok = case("fp32", **kw)
        recs.append(dict(tier=tier, formats="fp32", bytes_match=ref_ok, losses=ref_l))
        split_l, split_w, ok = case("split", master="split", **kw)
        same = split_l == ref_l and torch.equal(split_w, ref_w)
        recs.append(dict(tier=tier, formats="split", bit_identical=same, bytes_match=ok))
        failed += (not same) + (not ok) + (not ref_ok)
        key = "device_moments" if tier == "device" else "moments"
        for kind in ("bf16", "int8"):
            got, _, ok = case(kind, master="split", **{key: kind}, **kw)
            diff = max(abs(a - b) / b for a, b in zip(got, ref_l))
            good = ok and diff < 0.02 and got != ref_l
            recs.append(dict(tier=tier, formats=f"split+{kind}", max_rel_loss_diff=diff,
                             bytes_match=ok, ok=good))  # fmt: skip
            failed += not good
    failed += checkpoint_across_formats(recs)
    with open(out, "w") as f:
        for r in recs:
            print(json.dumps(r), flush=True)
            f.write(json.dumps(r) + "\n")
    print("FAILED" if failed else "all checks pass", failed)
    return 1 if failed else 0


def checkpoint_across_formats(recs: list) -> int:
    data = batches(10, seed=1)
    a = engine(offload_optimizer="cpu", offload_blocks=2, master="split", moments="int8",
               device_moments="bf16")  # fmt: skip
    train(a, data[:6])
    with tempfile.TemporaryDirectory() as d:
        a.save_state(Path(d))
        extra = a.extra_state()
        wa = weights(a)
        cont = train(a, data[6:])
        a.close()
        b = engine()  # fp32 state, all on the device
        b.load_state(Path(d), extra)
        wb = weights(b)
        got = train(b, data[6:])
        b.close()
    diff = max(abs(x - y) / y for x, y in zip(got, cont))
    ok = torch.equal(wa, wb) and diff < 0.02
    recs.append(dict(check="split+int8 host -> fp32 device checkpoint", weights_equal=torch.equal(wa, wb),
                     max_rel_loss_diff=diff, ok=ok))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
