"""Issue 50 on one GPU: the mixture-of-experts path measured, and the peer users take beside it.

Stages (`python3 benchmarks/peers/moe_gpu.py STAGE OUT [flags]`):
  grouped  fitgpt's expert matmuls at Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of
           768, 8 per token), bf16 on the GPU: torch._grouped_mm (the path fitgpt takes on an
           H100/H200) against one F.linear per expert (the path it takes elsewhere), same
           sorted tokens: the largest difference of the output and of each gradient, and the
           forward+backward time of each; then one whole SparseMoe layer's forward+backward.
           One JSON line in OUT/grouped.json.
  sink     gpt-oss's attention with sinks: the FlexAttention path CUDA runs against the SDPA
           reference, outputs, gradients and times (sink() says how). OUT/sink.json.
  blockmem one sparse block's saved set and backward peak on the GPU against the planner's
           terms (blockmem() says how). OUT/blockmem.json.
  ossexp   gpt-oss-20b's experts forward + backward, routed evenly and all to 4 experts, their
           biases trained and frozen (ossexp() says why). OUT/ossexp.json.
  peer     Hugging Face transformers' Qwen3MoeForCausalLM of the same shape (random weights,
           --layers of them) trained by DeepSpeed ZeRO-3 with the parameters and the optimizer
           offloaded to pinned CPU memory, as LLaMA-Factory and axolotl set it up: built inside
           deepspeed.zero.Init, the sparse MoE block declared a ZeRO-3 leaf module (DeepSpeed
           #7461), transformers' gradient checkpointing, the config's AdamW (DeepSpeedCPUAdam),
           bf16. Fed windows of the same preprocessed tokens fitgpt trains on (--data PREFIX),
           the same micro-batch, accumulation and sequence length. Per step: seconds, tokens/s,
           loss; the GPU's peak and the host's used memory. OUT/peer.json.
  chat     OUT/tok, a Qwen-style tokenizer folder (byte-level BPE of 32,000 trained on the text
           of --text, Qwen's <|endoftext|>, <|im_start|>, <|im_end|> and reserved special tokens
           filling Qwen3's 151,936 rows, a ChatML chat template) and OUT/chat.jsonl:
           conversations made of that text (a system line; the user gives the first part of a
           piece of a file and asks for the rest; the assistant's reply is the rest), for
           `fitgpt data preprocess --chat`.
  make     OUT/hf: that tokenizer beside transformers' Qwen3MoeForCausalLM of the whole
           Qwen3-30B-A3B shape (random weights, bf16, 5 GB shards), built on the GPU.
  peer     (above) on several GPUs under torchrun or the deepspeed launcher: each rank reads its
           own windows; --offload none keeps the parameters and the optimizer on the GPUs.
benchmarks/peers/moe_gpu.sh and benchmarks/multi_gpu/moe_x4.sh run the stages with `fitgpt
train` between them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Qwen/Qwen3-30B-A3B's config.json, but for the layers (--layers) and the vocabulary (the data's
# tokenizer's, padded to fitgpt's multiple of 128: both systems hold the same parameters)
SHAPE = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
    max_position_embeddings=40960, output_router_logits=False,
)  # fmt: skip


# Qwen/Qwen3-30B-A3B's vocabulary, which the chat stage's tokenizer fills, and the ChatML
# template Qwen's instruct models publish, without tools or thinking
QWEN3_VOCAB = 151_936
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def host_used_gib() -> float:
    with open("/proc/meminfo") as f:
        m = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
    return (m["MemTotal"] - m["MemAvailable"]) / 2**20


def timed(fn, reps: int = 5) -> float:
    """Median seconds of fn() over `reps` runs after two warm-ups, the GPU synchronised."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def grouped(out: Path) -> None:
    from fitgpt.model import get_preset
    from fitgpt.model.families.qwen3_moe.model import SparseMoe, expert_matmul, grouped_gemm_ok

    H, E, K, F = 2048, 128, 8, 768
    N = 16384  # tokens of one micro-batch of 4 × 4096
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    idx_NK = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(N)])
    flat = idx_NK.reshape(-1)
    order = flat.argsort(stable=True)
    count = torch.bincount(flat, minlength=E)
    x = torch.randn(N, H, device=dev, dtype=torch.bfloat16, generator=g)[order // K]
    w_fc = (torch.randn(E, 2 * F, H, device=dev, generator=g) * 0.02).bfloat16()
    w_proj = (torch.randn(E, H, F, device=dev, generator=g) * 0.02).bfloat16()
    assert grouped_gemm_ok(x, w_fc), "torch._grouped_mm does not serve this GPU or dtype"
    dy = torch.randn(x.shape[0], H, device=dev, dtype=torch.bfloat16, generator=g)

    def pass_(grouped: bool):
        a, b, c = (t.detach().requires_grad_() for t in (x, w_fc, w_proj))
        gate, up = expert_matmul(a, b, count, grouped).chunk(2, dim=-1)
        y = expert_matmul(torch.nn.functional.silu(gate) * up, c, count, grouped)
        y.backward(dy)
        return y, a.grad, b.grad, c.grad

    fast, loop = pass_(True), pass_(False)
    names = ("out", "d_x", "d_fc", "d_proj")
    rel = {
        n: float((f.float() - s.float()).abs().max() / s.float().abs().max())
        for n, f, s in zip(names, fast, loop, strict=True)
    }
    t_fast, t_loop = timed(lambda: pass_(True)), timed(lambda: pass_(False))
    # the expert matmuls' FLOPs: 3 products of [M, H]·[H, F]-sized over M = N·K rows, forward
    # (1) and backward (2)
    flops = 3 * 2 * (N * K) * H * F * 3
    cfg = get_preset("qwen3-moe-30b-a3b").replace(n_layer=1)  # the layer's shape, as trained
    layer = SparseMoe(cfg, fp32_scores=False).to(dev, torch.bfloat16).train()
    xl = torch.randn(4, 4096, H, device=dev, dtype=torch.bfloat16, generator=g)

    def layer_pass():
        a = xl.detach().requires_grad_()
        layer(a).backward(dy.view(-1)[: a.numel()].view_as(a))

    t_layer = timed(layer_pass)
    rec = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": N,
        "shape": {"hidden": H, "experts": E, "per_token": K, "expert_ffn": F},
        "max_rel_diff_grouped_vs_per_expert": rel,
        "grouped_s": t_fast,
        "per_expert_s": t_loop,
        "grouped_tflops": flops / t_fast / 1e12,
        "per_expert_tflops": flops / t_loop / 1e12,
        "sparse_moe_layer_fwd_bwd_s": t_layer,
        "sparse_moe_layer_tflops": flops / t_layer / 1e12,
    }
    (out / "grouped.json").write_text(json.dumps(rec) + "\n")
    print(json.dumps(rec))


