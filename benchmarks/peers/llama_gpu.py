"""Issue 36 on one GPU, as a user would: a Llama-3.1-8B-shaped Hugging Face folder (random
weights, saved by transformers) fine-tuned by `fitgpt train --init-from`, exported, loaded back
by transformers, and sampled by `fitgpt generate`.

Stages (`python3 benchmarks/peers/llama_gpu.py STAGE OUT`):
  make     OUT/hf: LlamaForCausalLM of the 3.1-8B shape (llama3 rope scaling, GQA 32:8, untied
           128,256-row head) with random weights, bf16, 5 GB shards; a Llama-3-style tokenizer
           (byte-level BPE trained on the Python standard library's source, BOS by its
           post-processor, reserved special tokens filling the vocabulary to 128,256)
  tokenizer  that tokenizer alone, in OUT (benchmarks/memory/long_h100.sh: the 8B shape's own vocabulary)
  heldout  the mean next-token loss on held-out windows of the preprocessed tokens, by
           transformers on OUT/export and by fitgpt on the run's checkpoint (same windows,
           both bf16 weights on the GPU): one JSON line
benchmarks/peers/llama_gpu.sh runs the whole sequence with the fitgpt commands between the stages.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

SHAPE = dict(  # meta-llama/Llama-3.1-8B's config.json
    vocab_size=128_256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
    eos_token_id=128001, hidden_act="silu",
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192),
)  # fmt: skip
# Qwen/Qwen2.5-14B's config.json (Qwen2ForCausalLM: q/k/v biases); MODEL=qwen2.5-14b
QWEN_14B = dict(
    vocab_size=152_064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
    num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072,
    rope_theta=1_000_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
    use_sliding_window=False,
)  # fmt: skip
# meta-llama/Llama-3.1-70B's config.json; MODEL=llama3.1-70b (too big for one GPU: built on
# the meta device, materialised in host RAM and filled from the GPUs, benchmarks/multi_gpu/llama70_x4.sh)
LLAMA_70B = dict(
    SHAPE, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8,
)  # fmt: skip
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def trained_bpe(texts):
    """A byte-level BPE of 32,000 tokens trained on `texts` with Llama 3's split (the special
    tokens each peer script adds itself)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32_000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer(folder: Path, text_jsonl: Path) -> None:
    from tokenizers import AddedToken, processors

    tok = trained_bpe(json.loads(x)["text"] for x in text_jsonl.open())
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eot_id|>"]  # fmt: skip
    n = tok.get_vocab_size()
    vocab = SHAPE["vocab_size"]  # the tokenizer fills the model's rows, as Llama 3's does
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(vocab - n - len(named))]
    tok.add_special_tokens([AddedToken(t, special=True) for t in named + reserved])
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", bos)],
    )  # fmt: skip
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    SHAPE["bos_token_id"], SHAPE["eos_token_id"] = bos, tok.token_to_id("<|end_of_text|>")


def make(out: Path, text_jsonl: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    qwen = os.environ.get("MODEL") == "qwen2.5-14b"
    big = os.environ.get("MODEL") == "llama3.1-70b"
    if qwen or big:
        shape = QWEN_14B if qwen else LLAMA_70B
        SHAPE.clear()
        SHAPE.update(shape)
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tokenizer(hf, text_jsonl)
    t1 = time.time()
    cfg = (Qwen2Config if qwen else LlamaConfig)(**SHAPE, torch_dtype="bfloat16")
    torch.manual_seed(0)
    if big:
        model = filled_on_gpus(LlamaForCausalLM, cfg)
    else:
        with torch.device("cuda"):  # transformers' own init, std 0.02
            model = (Qwen2ForCausalLM if qwen else LlamaForCausalLM)(cfg).to(torch.bfloat16)
    model.save_pretrained(hf, max_shard_size="5GB")
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"stage": "make", "params": n, "tokenizer_s": round(t1 - t0, 1),
                      "model_s": round(time.time() - t1, 1)}))  # fmt: skip


@torch.no_grad()
def filled_on_gpus(cls, cfg):
    """A model bigger than one GPU: built on the meta device, materialised in host RAM in bf16,
    and given transformers' initial values (normal, std initializer_range; norms 1) drawn on
    the GPUs in turn, one tensor at a time: seconds, where CPU sampling of 70 B would take
    minutes."""
    with torch.device("meta"):
        model = cls(cfg).to(torch.bfloat16)
    model.to_empty(device="cpu")
    gpus = torch.cuda.device_count()
    for i, (name, p) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        dev = torch.device("cuda", i % gpus)
        g = torch.empty(p.shape, dtype=p.dtype, device=dev).normal_(0, cfg.initializer_range)
        p.copy_(g.cpu())
    return model


def windows(prefix: str, seq: int, count: int) -> torch.Tensor:
    """`count` windows of seq+1 tokens from the end of the token file, inside the documents
    past the training split (the default 969,30,1: the valid and test documents, which
    `fitgpt train` never reads), so the tokens are held out."""
    from fitgpt.data.indexed import IndexedDataset
    from fitgpt.data.splits import split_ranges

    ds = IndexedDataset(prefix)
    n = len(ds)
    first = split_ranges("969,30,1", n)["train"][1]
    toks = np.concatenate([np.asarray(ds[i]) for i in range(first, n)])
    need = count * (seq + 1)
    assert len(toks) >= need, (len(toks), need)
    return torch.from_numpy(toks[-need:].astype(np.int64)).view(count, seq + 1)


@torch.no_grad()
def heldout(out: Path, prefix: str, run: Path) -> None:
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from fitgpt.infer.generate import load_model

    seq, count = 1024, 8
    w = windows(prefix, seq, count).cuda()
    x, y = w[:, :-1], w[:, 1:]
    model, _ = load_model(run, torch.device("cuda"))
    ours = float(model(x, y))
    del model
    torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(
        out / "export", local_files_only=True, dtype=torch.bfloat16
    ).cuda()
    logits = hf(x).logits.float()
    theirs = float(F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1)))
    print(json.dumps({"stage": "heldout", "tokens": count * seq, "fitgpt": ours,
                      "transformers": theirs, "diff": abs(ours - theirs)}))  # fmt: skip


if __name__ == "__main__":
    stage, out = sys.argv[1], Path(sys.argv[2])
    if stage == "make":
        make(out, Path(sys.argv[3]))
    elif stage == "tokenizer":  # the tokenizer alone, into OUT
        out.mkdir(parents=True, exist_ok=True)
        tokenizer(out, Path(sys.argv[3]))
    else:
        heldout(out, sys.argv[3], Path(sys.argv[4]))
