"""Issue 12's done-when on the GPU: a Hugging Face GPT-2 model in and out of fitgpt, as a user does it.

1. transformers builds a GPT-2 XL-shaped model (48 layers, hidden 1600, 1.56 B) with random
   weights and saves it (`save_pretrained`); `fitgpt import hf` reads it;
2. `fitgpt train --init-from` fine-tunes it for 50 steps on real text (data made by
   `fitgpt data preprocess`, plan auto); `fitgpt export --format hf` writes it back;
3. transformers loads the export; its loss on a held-out batch is compared with fitgpt's own
   loss on the same batch from the same checkpoint (both fp32 on the GPU);
4. an 8 B GPT-2-shaped model (38 layers of hidden 4096, bf16) saved by transformers is imported,
   with its time and peak RSS.

    python3 benchmarks/peers/hf_interop.py --out $OUT      # nvidia-h100-x1; writes $OUT/user_path.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: user_path.py
from user_path import DATA, WORK, fitgpt, make_data, step

HF = WORK / "hf"


SMALL = False  # --small: toy shapes on the CPU, to check the script before a device call
DEV = "cuda"


def save_hf(path: Path, n_layer: int, n_embd: int, n_head: int, dtype: str) -> float:
    """A random-weight GPT2LMHeadModel saved by transformers (built on the GPU: fast init)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    t0 = time.time()
    if SMALL:
        n_layer, n_embd, n_head = 2, 64, 4
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=1024)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = GPT2LMHeadModel(cfg)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    del model
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return time.time() - t0


def held_out_losses(ckpt: Path, exported: Path) -> dict:
    """fitgpt's and transformers' mean loss on one validation batch of the data, fp32, GPU."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2LMHeadModel

    from fitgpt.data.config import DataConfig, open_data
    from fitgpt.data.source import BatchLoader
    from fitgpt.infer.generate import load_model

    _, valid, _tok = open_data(DataConfig(data=str(DATA)), 1024, 50257, 0)
    x, y, _ = BatchLoader(valid, 1 if SMALL else 4).next()
    x, y = x.to(DEV), y.to(DEV)
    ours, _ = load_model(ckpt, torch.device("cpu"))  # fp32 weights
    with torch.no_grad():
        mine = ours.to(DEV)(x, y).item()
        del ours
        hf = GPT2LMHeadModel.from_pretrained(exported, dtype=torch.float32).to(DEV).eval()
        logits = hf(input_ids=x).logits.float()
        theirs = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1)).item()
    return {"fitgpt_loss": mine, "transformers_loss": theirs, "abs_diff": abs(mine - theirs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="toy shapes on the CPU (a rehearsal)")
    a = ap.parse_args()
    out = Path(a.out)
    if a.small:
        global SMALL, DEV
        SMALL, DEV = True, "cpu"
        os.environ["FITGPT_REHEARSAL_FREE"] = "1"
    device = ["--device", "cpu"] if SMALL else []
    out.mkdir(parents=True, exist_ok=True)
    make_data(out)
    runs = WORK / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    shutil.rmtree(HF, ignore_errors=True)
    xl = HF / "gpt2-xl-random"
    made = save_hf(xl, 48, 1600, 25, "float32")
    imported, tuned, exported = runs / "xl-import", runs / "xl-ft", HF / "xl-ft"
    step(out, "xl import", fitgpt("import", "hf", str(xl), "--out", str(imported)), made_s=made)
    step(
        out,
        "xl fine-tune",
        fitgpt(
            "train", "--init-from", str(imported), "--data", str(DATA),
            "--steps", "3" if SMALL else "50", "--micro-batch", "1" if SMALL else "8",
            "--grad-accum", "1", "--lr", "3e-5", "--min-lr", "3e-6",
            "--warmup", "5", "--eval-every", "0", "--log-every", "1", "--save-optimizer", "none",
            "--out", str(tuned), *device,
        ),
        run_dir=tuned,
    )  # fmt: skip
    step(
        out,
        "xl export hf",
        fitgpt("export", "--ckpt", str(tuned), "--format", "hf", "--out", str(exported)),
    )
    rec = {"name": "xl held-out loss", **held_out_losses(tuned, exported)}
    print(rec, flush=True)
    with open(out / "user_path.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    shutil.rmtree(runs, ignore_errors=True)
    shutil.rmtree(HF, ignore_errors=True)
    big = HF / "gpt2-8b-random"
    made = save_hf(big, 38, 4096, 32, "bfloat16")
    step(
        out,
        "8b import",
        fitgpt("import", "hf", str(big), "--out", str(runs / "8b-import")),
        made_s=made,
    )
    shutil.rmtree(runs, ignore_errors=True)
    shutil.rmtree(HF, ignore_errors=True)


if __name__ == "__main__":
    main()
