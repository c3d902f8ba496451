"""`--init-from HF_FOLDER` reads the Hugging Face safetensors in place (interop/hf_read.py): every
engine, ZeRO stage, TP degree and world size gets exactly the HF weights (bf16 and fp32, sharded
folders, fused k/v and gate/up, padded vocabulary rows, tied and untied heads), the first loss is
transformers', no copy is written under --out, host RAM stays near the engine's own, and a
damaged source is refused in one line before any work.

Every HF model is built here with random weights and saved with a small max_shard_size."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import run_config, train

from fitgpt.data.config import open_data
from fitgpt.data.source import BatchLoader
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.errors import UserError
from fitgpt.interop.hf import mapping_for_model
from fitgpt.interop.init_source import find_source
from fitgpt.model.hf_map import to_hf
from fitgpt.train.init_from import model_from_source

transformers = pytest.importorskip("transformers")


def hf_folder(kind: str, dtype: torch.dtype, folder):
    """A random HF model saved in `dtype` as shards of ~40 KB: 'llama' (8 heads, 2 key/value
    heads, vocabulary 300 padded to 384, untied) or 'gpt2' (tied, Conv1D weights)."""
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    else:
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=300,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(1.0 if ("norm" in n or ".ln_" in n) and n.endswith("weight") else 0.0, 0.08)
    model.to(dtype).save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()  # sharded
    # read back in fp32 (rotary buffers computed afresh, not the bf16-rounded ones)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def engine_of(source, ecfg: EngineConfig, ctx):
    ctx = ctx.laid_out(ecfg.tensor_parallel, ecfg.context_parallel)
    e = build_engine(source.model, ecfg, PrecisionConfig(precision="fp32"), OptimConfig(), ctx)
    e.load_state(source.weights, {}, optimizer=False)
    return e


def assert_hf_weights(model, ref) -> None:
    """Every HF tensor, cut back out of the fitgpt model by export's own function (hf_map.py to_hf),
    equals transformers' exactly (the bf16 values are fp32-exact)."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    theirs = ref.state_dict()
    for m in mapping_for_model(cfg).tensor_maps(cfg):
        got = to_hf(m, params[m.fitgpt].detach().float().cpu(), cfg)
        assert torch.equal(got, theirs[m.hf].float()), m.hf
    # the padded vocabulary rows are zero
    assert not params["wte.weight"][cfg.vocab_size :].any()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_weight_is_the_hf_one_at_world_size_1(kind, dtype, tmp_path):
    ref = hf_folder(kind, dtype, tmp_path / "hf")
    source = find_source(str(tmp_path / "hf"))
    cpu = DistContext(0, 1, 0, torch.device("cpu"))
    for ecfg in (EngineConfig(engine="ddp"), EngineConfig(engine="zero", offload_optimizer="cpu")):
        e = engine_of(source, ecfg, cpu)
        model = e.inference_model()
        assert_hf_weights(model, ref)
        x = torch.randint(0, source.model.vocab_size, (2, 16))
        with torch.no_grad():
            want, got = ref(x).logits, model.eval()(x)
        torch.testing.assert_close(got[..., : want.shape[-1]], want, rtol=0, atol=1e-5)
        e.close()
    assert not list(tmp_path.glob("**/.init-from"))


