"""Set-up helpers for the `fitgpt import hf` rows of test_cli_bad_inputs.py: a tiny HF GPT-2 or
Llama checkpoint (config.json + model.safetensors, random weights, written without transformers
so a case costs milliseconds), then one thing broken in it."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from fitgpt.interop.safetensors_stream import SafetensorsWriter

CONFIG = {"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "n_positions": 16}
CONFIG["vocab_size"] = 64


def _shapes() -> list[tuple[str, tuple[int, ...]]]:
    h, v, s = CONFIG["n_embd"], CONFIG["vocab_size"], CONFIG["n_positions"]
    out = [("transformer.wte.weight", (v, h)), ("transformer.wpe.weight", (s, h))]
    for i in range(CONFIG["n_layer"]):
        b = f"transformer.h.{i}."
        out += [(b + "ln_1.weight", (h,)), (b + "ln_1.bias", (h,))]
        out += [(b + "attn.c_attn.weight", (h, 3 * h)), (b + "attn.c_attn.bias", (3 * h,))]
        out += [(b + "attn.c_proj.weight", (h, h)), (b + "attn.c_proj.bias", (h,))]
        out += [(b + "ln_2.weight", (h,)), (b + "ln_2.bias", (h,))]
        out += [(b + "mlp.c_fc.weight", (h, 4 * h)), (b + "mlp.c_fc.bias", (4 * h,))]
        out += [(b + "mlp.c_proj.weight", (4 * h, h)), (b + "mlp.c_proj.bias", (h,))]
    return [*out, ("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,))]


LLAMA = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 12}
LLAMA |= {"num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}
LLAMA |= {"vocab_size": 64, "tie_word_embeddings": True}


def _llama_shapes() -> list[tuple[str, tuple[int, ...]]]:
    h, f, v = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["vocab_size"]
    kv = LLAMA["num_key_value_heads"] * h // LLAMA["num_attention_heads"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(LLAMA["num_hidden_layers"]):
        b = f"model.layers.{i}."
        out += [(b + "input_layernorm.weight", (h,)), (b + "self_attn.q_proj.weight", (h, h))]
        out += [(b + "self_attn.k_proj.weight", (kv, h)), (b + "self_attn.v_proj.weight", (kv, h))]
        out += [
            (b + "self_attn.o_proj.weight", (h, h)),
            (b + "post_attention_layernorm.weight", (h,)),
        ]
        out += [(b + "mlp.gate_proj.weight", (f, h)), (b + "mlp.up_proj.weight", (f, h))]
        out += [(b + "mlp.down_proj.weight", (h, f))]
    return [*out, ("model.norm.weight", (h,))]


def checkpoint(folder: Path, weights: str = "model.safetensors", llama: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA if llama else CONFIG))
    shapes = _llama_shapes() if llama else _shapes()
    with SafetensorsWriter(folder / weights, shapes, torch.float32, {}) as w:
        for name, shape in shapes:
            w.write(name, torch.randn(shape))


def broken_llama(change: dict | None = None, how: str = "none") -> Callable[[dict], None]:
    """A Llama checkpoint at {t}/hf with `change` merged into its config.json (a key set to
    None is removed), or one file broken by name (see the branches)."""

    def f(p: dict) -> None:
        d = Path(p["t"]) / "hf"
        checkpoint(d, llama=True)
        cfg = {k: v for k, v in (LLAMA | (change or {})).items() if v is not None}
        (d / "config.json").write_text(json.dumps(cfg))
        if how == "missing-shard":
            names = dict.fromkeys(
                (n for n, _ in _llama_shapes()), "model-00001-of-00002.safetensors"
            )
            names["model.norm.weight"] = "model-00002-of-00002.safetensors"
            os.replace(d / "model.safetensors", d / "model-00001-of-00002.safetensors")
            (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
        elif how == "extra-bias":  # an o_proj bias the config has no place for
            names = [*_llama_shapes(), ("model.layers.0.self_attn.o_proj.bias", (8,))]
            with SafetensorsWriter(d / "model.safetensors", names, torch.float32, {}) as w:
                for name, shape in names:
                    w.write(name, torch.randn(shape))
        elif how != "none":
            raise ValueError(how)

    return f


def broken(how: str, rel: str = "hf") -> Callable[[dict], None]:
    """A checkpoint at {t}/rel with one defect, by name (see the branches)."""

    def f(p: dict) -> None:
        d = Path(p["t"]) / rel
        checkpoint(d)
        st = d / "model.safetensors"
        if how == "truncated":
            os.truncate(st, st.stat().st_size - 100)
        elif how == "header-too-long":
            data = st.read_bytes()
            st.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
        elif how == "int-dtype":
            data = st.read_bytes()
            (n,) = struct.unpack("<Q", data[:8])
            head = json.loads(data[8 : 8 + n])
            head["transformer.wpe.weight"]["dtype"] = "I32"
            raw = json.dumps(head, separators=(",", ":")).encode()
            raw += b" " * (n - len(raw))  # same length: the data section stays where it was
            st.write_bytes(data[:8] + raw + data[8 + n :])
        elif how == "config-garbage":
            (d / "config.json").write_bytes(b"\xff\xfe\x00 not json")
        elif how == "config-truncated":
            (d / "config.json").write_text(json.dumps(CONFIG)[:20])
        elif how == "config-more-layers":
            (d / "config.json").write_text(json.dumps(CONFIG | {"n_layer": 100_000}))
        elif how == "missing-shard":
            os.replace(st, d / "model-00001-of-00002.safetensors")
            names = dict.fromkeys((n for n, _ in _shapes()), "model-00001-of-00002.safetensors")
            names["transformer.ln_f.bias"] = "model-00002-of-00002.safetensors"
            (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
        elif how == "empty-tokenizer":
            (d / "vocab.json").write_bytes(b"")
            (d / "merges.txt").write_bytes(b"")
        elif how == "truncated-bin":  # the older format: a torch.save zip, cut short
            bin_ = d / "pytorch_model.bin"
            torch.save({n: torch.zeros(shape) for n, shape in _shapes()}, bin_)
            st.unlink()
            os.truncate(bin_, bin_.stat().st_size // 2)
        elif how == "no-config":
            (d / "config.json").unlink()
        elif how != "none":
            raise ValueError(how)

    return f
