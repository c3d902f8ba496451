"""Issue 19's comparison: fitgpt against karpathy/nanoGPT's train.py (compiled), same model, same
tokens, same batch and hyper-parameters, in one run on one GPU.

nanoGPT is not vendored: its user clones it next to the source tree first,
    git clone https://github.com/karpathy/nanoGPT .nanogpt     (ignored by git; carry it)
The data: the Python standard library's source, preprocessed by `fitgpt data preprocess` with
GPT-2's tokenizer (benchmarks/user_path.py make_data). fitgpt trains on that prefix; nanoGPT
reads raw uint16 token files, so the script writes the documents of fitgpt's train split to its
train.bin and those of fitgpt's validation split to its val.bin (fitgpt's own split arithmetic:
both systems hold out the same documents). Both: GPT-2 architecture with biases and a tied head,
seq 1024, vocabulary 50,304, bf16, AdamW (0.9, 0.95), weight decay 0.1, clip 1.0, lr 6e-4 → 6e-5
cosine, dropout 0. Per size: nanoGPT (compile=True), then `fitgpt train --compile on` and
`--compile off`, each STEPS steps; ms/step is the median over the steps after the first LOG
interval (the compile is in that one), the validation loss each system's own estimate at the
end (nanoGPT: random windows of val.bin; fitgpt: --eval-batches of its split).

The common evaluation: both systems' final weights (nanoGPT's ckpt.pt, fitgpt's checkpoint
through `fitgpt export --format hf`) loaded into Hugging Face's GPT2LMHeadModel and scored by
the same code on the same tokens: the first --common-windows non-overlapping 1024-token windows
of val.bin, the softmax over GPT-2's 50,257 real tokens (both pad theirs to 50,304). Neither
system's own evaluation code, window sampling or padding is involved.

    python3 benchmarks/peers/nanogpt_compare.py --out $OUT [--sizes 124m,1.5b] [--steps 200[,200]]
        [--eval-iters 200] [--systems nanogpt,on,off,on:ddp] [--common-windows 256]
        [--corpus stdlib|site|sitemix] [--seeds 0,1] [--nano-seeds 1337,1338] [--warmup 20]
        [--fitgpt-defaults]
Writes $OUT/nanogpt_compare.jsonl (one line per system, seed and size) and prints each line.

One run per system cannot decide a 1% difference in validation loss: at 124 M on the site
corpus, seeds of one system differ by 1.2-3.4% (benchmarks/results/nanogpt_compare4_h100_2026-11-24),
so the comparison of record is the mean over --seeds and --nano-seeds.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: user_path.py
from user_path import DATA, WORK, make_data

ROOT = Path(__file__).resolve().parents[2]
NANO = ROOT / ".nanogpt"
SIZES = {  # name: (fitgpt preset, nanoGPT n_layer, n_head, n_embd, micro-batch)
    "124m": ("gpt2-125m", 12, 12, 768, 12),
    "1.5b": ("gpt2-1.5b", 48, 25, 1600, 8),
}
ACCUM, LOG = 4, 10
HYPER = dict(lr=6e-4, min_lr=6e-5, warmup=20)
# --fitgpt-defaults: fitgpt's runs name no rate, end rate or warm-up (its `defaults:` line says
# what it took: issue 38's comparison of its defaults with nanoGPT's recipe); nanoGPT keeps HYPER
DEFAULTS = False


# --corpus site: the Python sources of the machine's site-packages (torch, transformers, numpy,
# ...), its first SITE_BYTES of text: ~30 M GPT-2 tokens, so that the 124 M run's 300 steps
# (14.7 M tokens) stay inside one epoch. The standard library (~4 M tokens) is seen 3.5 times by
# then, and the validation loss measures how fast each system memorises it.
# --corpus sitemix: the same files in a seeded random order. fitgpt's --split (Megatron's) holds
# out a contiguous range of documents, so over files sorted by path the validation split is a
# few packages' sources that training barely sees, and its loss swings with which batches came
# last (3% between two seeds at 300 steps, 2026-11-24); shuffled first, it is a random 3% of the
# files, drawn as training is.
SITE = WORK / "data" / "site_text_document"
SITEMIX = WORK / "data" / "sitemix_text_document"
SITE_BYTES = 100_000_000


def make_site_data(out: Path, prefix: Path = SITE) -> None:
    if Path(f"{prefix}.bin").is_file():
        return
    import random
    import sysconfig

    prefix.parent.mkdir(parents=True, exist_ok=True)
    name = prefix.name.split("_")[0]
    files = sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py"))
    if prefix == SITEMIX:
        random.Random(0).shuffle(files)
    src, total = prefix.parent / f"{name}.jsonl", 0
    with open(src, "w") as f:
        for p in files:
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text)
            if total >= SITE_BYTES:
                break
    cmd = [sys.executable, "-m", "fitgpt", "data", "preprocess", "--input", str(src),
           "--json-key", "text", "--output-prefix", str(prefix.parent / name), "--workers", "8",
           "--append-eod"]  # fmt: skip
    rc, _ = run(cmd, out / f"preprocess_{name}.log", ROOT)
    assert rc == 0, f"preprocess failed: {out / f'preprocess_{name}.log'}"


def nano_data(prefix: Path) -> str:
    """fitgpt's train and validation documents as nanoGPT's raw uint16 token files."""
    sys.path.insert(0, str(ROOT))
    from fitgpt.data.indexed import IndexedDataset
    from fitgpt.data.splits import split_ranges

    data = IndexedDataset(str(prefix))
    assert data.tokens.dtype == np.uint16, data.tokens.dtype
    ranges = split_ranges("969,30,1", data.num_documents)  # fitgpt's default --split
    out = NANO / "data" / f"fitgpt_{prefix.name.split('_')[0]}"
    out.mkdir(parents=True, exist_ok=True)
    for name, split in (("train.bin", "train"), ("val.bin", "valid")):
        lo, hi = ranges[split]
        first, last = data.doc_idx[lo], data.doc_idx[hi]  # sequences of those documents
        a = data.pointers[first] // 2
        b = data.pointers[last - 1] // 2 + data.lengths[last - 1]
        np.asarray(data.tokens[a:b]).tofile(out / name)
    return out.name


def run(cmd: list[str], log: Path, cwd: Path) -> tuple[int, float]:
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd).returncode
    return rc, time.time() - t0


NANO_SEED = "torch.manual_seed(1337 + seed_offset)"


def nano_script(seed: int) -> str:
    """nanoGPT's train.py, or for another seed than its fixed 1337 a copy beside it with that
    one line changed (its configurator only overrides variables train.py defines, and the seed
    is not one): the same code under a second seed gives nanoGPT's own run-to-run spread."""
    if seed == 1337:
        return "train.py"
    text = (NANO / "train.py").read_text()
    assert text.count(NANO_SEED) == 1, f"nanoGPT's train.py no longer has {NANO_SEED!r}"
    name = f"train_seed{seed}.py"  # beside train.py: it imports nanoGPT's model.py; removed after
    tmp = NANO / f".{name}.tmp"
    tmp.write_text(text.replace(NANO_SEED, f"torch.manual_seed({seed} + seed_offset)"))
    tmp.rename(NANO / name)
    return name


