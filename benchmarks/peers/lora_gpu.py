"""Issue 51's one-GPU LoRA bars: fitgpt against transformers + peft on a Llama-3.1-8B-shaped
folder, chat data at 4,096 tokens, the same batches and the same seeded adapters; and the
Llama-3.1-70B shape's QLoRA against transformers + bitsandbytes + peft.

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
  qpeer    the 70B QLoRA bar's peer, built in memory (qpeer() says why and how) and trained
           on fitgpt's synthetic rows by the same loop. OUT/qpeer.json.
  compare  fitgpt's metrics.jsonl against the peer's file (--bar 8b: peer.json; q70:
           qpeer.json): tokens/s (the mean over the steps after the first two), their ratio
           against the bar (1.3x; 1.5x), both loss curves and, where the base is the same
           weights, their largest difference. OUT/lora_8b.json and .md (qlora_70b.*).
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


def device(gpu_mem: str | None) -> torch.device:
    """The GPU (its allocator capped at `gpu_mem`, as `fitgpt train --gpu-mem` caps its plan),
    else the CPU."""
    from fitgpt.plan.hardware import parse_bytes

    if not torch.cuda.is_available():
        return torch.device("cpu")
    if gpu_mem:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, parse_bytes(gpu_mem, "--gpu-mem") / total)
        )
    return torch.device("cuda")


def peer(work: Path, out: Path, a: argparse.Namespace) -> None:
    """The 8B bar's peer: the folder as transformers loads it, peft's LoRA drawn as fitgpt's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dev = device(a.gpu_mem)
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # fitgpt's CPU runs fp32
    model = AutoModelForCausalLM.from_pretrained(work / "hf", dtype=dtype).to(dev)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    torch.manual_seed(a.seed)  # fitgpt draws its A as these draws (docs/adapters.md)
    model = get_peft_model(model, lora)
    system = ("transformers LlamaForCausalLM + peft LoRA (r 16, all-linear), gradient "
              "checkpointing, bf16 autocast, fused AdamW")  # fmt: skip
    train(model, a.data, out / "peer.json", system, time.perf_counter() - t0, dev, a)


