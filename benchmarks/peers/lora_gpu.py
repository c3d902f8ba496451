"""Issue 51's one-GPU LoRA bar: fitgpt against transformers + peft on a Llama-3.1-8B-shaped
folder, chat data at 4,096 tokens, the same batches and the same seeded adapters.

Stages (`python3 benchmarks/peers/lora_gpu.py STAGE WORK [flags]`; lora_gpu.sh runs them with
the fitgpt commands between them):
  make     WORK/hf: the Llama-3.1-8B shape with random weights saved by transformers, its
           Llama-3-style tokenizer (llama_gpu.py: BPE trained on the Python standard library's
           source) given a Llama-3-style chat template; WORK/chats.jsonl: conversations made
           from the standard library's files (a user asks about a file's opening, the assistant
           answers with the lines after it), lengths spread so that rows pack several.
           --tiny: a 2-layer, 64-wide model of the same vocabulary (the CPU rehearsal).
  peer     transformers' LlamaForCausalLM (bf16 weights) with peft's LoRA (r 16, alpha 32, every
           linear of the blocks, no dropout), gradient checkpointing on (non-reentrant), bf16
           autocast as transformers' Trainer runs it with bf16=True, torch's fused AdamW with
           fitgpt's defaults (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on A and B, clipping
           at 1.0) and fitgpt's learning rate of each step (read from its metrics.jsonl). The
           batches are fitgpt's own (its BatchLoader over the same preprocessed chat data and
           seed, the same rows each step, in --micro-batch x --grad-accum): packed rows whose samples are kept apart by their
           position ids (transformers builds the block-diagonal mask from them), the loss on
           the assistant tokens fitgpt counts. The adapters are drawn as fitgpt draws them:
           torch.manual_seed(seed) just before peft.get_peft_model. --gpu-mem caps torch's
           allocator (an H100's 80 GB on a bigger GPU). OUT/peer.json: each step's loss,
           seconds and tokens/s; the GPU's peak.
  compare  fitgpt's metrics.jsonl against OUT/peer.json: tokens/s (the mean over the steps
           after the first two), their ratio against the bar (1.3x), both loss curves and their
           largest difference. OUT/lora_8b.json and OUT/lora_8b.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_gpu.py beside this file

# Llama 3's own chat format: a header per message, each turn closed by <|eot_id|> (written
# here, not copied: the shape of the format is what fitgpt's chat preprocessing must honour)
TEMPLATE = (
    "{{- bos_token }}{% for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
BAR = 1.3  # fitgpt's tokens/s over the peer's the issue asks for


def chats(src: Path, dest: Path, count: int) -> int:
    """`count` conversations from the standard library's files: the user quotes a file's first
    lines and asks what follows, the assistant gives the next ones; 5-160 lines of each (about
    60-2,500 tokens a conversation), some with a system message. Seeded: the same file each run."""
    rng = random.Random(0)
    files = [json.loads(line)["text"].splitlines() for line in src.open()]
    files = [f for f in files if len(f) >= 20]
    n = 0
    with dest.open("w") as out:
        while n < count:
            lines = files[rng.randrange(len(files))]
            ask, say = rng.randint(3, 80), rng.randint(2, 80)
            at = rng.randrange(max(1, len(lines) - ask - say))
            prompt, reply = lines[at : at + ask], lines[at + ask : at + ask + say]
            if not "".join(reply).strip():
                continue
            msgs = [{"role": "system", "content": "You complete Python files."}]
            msgs = msgs if rng.random() < 0.3 else []
            msgs += [
                {"role": "user", "content": "What comes next?\n" + "\n".join(prompt)},
                {"role": "assistant", "content": "\n".join(reply)},
            ]
            out.write(json.dumps({"messages": msgs}) + "\n")
            n += 1
    return n


def make(work: Path, src: Path, tiny: bool, count: int) -> None:
    import llama_gpu
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = work / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    llama_gpu.tokenizer(hf, src)
    cfg_path = hf / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    t1 = time.time()
    shape = {**llama_gpu.SHAPE, **(TINY if tiny else {})}
    config = LlamaConfig(**shape, torch_dtype="bfloat16")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # transformers' own init, std 0.02
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(hf, max_shard_size="5GB")
    n = chats(src, work / "chats.jsonl", count)
    print(json.dumps({"stage": "make", "params": sum(p.numel() for p in model.parameters()),
                      "conversations": n, "tokenizer_s": round(t1 - t0, 1),
                      "model_s": round(time.time() - t1, 1)}))  # fmt: skip


def fitgpt_lrs(metrics: Path) -> list[float]:
    return [r["lr"] for r in map(json.loads, metrics.open()) if r.get("kind") == "train"]


def peer(work: Path, out: Path, a: argparse.Namespace) -> None:
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fitgpt.data.config import DataConfig, open_data
    from fitgpt.data.source import BatchLoader, segment_positions
    from fitgpt.plan.hardware import parse_bytes

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda and a.gpu_mem:  # the allocator capped as `fitgpt train --gpu-mem` caps its plan
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, parse_bytes(a.gpu_mem, "--gpu-mem") / total)
        )
    lrs = fitgpt_lrs(a.lrs)
    steps = min(a.steps, len(lrs))
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if cuda else torch.float32  # fitgpt on the CPU runs fp32
    model = AutoModelForCausalLM.from_pretrained(work / "hf", dtype=dtype).to(dev)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    torch.manual_seed(a.seed)  # fitgpt draws its A as these draws (docs/adapters.md)
    model = get_peft_model(model, lora)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=lrs[0], betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=cuda)  # fmt: skip
    built = time.perf_counter() - t0
    V = model.config.vocab_size
    src, _, _ = open_data(DataConfig(data=a.data), a.seq_len, V, a.seed,
                          num_samples=(steps * a.grad_accum * a.micro_batch, 0))  # fmt: skip
    loader = BatchLoader(src, a.micro_batch)
    print(f"built in {built:.0f} s: {sum(p.numel() for p in trained):,} adapter values", flush=True)
    rows = []
    for step in range(steps):
        micro = [[t.to(dev) for t in loader.next_with_segments()] for _ in range(a.grad_accum)]
        counted = sum(int((y >= 0).sum()) for _, y, _ in micro)  # the step's targets
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lrs[step]
        loss = 0.0
        for x, y, seg in micro:
            pos = segment_positions(seg)  # restarts at each packed sample: transformers' packing
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                # no cache: transformers reads packed samples from the position ids only
                # without one (a cache would make every row one causal sequence)
                logits = model(input_ids=x, position_ids=pos, use_cache=False).logits
            # the mean over the step's assistant tokens fitgpt counts (-1: not a target), as
            # transformers' ForCausalLMLoss computes it on already-shifted labels with
            # num_items_in_batch: fp32 logits, summed, over the step's count
            part = F.cross_entropy(
                logits.float().view(-1, V), y.view(-1), ignore_index=-1, reduction="sum"
            ) / max(1, counted)
            part.backward()
            loss += float(part)
            del logits, part  # one micro-batch's logits at a time
        gnorm = torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        rec = {"step": step + 1, "loss": loss, "grad_norm": float(gnorm), "s": dt,
               "tokens_per_s": a.grad_accum * x.numel() / dt, "lr": lrs[step]}  # fmt: skip
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    import peft
    import transformers

    res = {
        "system": "transformers LlamaForCausalLM + peft LoRA (r 16, all-linear), gradient "
        "checkpointing, bf16 autocast, fused AdamW",
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu_mem_cap": a.gpu_mem,
        "micro_batch": a.micro_batch,
        "grad_accum": a.grad_accum,
        "seq_len": a.seq_len,
        "built_s": built,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "steps": rows,
    }
    tmp = out / "peer.json.tmp"
    tmp.write_text(json.dumps(res) + "\n")
    tmp.replace(out / "peer.json")


def mean_rate(rows: list[dict]) -> float:
    """Tokens/s over the steps after the first two (start-up and the allocator's warm-up)."""
    rest = rows[2:] or rows
    return sum(r["tokens_per_s"] for r in rest) / len(rest)


def compare(out: Path, metrics: Path, label: str) -> None:
    ours = [r for r in map(json.loads, metrics.open()) if r.get("kind") == "train"]
    theirs = json.loads((out / "peer.json").read_text())
    peer_rows = theirs["steps"]
    n = min(len(ours), len(peer_rows))
    a, b = mean_rate(ours[:n]), mean_rate(peer_rows[:n])
    diffs = [abs(o["loss"] - p["loss"]) for o, p in zip(ours[:n], peer_rows[:n], strict=True)]
    rel = max(d / abs(p["loss"]) for d, p in zip(diffs, peer_rows, strict=False))
    res = {
        "machine": label,
        "gpu": theirs["gpu"],
        "steps": n,
        "rows_per_step": theirs["micro_batch"] * theirs["grad_accum"],
        "peer_micro_batch": theirs["micro_batch"],
        "seq_len": theirs["seq_len"],
        "fitgpt_tokens_per_s": a,
        "peer_tokens_per_s": b,
        "ratio": a / b,
        "bar": BAR,
        "meets_bar": a / b >= BAR,
        "loss_max_abs_diff": max(diffs),
        "loss_max_rel_diff": rel,
        "fitgpt_loss": [o["loss"] for o in ours[:n]],
        "peer_loss": [p["loss"] for p in peer_rows[:n]],
        "peer": {k: theirs[k] for k in ("system", "transformers", "peft", "gpu_peak_gib")},
    }
    tmp = out / "lora_8b.json.tmp"
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(out / "lora_8b.json")
    md = [
        f"# LoRA r=16 all-linear, Llama-3.1-8B shape, chat data: {label}",
        "",
        f"{res['rows_per_step']} rows of {res['seq_len']} tokens a step (the peer's micro-batch "
        f"{res['peer_micro_batch']}), {n} steps, the same rows",
        "",
        f"| | tokens/s (steps 3-{n}) | loss step 1 | loss step {n} |",
        "|---|---|---|---|",
        f"| fitgpt | {a:,.0f} | {ours[0]['loss']:.4f} | {ours[n - 1]['loss']:.4f} |",
        f"| transformers + peft | {b:,.0f} | {peer_rows[0]['loss']:.4f} | "
        f"{peer_rows[n - 1]['loss']:.4f} |",
        "",
        f"ratio {a / b:.2f}x (bar {BAR}x: {'met' if a / b >= BAR else 'NOT met'}); largest loss "
        f"difference over the {n} steps {max(diffs):.4f} ({100 * rel:.2f}% of the peer's)",
        "",
        "| step | fitgpt loss | peer loss |",
        "|---|---|---|",
        *(
            f"| {o['step']} | {o['loss']:.4f} | {p['loss']:.4f} |"
            for o, p in zip(ours[:n], peer_rows[:n], strict=True)
        ),
    ]
    (out / "lora_8b.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[4:9]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=["make", "peer", "compare"])
    p.add_argument("work", type=Path, help="the working folder (the model, data, runs)")
    p.add_argument("--out", type=Path, help="where results go (default: WORK)")
    p.add_argument("--src", type=Path, help="make: the standard library as JSON lines")
    p.add_argument("--tiny", action="store_true", help="make: a 2-layer, 64-wide model")
    p.add_argument("--conversations", type=int, default=3000)
    p.add_argument("--data", help="peer: the preprocessed chat data's prefix")
    p.add_argument("--lrs", type=Path, help="peer: fitgpt's metrics.jsonl (each step's rate)")
    p.add_argument("--metrics", type=Path, help="compare: fitgpt's metrics.jsonl")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--gpu-mem", help="peer: cap the GPU's memory, e.g. 80GB (an H100's)")
    p.add_argument("--label", default="", help="compare: the machine, as the results say it")
    a = p.parse_args()
    out = a.out or a.work
    out.mkdir(parents=True, exist_ok=True)
    if a.stage == "make":
        make(a.work, a.src, a.tiny, a.conversations)
    elif a.stage == "peer":
        peer(a.work, out, a)
    else:
        compare(out, a.metrics, a.label)


if __name__ == "__main__":
    main()