def sink(out: Path) -> None:
    """gpt-oss's attention with sinks at gpt-oss-20b's head shape (64 query heads, 8 kv heads
    of 64), 4 × 4,096 tokens, bf16: what CUDA runs (flex_sink_attention: compiled
    FlexAttention's log-sum-exp, then σ(L − sink)) against the reference (sink_attention: the
    sink as one more key on SDPA, the path the CPU tests compare with transformers), for a
    sliding layer (window 128) and a full one: the largest difference of the output and of
    each gradient (q, k, v, the sinks; also in fp32 at 1 × 1,024 tokens), and the
    forward+backward time of each. One JSON line in OUT/sink.json."""
    from fitgpt.model.families.gpt_oss.model import flex_sink_attention, sink_attention, sink_keep
    from fitgpt.model.packing import window_block_mask

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rec: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    def inputs(B, T, dtype):
        q, k, v = (torch.randn(B, h, T, 64, device=dev, generator=g).to(dtype) for h in (64, 8, 8))
        sinks = torch.randn(64, device=dev, generator=g).to(dtype)
        dy = torch.randn(B, 64, T, 64, device=dev, generator=g).to(dtype)
        return q, k, v, sinks, dy

    def pass_(fn, mask, tensors):
        q, k, v, sinks, dy = tensors
        leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
        y = fn(*leaves, mask)
        y.backward(dy)
        return [y] + [t.grad for t in leaves]

    def ref(q, k, v, s, mask):
        return sink_attention(q, k, v, s, mask, 0.0)

    for window in (128, None):
        name = "sliding128" if window else "full"
        for B, T, dtype in ((1, 1024, torch.float32), (4, 4096, torch.bfloat16)):
            tensors = inputs(B, T, dtype)
            flex_mask = window_block_mask(T, window, dev)
            dense = sink_keep(T, 0, window, dev)
            fast = pass_(flex_sink_attention, flex_mask, tensors)
            slow = pass_(ref, dense, tensors)
            diff = {
                n: float((f.float() - r.float()).abs().max() / r.float().abs().max())
                for n, f, r in zip(("out", "d_q", "d_k", "d_v", "d_sinks"), fast, slow, strict=True)
            }
            key = f"{name}_{str(dtype).split('.')[-1]}_{B}x{T}"
            rec[key] = {"max_rel_diff_flex_vs_reference": diff}
            if dtype == torch.bfloat16:
                fm, dm, ts = flex_mask, dense, tensors
                rec[key]["flex_s"] = timed(lambda: pass_(flex_sink_attention, fm, ts))  # noqa: B023
                rec[key]["reference_s"] = timed(lambda: pass_(ref, dm, ts))  # noqa: B023
            del fast, slow
            torch.cuda.empty_cache()
    (out / "sink.json").write_text(json.dumps(rec) + "\n")
    print(json.dumps(rec))