def first_loss(ref, run, world: int) -> float:
    """transformers' mean loss on the run's first global batch (every data-parallel rank's)."""
    src, _, _ = open_data(run.data, run.model.seq_len, run.model.vocab_size, 0)
    rows = [BatchLoader(src, run.train.micro_batch, r, world).next() for r in range(world)]
    x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    with torch.no_grad():
        logits = ref(x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


def _two_ranks(rank, world, folder, out, ecfg, dp, want_loss) -> None:
    from fitgpt.dist import init_distributed

    ctx = init_distributed("cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    source = find_source(str(folder))
    e = engine_of(source, ecfg, ctx)
    model = e.inference_model()  # collective under TP: the whole weights on every rank
    assert_hf_weights(model, ref)
    e.close()
    run = run_config(out, steps=1, micro_batch=2, data="synthetic")
    run = dataclasses.replace(run, model=model_from_source(source, {}, run.data), engine=ecfg)
    got = train(run, ctx, init_from=source)["losses"]
    assert got[0] == pytest.approx(want_loss, abs=1e-5), (got, want_loss)


@pytest.mark.slow
@pytest.mark.parametrize(
    "ecfg, dp",
    [
        (EngineConfig(engine="zero", zero_stage=3), 2),
        (EngineConfig(engine="ddp", tensor_parallel=2), 1),
        (EngineConfig(engine="zero", zero_stage=3, tensor_parallel=2), 1),
    ],
    ids=["zero3", "tp2", "tp2_zero3"],
)
def test_two_ranks_load_the_hf_weights_and_start_at_transformers_loss(gloo, tmp_path, ecfg, dp):
    ref = hf_folder("llama", torch.bfloat16, tmp_path / "hf")
    run = run_config(tmp_path / "run", steps=1, micro_batch=2, data="synthetic")
    source = find_source(str(tmp_path / "hf"))
    run = dataclasses.replace(run, model=model_from_source(source, {}, run.data))
    want = first_loss(ref, run, dp)
    gloo(2, _two_ranks, tmp_path / "hf", tmp_path / "run", ecfg, dp, want)
    assert not (tmp_path / "run" / ".init-from").exists()


@pytest.mark.slow
def test_gpt2_tp2_reads_conv1d_columns(gloo, tmp_path):
    """GPT-2's transposed Conv1D weights and fused q/k/v split over two TP ranks."""
    ref = hf_folder("gpt2", torch.float32, tmp_path / "hf")
    run = run_config(tmp_path / "run", steps=1, micro_batch=2, data="synthetic")
    source = find_source(str(tmp_path / "hf"))
    run = dataclasses.replace(run, model=model_from_source(source, {}, run.data))
    want = first_loss(ref, run, 1)
    ecfg = EngineConfig(engine="ddp", tensor_parallel=2)
    gloo(2, _two_ranks, tmp_path / "hf", tmp_path / "run", ecfg, 1, want)


def test_gpt2_fine_tunes_at_a_shorter_seq_len_with_its_whole_position_table(tmp_path):
    """GPT-2 (n_positions 32) fine-tuned at --seq-len 16, as transformers trains it at any
    length up to n_positions: the first loss is transformers' on the 16-token rows, the export
    keeps n_positions 32 and gives fitgpt's logits; a fitgpt run of it (its table's rows held
    in max_positions) starts a shorter run again; past the table is refused in one line."""
    from fitgpt.infer.generate import generation_context, load_model
    from fitgpt.interop.hf_export import export_hf
    from fitgpt.train.init_from import fitgpt_source

    ref = hf_folder("gpt2", torch.float32, tmp_path / "hf")
    source = find_source(str(tmp_path / "hf"))
    run = run_config(tmp_path / "run", steps=2, micro_batch=2, data="synthetic")
    model = model_from_source(source, {"seq_len": 16}, run.data)
    assert (model.seq_len, model.positions) == (16, 32)
    assert generation_context(model) == 32  # generate reads the table's rows, as transformers
    run = dataclasses.replace(run, model=model)
    want = first_loss(ref, run, 1)
    cpu = DistContext(0, 1, 0, torch.device("cpu"))
    got = train(run, cpu, init_from=source)["losses"]
    assert got[0] == pytest.approx(want, abs=1e-5), (got, want)
    export_hf(tmp_path / "run", tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["n_positions"] == 32
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ours, _ = load_model(tmp_path / "run", torch.device("cpu"))
    x = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[..., :300], theirs(x).logits, rtol=0, atol=1e-5)
    again = fitgpt_source(tmp_path / "run")
    assert model_from_source(again, {"seq_len": 8}, run.data).positions == 32
    with pytest.raises(UserError, match="learned position table of 32 rows"):
        model_from_source(source, {"seq_len": 64}, run.data)


def test_a_damaged_source_is_refused_before_any_work(tmp_path):
    hf_folder("llama", torch.bfloat16, tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "hf" / shard).rename(tmp_path / "gone")
    with pytest.raises(UserError, match=r"names 1 shard\(s\) missing .* download every shard"):
        find_source(str(tmp_path / "hf"))
    (tmp_path / "gone").rename(tmp_path / "hf" / shard)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(UserError, match=r"has shape \[96, 64\], config.json implies \[128, 64\]"):
        find_source(str(tmp_path / "hf"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with open(tmp_path / "hf" / shard, "r+b") as f:  # a truncated download
        f.truncate(f.seek(0, 2) - 4)
    with pytest.raises(UserError, match="truncated"):
        find_source(str(tmp_path / "hf"))


# ---- host RAM ----------------------------------------------------------------------------------
RSS_SCRIPT = r"""
import json, sys, torch
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.interop.init_source import find_source

def status(key):  # bytes of a /proc/self/status line (VmRSS: now, VmHWM: peak since reset)
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024
source = find_source(sys.argv[1])
e = build_engine(source.model, EngineConfig(engine=sys.argv[2]), PrecisionConfig(precision="fp32"),
                 OptimConfig(), DistContext(0, 1, 0, torch.device("cpu")))
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts from the current RSS
e.load_state(source.weights, {}, optimizer=False)
peak = status("VmHWM")
w = dict(e.inference_model().named_parameters())["blocks.3.mlp.fc.weight"]
print(json.dumps({"before": before, "peak": peak, "params": source.model.num_params(),
                  "probe": w[0, :4].tolist()}))
"""


def big_llama(folder) -> int:
    """A Llama of ~87 M parameters in bf16 (174 MB, 4 shards), written straight with
    safetensors (a transformers model this size would take long to build); its bytes."""
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    folder.mkdir()
    (folder / "config.json").write_text(cfg.to_json_string())
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (32000, 768), "model.norm.weight": (768,)}
    for i in range(6):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (768,), p + "post_attention_layernorm.weight": (768,),
            p + "self_attn.q_proj.weight": (768, 768), p + "self_attn.k_proj.weight": (256, 768),
            p + "self_attn.v_proj.weight": (256, 768), p + "self_attn.o_proj.weight": (768, 768),
            p + "mlp.gate_proj.weight": (2048, 768), p + "mlp.up_proj.weight": (2048, 768),
            p + "mlp.down_proj.weight": (768, 2048),
        }  # fmt: skip
    shapes["lm_head.weight"] = (32000, 768)
    names, weight_map, total = list(shapes), {}, 0
    for k in range(4):
        part = names[k::4]
        ts = {n: (torch.randn(shapes[n], generator=g) * 0.02).bfloat16() for n in part}
        fname = f"model-{k + 1:05d}-of-00004.safetensors"
        save_file(ts, str(folder / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, fname)
        total += sum(t.numel() * 2 for t in ts.values())
        del ts
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


@pytest.mark.slow
def test_loading_holds_little_beyond_the_engines_own_weights(tmp_path):
    """Peak RSS while a ~87 M-parameter bf16 Llama (174 MB; 350 MB in fp32) loads into an
    engine: the engine's fp32 weights are already resident; the load may add the slices in
    flight, never a second copy of the model (the old scratch import held a chunk and the
    safetensors writer's copy of it, then read it back)."""
    bf16_bytes = big_llama(tmp_path / "hf")
    for engine in ("zero", "ddp"):
        r = subprocess.run(
            [sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "hf"), engine],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        added = got["peak"] - got["before"]
        print(
            f"{engine}: model {bf16_bytes / 2**20:.0f} MiB bf16, {got['params'] * 4 / 2**20:.0f} "
            f"MiB fp32; RSS before the load {got['before'] / 2**20:.0f} MiB, peak during it "
            f"{got['peak'] / 2**20:.0f} MiB (+{added / 2**20:.0f} MiB)"
        )
        assert any(v != 0 for v in got["probe"])  # the weights did arrive
        # the chunk engine reads into its own buffers: the slices in flight alone
        # (hf_read.SLICE: 24 MiB); the torch engine holds one chunk (its embedding: 94 MiB)
        # beside the one it reads, as for any checkpoint. Either way, no copy of the model.
        assert added < (0.25 if engine == "zero" else 1.25) * bf16_bytes, got