def nanogpt(size: str, steps: int, dataset: str, out: Path, evals: int, seed: int = 1337) -> dict:
    _, L, H, E, mb = SIZES[size]
    tag = size + (f"_seed{seed}" if seed != 1337 else "")
    log = out / f"nanogpt_{tag}.log"
    cmd = [
        sys.executable, nano_script(seed), f"--dataset={dataset}", f"--batch_size={mb}",
        "--block_size=1024", f"--gradient_accumulation_steps={ACCUM}", f"--n_layer={L}",
        f"--n_head={H}", f"--n_embd={E}", "--bias=True", "--dropout=0.0",
        f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--warmup_iters={HYPER['warmup']}",
        f"--learning_rate={HYPER['lr']}", f"--min_lr={HYPER['min_lr']}",
        f"--eval_interval={steps}", f"--eval_iters={evals}", "--log_interval=1",
        "--always_save_checkpoint=False", "--compile=True", f"--out_dir={out / ('nano_' + tag)}",
    ]  # fmt: skip
    rc, wall = run(cmd, log, NANO)
    if cmd[1] != "train.py":
        (NANO / cmd[1]).unlink()  # the user's clone as it was
    text = log.read_text()
    ms = [float(m) for i, m in re.findall(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", text)
          if int(i) > LOG]  # fmt: skip
    val = re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", text)
    hf_dir = out / f"hf_nano_{tag}"
    ckpt = out / ("nano_" + tag) / "ckpt.pt"
    if rc == 0 and ckpt.is_file():
        hf_from_nanogpt(ckpt, Path("/tmp/nanogpt_compare") / hf_dir.name)
        ckpt.unlink()  # 12-18 GB at 1.5 B: the evaluation has what it needs
    return {
        "hf_dir": str(Path("/tmp/nanogpt_compare") / hf_dir.name) if rc == 0 else None,
        "system": "nanogpt", "seed": seed, "size": size, "rc": rc, "wall_s": round(wall, 1),
        "ms_per_step": statistics.median(ms) if ms else None,
        "val_loss": float(val[-1][1]) if val and int(val[-1][0]) == steps else None,
        "tokens_per_step": mb * ACCUM * 1024,
    }  # fmt: skip


def hf_from_nanogpt(ckpt: Path, hf_dir: Path) -> None:
    """nanoGPT's checkpoint as a GPT2LMHeadModel folder: its nn.Linear weights transposed to
    GPT-2's Conv1D layout, the vocabulary cut back to 50,257 (as from_pretrained maps them the
    other way)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    # memory-mapped: only the model's tensors are read, not the optimizer's (at 1.5 B the file is
    # 18 GB and reading all of it ran a call past its time limit, nanogpt_compare4_h100_2026-11-24)
    c = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    a = c["model_args"]
    sd = {k.removeprefix("_orig_mod."): v for k, v in c["model"].items()}
    cfg = GPT2Config(vocab_size=50257, n_positions=a["block_size"], n_embd=a["n_embd"],
                     n_layer=a["n_layer"], n_head=a["n_head"], activation_function="gelu_new",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    conv = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    out = {}
    for k, v in sd.items():
        if k.endswith(".attn.bias") or k == "lm_head.weight":
            continue  # nanoGPT's causal-mask buffer; the head is tied to wte
        if k.endswith(conv):
            v = v.t()
        if k == "transformer.wte.weight":
            v = v[:50257]
        out[k] = v.contiguous()
    model = GPT2LMHeadModel(cfg)
    missing, unexpected = model.load_state_dict(out, strict=False)
    assert not unexpected and all(k.endswith(("attn.bias", "masked_bias", "lm_head.weight"))
                                  for k in missing), (missing, unexpected)  # fmt: skip
    model.tie_weights()
    model.save_pretrained(hf_dir)


def common_eval(hf_dir: Path, val_bin: Path, windows: int) -> dict:
    """Mean next-token loss of a GPT2LMHeadModel folder over the first `windows` non-overlapping
    1024-token windows of val.bin (bf16 autocast, fp32 softmax), and how many it scored."""
    import torch
    from transformers import GPT2LMHeadModel

    tokens = np.fromfile(val_bin, dtype=np.uint16).astype(np.int64)
    n = min(windows, (len(tokens) - 1) // 1024)
    model = GPT2LMHeadModel.from_pretrained(hf_dir, torch_dtype=torch.float32).cuda().eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for i in range(0, n, 8):
            rows = [tokens[j * 1024 : j * 1024 + 1025] for j in range(i, min(i + 8, n))]
            xy = torch.from_numpy(np.stack(rows)).cuda()
            logits = model(xy[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1), reduction="sum"
            )
            total, count = total + loss.item(), count + xy[:, 1:].numel()
    return {"common_val_loss": total / count, "common_windows": n}


def fitgpt(
    size: str, steps: int, compile_: str, out: Path, evals: int, data: Path, seed: int = 0
) -> dict:
    preset, *_, mb = SIZES[size]
    # on:ddp: fitgpt's --engine ddp (fp32 weights under bf16 autocast, nanoGPT's precision
    # scheme) from the same weights and batches as the chunk engine's run of that seed
    compile_, _, engine = compile_.partition(":")
    compile_, _, variant = compile_.partition("+")  # on+res32: benchmarks/peers/ab_speed_h100.py's
    tag = (f"{size}_{compile_}" + (f"_{engine}" * bool(engine)) + (f"_seed{seed}" if seed else "")
           + (f"_{variant}" * bool(variant)))  # fmt: skip
    run_dir = Path("/tmp/nanogpt_compare") / f"fitgpt_{tag}"
    log = out / f"fitgpt_{tag}.log"
    entry = ["-m", "fitgpt"] if not variant else [str(ROOT / "benchmarks/peers/ab_speed_h100.py"),
                                                   "--child", variant]  # fmt: skip
    cmd = [
        sys.executable, *entry, "train", "--preset", preset, "--data", str(data),
        "--micro-batch", str(mb), "--grad-accum", str(ACCUM), "--steps", str(steps),
        *([] if DEFAULTS else ["--warmup", str(HYPER["warmup"]), "--lr", str(HYPER["lr"]),
                               "--min-lr", str(HYPER["min_lr"])]),
        "--weight-decay", "0.1", "--grad-clip", "1.0",
        "--beta2", "0.95", "--compile", compile_, "--eval-every", str(steps),
        "--eval-batches", str(evals), "--log-every", str(LOG), "--save-optimizer", "none",
        "--out", str(run_dir), "--overwrite", "--seed", str(seed),
        *(["--engine", engine] if engine else []),
    ]  # fmt: skip
    rc, wall = run(cmd, log, ROOT)
    recs = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    ms = [r["ms_per_step"] for r in train if r["step"] > LOG]
    # the whole loop's time per step after the first interval (its logging too), beside the
    # median of the step times each record holds (the data's reading included)
    timed = [r for r in train if r["step"] >= LOG]
    loop_ms = (
        1000
        * (timed[-1]["elapsed_s"] - timed[0]["elapsed_s"])
        / (timed[-1]["step"] - timed[0]["step"])
        if len(timed) > 1
        else None
    )
    val = [r for r in recs if r.get("kind") == "eval" and r["step"] == steps]
    comp = [r for r in recs if r.get("kind") == "compile"]
    hf_dir = run_dir.parent / f"hf_{run_dir.name}"
    export = [sys.executable, "-m", "fitgpt", "export", "--ckpt", str(run_dir), "--out",
              str(hf_dir), "--format", "hf", "--overwrite"]  # fmt: skip
    exported = rc == 0 and run(export, out / f"export_{run_dir.name}.log", ROOT)[0] == 0
    return {
        "hf_dir": str(hf_dir) if exported else None,
        "scope": comp[0].get("scope") if comp else None,
        "system": f"fitgpt-compile-{compile_}" + (f"+{variant}" if variant else "")
                  + (f":{engine}" if engine else ""),
        "seed": seed, "size": size, "rc": rc, "wall_s": round(wall, 1),
        "ms_per_step": statistics.median(ms) if ms else None,
        "loop_ms_per_step": loop_ms,
        "val_loss": val[-1]["val_loss"] if val else None,
        "compile_s": comp[0].get("compile_s") if comp else None,
        "tokens_per_step": mb * ACCUM * 1024,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", default="124m,1.5b")
    ap.add_argument("--steps", default="200", help="one count, or one per size (comma-separated)")
    ap.add_argument("--eval-iters", type=int, default=200, help="validation batches, both systems")
    ap.add_argument("--systems", default="nanogpt,on,off", help="nanogpt, on, off (fitgpt's "
                    "--compile), on:ddp (with --engine ddp)")  # fmt: skip
    ap.add_argument("--common-windows", type=int, default=256, help="common evaluation windows")
    ap.add_argument("--corpus", choices=["stdlib", "site", "sitemix"], default="stdlib")
    ap.add_argument("--seeds", default="0", help="fitgpt's --seed, one run per seed (its spread)")
    ap.add_argument("--nano-seeds", default="1337", help="nanoGPT's seed, one run per seed")
    ap.add_argument("--warmup", type=int, default=HYPER["warmup"], help="warm-up steps, both")
    ap.add_argument("--fitgpt-defaults", action="store_true", help="fitgpt names no --lr, "
                    "--min-lr or --warmup: its defaults against nanoGPT's recipe")  # fmt: skip
    args = ap.parse_args()
    global DEFAULTS
    DEFAULTS = args.fitgpt_defaults
    systems = args.systems.split(",")
    HYPER["warmup"] = args.warmup
    sizes = args.sizes.split(",")
    steps = [int(x) for x in args.steps.split(",")]
    steps = steps * len(sizes) if len(steps) == 1 else steps
    if not (NANO / "train.py").is_file():
        sys.exit(f"{NANO}/train.py not found: git clone https://github.com/karpathy/nanoGPT {NANO}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.corpus in ("site", "sitemix"):
        data = SITE if args.corpus == "site" else SITEMIX
        make_site_data(args.out, data)
    else:
        make_data(args.out)
        data = DATA
    dataset = nano_data(data)
    results = args.out / "nanogpt_compare.jsonl"
    val_bin = NANO / "data" / dataset / "val.bin"
    for size, n in zip(sizes, steps, strict=True):
        for system in systems:
            if system == "nanogpt":
                recs = [nanogpt(size, n, dataset, args.out, args.eval_iters, int(seed))
                        for seed in args.nano_seeds.split(",")]  # fmt: skip
            else:
                recs = [fitgpt(size, n, system, args.out, args.eval_iters, data, int(seed))
                        for seed in args.seeds.split(",")]  # fmt: skip
            for rec in recs:
                report(rec, val_bin, args, results)


def report(rec: dict, val_bin: Path, args, results: Path) -> None:
    """The common evaluation of one run's weights, then its line in the results."""
    if rec.get("hf_dir"):
        rec.update(common_eval(Path(rec["hf_dir"]), val_bin, args.common_windows))
        shutil.rmtree(rec["hf_dir"], ignore_errors=True)
    rec["tokens_per_s"] = (
        rec["tokens_per_step"] / rec["ms_per_step"] * 1000 if rec["ms_per_step"] else None
    )
    print(json.dumps(rec), flush=True)
    with open(results, "a") as f:
        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