def blockmem(out: Path) -> None:
    """One sparse block of gpt-oss-20b and of Qwen3-30B-A3B in bf16 on the GPU, forward and
    backward over 4 × 4,096 tokens as the engine runs a block (weights in bf16, gradients made
    by autograd): what the block's forward leaves saved (allocated after the forward less
    before) and the peak above the start during the backward, beside the planner's terms for
    one block (plan/memory.py activation_bytes: the saved set per block with attention's
    statistics, and a block's backward: the larger of attention's and the MLP's working sets,
    plus the working gradients). OUT/blockmem.json."""
    from fitgpt.model import build_model, get_preset
    from fitgpt.model.families import family_of
    from fitgpt.plan.memory import Workload, activation_bytes

    dev = torch.device("cuda")
    rec: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    B, T = 4, 4096
    for preset in ("gpt-oss-20b", "qwen3-moe-30b-a3b"):
        cfg = get_preset(preset).replace(n_layer=1, seq_len=T, vocab_size=1024)
        model = build_model(cfg).to(dev, torch.bfloat16).train()
        block = model.blocks[0]
        aux = model.block_aux(T, 0, dev)
        x = torch.randn(B, T, cfg.n_embd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        for _ in range(2):  # the second pass measured: kernels compiled and tuned in the first
            for p in block.parameters():
                p.grad = None
            x.grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = block(x, None, 0, aux)
            saved = torch.cuda.memory_allocated() - start - y.numel() * y.element_size()
            y.backward(dy)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start
            grads = sum(p.numel() * p.element_size() for p in block.parameters())
            del y
        work = Workload(cfg, B, 1, "bf16")
        terms = activation_bytes(work, "off")
        per_block = terms["activations"]  # one layer, nothing checkpointed: its saved set
        backward = terms["block_backward"] + terms["working_gradients"]
        rec[preset] = {
            "saved_gib": saved / 2**30,
            "planned_saved_gib": per_block / 2**30,
            "peak_above_start_gib": peak / 2**30,
            "block_grads_gib": grads / 2**30,
            "planned_peak_gib": (per_block + backward + grads) / 2**30,
            "family": family_of(cfg).name,
        }
        del model, block, x, dy, aux
        torch.cuda.empty_cache()
    (out / "blockmem.json").write_text(json.dumps(rec) + "\n")
    print(json.dumps(rec))


def chat(out: Path, text_jsonl: Path) -> None:
    """OUT/tok (the tokenizer folder) and OUT/chat.jsonl (module docstring)."""
    from tokenizers import AddedToken

    from benchmarks.peers.llama_gpu import trained_bpe

    t0 = time.time()
    texts = [json.loads(x)["text"] for x in text_jsonl.open()]
    tok = trained_bpe(texts)
    named = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    reserved = [f"<|reserved_{i}|>" for i in range(QWEN3_VOCAB - tok.get_vocab_size() - 3)]
    tok.add_special_tokens([AddedToken(t, special=True) for t in named + reserved])
    assert tok.get_vocab_size() == QWEN3_VOCAB, tok.get_vocab_size()
    folder = out / "tok"
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "chat_template": CHATML, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    # conversations: pieces of at most 6,000 characters (~2,000 tokens: a 4,096-token row packs
    # about two), the user quoting the first quarter, the assistant writing the rest
    n = 0
    with (out / "chat.jsonl.tmp").open("w") as f:
        for text in texts:
            for a in range(0, len(text), 6000):
                piece = text[a : a + 6000]
                cut = len(piece) // 4
                if cut < 20 or not piece[cut:].strip():
                    continue
                msgs = [
                    {"role": "system", "content": "You are a careful Python programmer."},
                    {"role": "user", "content": "Continue this code:\n" + piece[:cut]},
                    {"role": "assistant", "content": piece[cut:]},
                ]
                f.write(json.dumps({"messages": msgs}) + "\n")
                n += 1
    (out / "chat.jsonl.tmp").rename(out / "chat.jsonl")
    print(json.dumps({"stage": "chat", "conversations": n, "vocab": QWEN3_VOCAB,
                      "s": round(time.time() - t0, 1)}))  # fmt: skip


def make(out: Path, layers: int) -> None:
    """OUT/hf: the chat stage's tokenizer (OUT/tok) and a Qwen3-30B-A3B-shaped model of
    `layers` layers (48: the whole shape), built on the GPU (the CPU where there is none)."""
    import shutil

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    t0 = time.time()
    hf = out / "hf"
    shutil.copytree(out / "tok", hf, dirs_exist_ok=True)
    cfg = Qwen3MoeConfig(vocab_size=QWEN3_VOCAB, num_hidden_layers=layers, **SHAPE)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # 61 GB of bf16 on one GPU (fp32 would be 122)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # transformers' init
        model = Qwen3MoeForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    built = time.time() - t0
    model.save_pretrained(hf, max_shard_size="5GB")
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"stage": "make", "params": n, "built_s": round(built, 1),
                      "saved_s": round(time.time() - t0 - built, 1)}))  # fmt: skip