def qpeer(out: Path, a: argparse.Namespace) -> None:
    """The 70B QLoRA bar's peer, as it can run on an H100 with 128 GB of RAM: no 141 GB folder
    fits that box's disk nor its RAM, so transformers' Llama of the shape is built on the meta
    device and each block's linears are made bitsandbytes Linear4bit layers (NF4, double
    quantisation, bf16 compute: what BitsAndBytesConfig(load_in_4bit=True, ...) makes of a
    folder) from random bf16 weights drawn on the GPU one matrix at a time; then the QLoRA
    recipe: peft's prepare_model_for_kbit_training (norms, embedding and head in fp32,
    gradient checkpointing), LoRA r 16 on every linear, paged 8-bit AdamW as the QLoRA paper
    trains. The base is another random draw than fitgpt's, so the loss curves are not compared:
    the speed is, on the same synthetic rows."""
    import bitsandbytes as bnb
    import llama_gpu
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    dev = device(a.gpu_mem)
    t0 = time.perf_counter()
    shape = {**llama_gpu.LLAMA_70B, **(TINY if a.tiny else {})}
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    cfg = LlamaConfig(**shape, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    std = cfg.initializer_range
    gen = torch.Generator(device=dev).manual_seed(a.seed)

    def drawn(*size: int) -> torch.Tensor:
        return torch.empty(size, device=dev, dtype=torch.bfloat16).normal_(0, std, generator=gen)

    for block in model.model.layers:
        for name, lin in list(block.named_modules()):
            if not isinstance(lin, torch.nn.Linear):
                continue
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False,
                                  compute_dtype=torch.bfloat16, quant_type="nf4",
                                  compress_statistics=True, device="meta")  # fmt: skip
            q.weight = bnb.nn.Params4bit(drawn(lin.out_features, lin.in_features),
                                         requires_grad=False, quant_type="nf4",
                                         compress_statistics=True).to(dev)  # fmt: skip
            parent, leaf = block.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            setattr(parent, leaf, q)
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            norm.weight = torch.nn.Parameter(torch.ones(cfg.hidden_size, device=dev))
    V, H = cfg.vocab_size, cfg.hidden_size
    model.model.embed_tokens.weight = torch.nn.Parameter(drawn(V, H))
    model.lm_head.weight = torch.nn.Parameter(drawn(V, H))
    model.model.norm.weight = torch.nn.Parameter(torch.ones(H, device=dev))
    model.model.rotary_emb = LlamaRotaryEmbedding(cfg).to(dev)  # made off the meta device
    model.config.use_cache = False
    model.is_loaded_in_4bit = True  # peft's k-bit preparation reads it, as for a loaded model
    model = prepare_model_for_kbit_training(
        model, gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    torch.manual_seed(a.seed)
    model = get_peft_model(model, lora)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    assert not left, f"parameters left on the meta device: {left[:4]}"
    system = ("transformers LlamaForCausalLM, bitsandbytes Linear4bit NF4 (double quantised, "
              "bf16 compute), peft prepare_model_for_kbit_training + LoRA (r 16, all-linear), "
              "gradient checkpointing, paged 8-bit AdamW")  # fmt: skip
    train(model, "synthetic", out / "qpeer.json", system, time.perf_counter() - t0, dev, a,
          qlora=True)  # fmt: skip


def train(model, data: str, dest: Path, system: str, built: float, dev, a, qlora=False) -> None:
    """`a.steps` steps of fitgpt's rows of `data` (its BatchLoader, same seed and rows per
    step: a.micro_batch x a.grad_accum), fitgpt's learning rate of each step and its AdamW
    settings, the loss the mean over the step's counted targets; each step timed. `dest`: the
    system, versions, GPU peak and each step's loss, seconds and tokens/s."""
    import peft
    import torch.nn.functional as F
    import transformers

    from fitgpt.data.config import DataConfig, open_data
    from fitgpt.data.source import BatchLoader, segment_positions

    cuda = dev.type == "cuda"
    lrs = fitgpt_lrs(a.lrs)
    steps = min(a.steps, len(lrs))
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    hyper = dict(lr=lrs[0], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if qlora:  # the QLoRA recipe's optimizer (its paper, peft's and TRL's examples)
        import bitsandbytes as bnb

        opt = bnb.optim.PagedAdamW8bit(trained, **hyper)
    else:
        opt = torch.optim.AdamW(trained, fused=cuda, **hyper)
    V = model.config.vocab_size
    src, _, _ = open_data(DataConfig(data=data), a.seq_len, V, a.seed,
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
            # the mean over the step's counted targets (-1: not a target), as transformers'
            # ForCausalLMLoss computes it on already-shifted labels with num_items_in_batch:
            # fp32 logits, summed, over the step's count
            part = F.cross_entropy(
                logits.float().view(-1, V), y.view(-1), ignore_index=-1, reduction="sum"
            ) / max(1, counted)
            part.backward()
            loss += float(part.detach())
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
    res = {
        "system": system,
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
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(json.dumps(res) + "\n")
    tmp.replace(dest)


def mean_rate(rows: list[dict]) -> float:
    """Tokens/s over the steps after the first two (start-up and the allocator's warm-up)."""
    rest = rows[2:] or rows
    return sum(r["tokens_per_s"] for r in rest) / len(rest)


# what compare writes per bar: the peer's file, the results' name, their title, the bar, and
# whether the two bases are the same weights (then the loss curves must agree)
BARS = {
    "8b": ("peer.json", "lora_8b", "LoRA r=16 all-linear, Llama-3.1-8B shape, chat data", 1.3,
           True),
    "q70": ("qpeer.json", "qlora_70b", "QLoRA (NF4) r=16 all-linear, Llama-3.1-70B shape, "
            "synthetic rows", 1.5, False),
}  # fmt: skip


def compare(out: Path, metrics: Path, label: str, bar: str) -> None:
    peer_file, name, title, need, same = BARS[bar]
    ours = [r for r in map(json.loads, metrics.open()) if r.get("kind") == "train"]
    theirs = json.loads((out / peer_file).read_text())
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
        "bar": need,
        "meets_bar": a / b >= need,
        "same_base": same,
        "loss_max_abs_diff": max(diffs),
        "loss_max_rel_diff": rel,
        "fitgpt_loss": [o["loss"] for o in ours[:n]],
        "peer_loss": [p["loss"] for p in peer_rows[:n]],
        "peer": {k: theirs[k] for k in ("system", "transformers", "peft", "gpu_peak_gib")},
    }
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(out / f"{name}.json")
    losses = (
        f"largest loss difference over the {n} steps {max(diffs):.4f} ({100 * rel:.2f}% of the "
        "peer's)"
        if same
        else "the bases are different random draws: the losses are not compared"
    )
    md = [
        f"# {title}: {label}",
        "",
        f"{res['rows_per_step']} rows of {res['seq_len']} tokens a step (the peer's micro-batch "
        f"{res['peer_micro_batch']}), {n} steps, the same rows",
        "",
        f"| | tokens/s (steps 3-{n}) | loss step 1 | loss step {n} |",
        "|---|---|---|---|",
        f"| fitgpt | {a:,.0f} | {ours[0]['loss']:.4f} | {ours[n - 1]['loss']:.4f} |",
        f"| {theirs['system'].split('), ')[0] + ')'} | {b:,.0f} | {peer_rows[0]['loss']:.4f} | "
        f"{peer_rows[n - 1]['loss']:.4f} |",
        "",
        f"ratio {a / b:.2f}x (bar {need}x: {'met' if a / b >= need else 'NOT met'}); {losses}",
        "",
        f"peer: {theirs['system']}",
        "",
        "| step | fitgpt loss | peer loss |",
        "|---|---|---|",
        *(
            f"| {o['step']} | {o['loss']:.4f} | {p['loss']:.4f} |"
            for o, p in zip(ours[:n], peer_rows[:n], strict=True)
        ),
    ]
    (out / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[4:11]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=["make", "peer", "qpeer", "compare"])
    p.add_argument("work", type=Path, help="the working folder (the model, data, runs)")
    p.add_argument("--out", type=Path, help="where results go (default: WORK)")
    p.add_argument("--src", type=Path, help="make: the standard library as JSON lines")
    p.add_argument("--tiny", action="store_true", help="make, qpeer: a 2-layer, 64-wide model")
    p.add_argument("--layers", type=int, help="qpeer: blocks (default: the shape's 80)")
    p.add_argument("--conversations", type=int, default=3000)
    p.add_argument("--data", help="peer: the preprocessed chat data's prefix")
    p.add_argument("--lrs", type=Path, help="peer, qpeer: fitgpt's metrics.jsonl (its rates)")
    p.add_argument("--metrics", type=Path, help="compare: fitgpt's metrics.jsonl")
    p.add_argument("--bar", choices=sorted(BARS), default="8b", help="compare: which bar")
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
    elif a.stage == "qpeer":
        qpeer(out, a)
    else:
        compare(out, a.metrics, a.label, a.bar)


if __name__ == "__main__":
    main()