def ossexp(out: Path) -> None:
    """gpt-oss-20b's experts (ClampedExperts: 32 of 2,880, 4 per token, biases gathered per
    row) forward + backward over 2 × 4,096 tokens in bf16: routed evenly, and as a random
    router routes at initialisation (every token to the same 4 experts, "busiest expert 8.00×"
    in results/moe_sink_h200_2026-11-28), each with the biases trained and frozen (their
    gradient summed per expert by a one-hot matmul, gpt_oss/model.py row_bias; before
    2026-11-28 an index_put with accumulate over M rows into E, suspected of the step's 70%
    over its priced compute: trained against frozen tells). Seconds and model TFLOP/s of the
    experts' matmuls. OUT/ossexp.json."""
    from fitgpt.model import get_preset
    from fitgpt.model.families.gpt_oss.model import ClampedExperts

    dev = torch.device("cuda")
    cfg = get_preset("gpt-oss-20b").replace(n_layer=1)
    E, K, H, F = cfg.num_experts, cfg.experts_per_token, cfg.n_embd, cfg.moe_ffn_hidden
    N = 2 * 4096
    experts = ClampedExperts(cfg).to(dev, torch.bfloat16).train()
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, H, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.full((N, K), 1.0 / K, device=dev, dtype=torch.bfloat16)
    even = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(N)])
    hot = torch.arange(K, device=dev).expand(N, K).contiguous()
    flops = 3 * 2 * N * K * 3 * H * F  # forward + backward of the two products
    rec: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": N}
    for name, idx in (("even", even), ("hot", hot)):
        for biases in (True, False):
            experts.gate_up_bias.requires_grad_(biases)
            experts.down_bias.requires_grad_(biases)

            def pass_(idx=idx):
                a = x.detach().requires_grad_()
                experts(a, idx, w).float().sum().backward()

            t = timed(pass_)
            key = f"{name}_{'biases' if biases else 'frozen_biases'}"
            rec[key] = {"s": t, "tflops": flops / t / 1e12}
    (out / "ossexp.json").write_text(json.dumps(rec) + "\n")
    print(json.dumps(rec))


def windows(prefix: str, seq: int, count: int, start: int) -> torch.Tensor:
    """`count` consecutive windows of seq + 1 tokens of the preprocessed data, from window
    `start` (the tokens fitgpt's run reads, in file order)."""
    from fitgpt.data.indexed import IndexedDataset

    data = IndexedDataset(prefix)
    flat = np.memmap(prefix + ".bin", dtype=data.dtype, mode="r")
    a = (start * seq) % max(1, flat.size - count * seq - 1)
    return torch.from_numpy(
        np.stack([flat[a + i * seq : a + (i + 1) * seq + 1].astype(np.int64) for i in range(count)])
    )


def peer(out: Path, args: argparse.Namespace) -> None:
    import deepspeed
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from fitgpt.model.config import padded_vocab

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if args.gpu_mem:  # an H100's 80 GB on a larger card: torch's allocator capped, as fitgpt's
        from lora_gpu import device

        device(args.gpu_mem)
    deepspeed.init_distributed()
    M, G, S = args.micro_batch, args.grad_accum, args.seq_len
    pinned = {"device": "cpu", "pin_memory": True}
    off = pinned if args.offload == "cpu" else {"device": "none"}
    config = {
        "train_micro_batch_size_per_gpu": M,
        "gradient_accumulation_steps": G,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": off, "offload_param": off,
            "overlap_comm": True, "contiguous_gradients": True,
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5,
            "reduce_bucket_size": 1e7, "sub_group_size": 1e9,
        },
        "steps_per_print": 1 << 30,
    }  # fmt: skip
    vocab = padded_vocab(args.vocab)
    hf_cfg = Qwen3MoeConfig(vocab_size=vocab, num_hidden_layers=args.layers, **SHAPE)
    t0 = time.perf_counter()
    remote = "cpu" if args.offload == "cpu" else None  # None: each rank's shard on its GPU
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device=remote, pin_memory=True):
        model = Qwen3MoeForCausalLM(hf_cfg)
    params = sum(p.ds_numel for p in model.parameters())
    deepspeed.utils.set_z3_leaf_modules(model, [Qwen3MoeSparseMoeBlock])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    built = time.perf_counter() - t0
    if rank == 0:
        print(f"built {params / 1e9:.2f} B parameters in {built:.0f} s", flush=True)
    steps, host_peak = [], host_used_gib()
    for step in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        losses = []
        for i in range(G):
            # each rank its own windows, as fitgpt's data-parallel ranks read theirs
            ids = windows(args.data, S, M, ((step * G + i) * world + rank) * M)[:, :S].cuda()
            # transformers shifts the labels itself: the inputs are the labels
            out_ = engine(input_ids=ids, labels=ids, use_cache=False)
            engine.backward(out_.loss)
            engine.step()
            losses.append(float(out_.loss.detach()))
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        host_peak = max(host_peak, host_used_gib())
        rec = {"step": step + 1, "s": dt, "tokens_per_s": M * G * S * world / dt,
               "loss": sum(losses) / len(losses)}  # fmt: skip
        steps.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
    timed_s = [r["s"] for r in steps[1:]] or [steps[0]["s"]]
    where = "offloaded to pinned CPU memory" if args.offload == "cpu" else "on the GPUs"
    res = {
        "system": f"transformers Qwen3MoeForCausalLM + DeepSpeed ZeRO-3, params and optimizer "
        f"{where}, gradient checkpointing",
        "ranks": world,
        "deepspeed": deepspeed.__version__,
        "gpu": torch.cuda.get_device_name(),
        "params": params,
        "layers": args.layers,
        "micro_batch": M,
        "grad_accum": G,
        "seq_len": S,
        "built_s": built,
        "median_step_s": statistics.median(timed_s),
        "tokens_per_s": M * G * S * world / statistics.median(timed_s),
        "tokens_per_s_per_gpu": M * G * S / statistics.median(timed_s),
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gpu_mem_cap": args.gpu_mem,
        "host_used_peak_gib": host_peak,
        "steps": steps,
    }
    if rank == 0:
        (out / "peer.json").write_text(json.dumps(res) + "\n")
        print(json.dumps({k: v for k, v in res.items() if k != "steps"}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "stage", choices=["grouped", "sink", "blockmem", "ossexp", "peer", "chat", "make"]
    )
    p.add_argument("out", type=Path)
    p.add_argument("--data", help="the preprocessed prefix fitgpt trains on")
    p.add_argument("--vocab", type=int, default=50257, help="the data tokenizer's vocabulary")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--offload",
        choices=["cpu", "none"],
        default="cpu",
        help="peer: where ZeRO-3 keeps the parameters and the optimizer state",
    )
    p.add_argument("--gpu-mem", help="peer: cap the GPU's memory, e.g. 80GB (an H100's)")
    p.add_argument("--text", type=Path, help="chat: the JSON lines of text to make it of")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "grouped":
        grouped(args.out)
    elif args.stage == "sink":
        sink(args.out)
    elif args.stage == "blockmem":
        blockmem(args.out)
    elif args.stage == "ossexp":
        ossexp(args.out)
    elif args.stage == "chat":
        if not args.text:
            sys.exit("chat: --text JSONL is required")
        chat(args.out, args.text)
    elif args.stage == "make":
        make(args.out, args.layers)
    else:
        if not args.data:
            sys.exit("peer: --data PREFIX is required")
        peer(args.out, args)


if __name__ == "__main__":
    main()
