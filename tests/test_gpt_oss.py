"""gpt-oss (model/families/gpt_oss) against transformers' GptOssForCausalLM: logits and the
load-balancing loss, import then export bit for bit, greedy generation, a 30-step fine-tune
against a plain transformers loop, MXFP4 experts (the dequantization against transformers'
own function, a quantized folder against transformers loading it), the presets' parameter
counts, the CLI's train --init-from and export, refusals.

Every HF model is built here with random weights (3-4 layers, 64 wide, 4 experts, top 2,
windows of 6-8 under 32-token sequences) and saved to a temporary folder: nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    assert_config_carried,
    close,
    engine_losses,
    imported_runs,
    saved_hf_models,
    tensors,
)
from safetensors import safe_open
from safetensors.torch import save_file
from test_moe import STEPS, hf_loss
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from fitgpt.cli import main
from fitgpt.data.config import DataConfig, open_data
from fitgpt.data.source import BatchLoader
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig
from fitgpt.engine.layout import chunk_layout
from fitgpt.errors import UserError
from fitgpt.infer.generate import SampleConfig, generate, load_model
from fitgpt.interop.hf import mapping_for_hf, model_config_from_hf
from fitgpt.interop.hf_export import export_hf
from fitgpt.interop.hf_import import import_hf
from fitgpt.interop.mxfp4 import dequantize_param
from fitgpt.model import build_model, family_of, get_preset
from fitgpt.model.families.gpt_oss.model import layer_windows, row_bias

BASE = dict(
    hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=32,
    num_local_experts=4, num_experts_per_tok=2, vocab_size=300, max_position_embeddings=64,
    bos_token_id=1, eos_token_id=2, initializer_range=0.05,  # export carries it back
)  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 10000.0}  # fmt: skip
# name -> fields: the default layer pattern (sliding, full, sliding) with YaRN and 2:1 heads
# (and gpt-oss-20b's router_aux_loss_coef 0.9 with the aux loss off: export keeps it);
# explicit layer types, a clamp that bites (limit 1.5, alpha 1.2), 4:1 heads and the aux loss on
CASES = {
    "window6-yarn": dict(num_hidden_layers=3, num_key_value_heads=2, sliding_window=6,
                         rope_parameters=YARN, router_aux_loss_coef=0.9),
    "types-clamp-aux": dict(num_hidden_layers=4, num_key_value_heads=1, sliding_window=8,
                            layer_types=["full_attention", "sliding_attention",
                                         "sliding_attention", "full_attention"],
                            swiglu_limit=1.5, swiglu_alpha=1.2, output_router_logits=True,
                            router_aux_loss_coef=0.02),
}  # fmt: skip
X = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
CPU = DistContext(0, 1, 0, torch.device("cpu"))


def build_hf(name: str, seed: int = 0, **changes) -> GptOssForCausalLM:
    """A random GptOssForCausalLM of case `name`; norms near 1, biases and sinks large enough
    to matter (a sink swapped for a bias, or gate for up, cannot hide)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**(BASE | CASES[name] | changes))).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            big = "sinks" in n or "bias" in n
            p.normal_(1.0 if "norm" in n else 0.0, 0.1 if "norm" in n else 0.3 if big else 0.08)
    return model


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Each case's model, saved once: {name: (model, folder)}."""
    return saved_hf_models(build_hf, CASES, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def imported(hf_folders, tmp_path_factory):
    """Each case imported once: {name: run folder}."""
    return imported_runs(hf_folders, tmp_path_factory.mktemp("runs"))


# ---- the network -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_training_loss_equal_transformers(hf_folders, imported, name):
    ref, _ = hf_folders[name]
    model, _ = load_model(imported[name], torch.device("cpu"))
    cfg = model.cfg
    assert cfg.family == "gpt_oss" and cfg.num_experts == 4 and cfg.qkv_bias
    with torch.no_grad():
        torch.testing.assert_close(model(X)[..., :300], ref(X).logits, rtol=0, atol=1e-5)
        # shorter than every window, and one token: the masks' other shapes
        for x in (X[:, :5], X[:1, :1]):
            torch.testing.assert_close(model(x)[..., :300], ref(x).logits, rtol=0, atol=1e-5)
    model.train(), ref.train()
    x, y = X[:, :-1], X[:, 1:]
    want, want_aux, ce = hf_loss(ref, x, y)
    coef = ref.config.router_aux_loss_coef if ref.config.output_router_logits else 0.0
    assert cfg.router_aux_loss_coef == coef
    got = model(x, y)
    assert abs(got.item() - (ce.item() + coef * want_aux.item())) < 1e-5
    if coef:
        assert abs(got.item() - want.item()) < 1e-5
    report = model.router_report()
    assert abs(report["router_aux_loss"] - want_aux.item()) < 1e-5
    assert len(report["expert_load"]) == cfg.n_layer


def test_the_cases_cover_what_the_family_varies(imported):
    cfgs = {n: load_model(r, torch.device("cpu"))[0].cfg for n, r in imported.items()}
    a, b = cfgs["window6-yarn"], cfgs["types-clamp-aux"]
    assert a.layer_types == () and layer_windows(a) == (6, None, 6) and a.kv_heads == 2
    assert a.rope_scaling.kind == "yarn" and a.rope_scaling.truncate is False
    assert layer_windows(b) == (None, 8, 8, None) and b.kv_heads == 1
    assert (b.swiglu_limit, b.swiglu_alpha) == (1.5, 1.2) and b.router_aux_loss_coef == 0.02
    assert max(a.sliding_window, b.sliding_window) < X.shape[1]


def test_the_clamp_and_the_sinks_change_the_output(imported):
    """Each of gpt-oss's departures from a plain MoE Llama moves the logits: the limit raised
    past every activation, the sinks made so small their weight is 0 (no sink)."""
    model, _ = load_model(imported["types-clamp-aux"], torch.device("cpu"))
    with torch.no_grad():
        base = model(X)[..., :300]
        for b in model.blocks:
            b.mlp.experts.limit = 1e9
        assert (model(X)[..., :300] - base).abs().max() > 1e-3
        for b in model.blocks:
            b.mlp.experts.limit = 1.5
            b.attn.sinks.fill_(-1e4)
        assert (model(X)[..., :300] - base).abs().max() > 1e-3


# ---- in and out --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_import_then_export_is_bit_exact_and_loads_in_transformers(
    hf_folders, imported, tmp_path, name
):
    ref, folder = hf_folders[name]
    export_hf(imported[name], tmp_path / "out")
    a, b = tensors(folder), tensors(tmp_path / "out")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    src, out = (json.loads((p / "config.json").read_text()) for p in (folder, tmp_path / "out"))
    for key in (
        "model_type", "architectures", "intermediate_size", "num_local_experts",
        "num_experts_per_tok", "sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit",
        "attention_bias", "output_router_logits", "router_aux_loss_coef", "head_dim",
    ):  # fmt: skip
        assert src.get(key) == out.get(key), key
    assert_config_carried(folder, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert type(back) is GptOssForCausalLM
    assert back.config.rope_parameters == ref.config.rope_parameters
    with torch.no_grad():
        assert torch.equal(back(X).logits, ref(X).logits)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generation_equals_transformers(hf_folders, imported, name):
    """30 tokens with fitgpt's KV cache: 35 positions through windows of 6 and 8."""
    ref, _ = hf_folders[name]
    model, _ = load_model(imported[name], torch.device("cpu"))
    x = X[:1, :5]
    ours = generate(model, x, SampleConfig(max_new_tokens=30, temperature=0.0))
    with torch.no_grad():
        theirs = ref.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=30,
            min_new_tokens=30, pad_token_id=0,
        )  # fmt: skip
    assert ours[0].tolist() == theirs[0].tolist()


# ---- training ----------------------------------------------------------------------------------
LR, MB = 2e-3, 4


def transformers_losses(ref, batches) -> list[float]:
    """A plain transformers loop: AdamW as fitgpt's (betas 0.9/0.95, eps 1e-8, decay 0.1 on
    the matrices only: gpt-oss's [E, 2F] and [E, H] expert biases are biases), the global norm
    clipped at 1, a constant rate, fp32; the loss with coef·aux where config.json asks."""
    named = list(ref.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2 and not n.endswith("bias")]
    rest = [p for n, p in named if not (p.ndim >= 2 and not n.endswith("bias"))]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    ref.train()
    out = []
    for x, y in batches:
        y = y.contiguous()
        loss = ref(x, labels=y, shift_labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_the_expert_biases_are_not_decayed():
    """The layout's one rule (engine/layout.py decays): a bias of any shape is not decayed."""
    cfg = model_config_from_hf(BASE | CASES["window6-yarn"] | {"model_type": "gpt_oss"}, "c")
    with torch.device("meta"):
        layout = chunk_layout(build_model(cfg))
    # block 0 is two chunks: attention and router, then the experts (a chunk of their own)
    assert [c.name for c in layout[1:3]] == ["block.0", "block.0.experts"]
    decayed = {s.name for c in layout[1:3] for s in c.slots if s.offset < c.decay_numel}
    assert "blocks.0.mlp.experts.gate_up" in decayed and "blocks.0.mlp.router.weight" in decayed
    assert not any(n.endswith(("bias", "sinks")) for n in decayed), decayed


def test_a_30_step_fine_tune_equals_a_transformers_loop(hf_folders, tmp_path):
    """`fitgpt train --init-from FOLDER` (zero engine, stage 0, fp32) against transformers on
    the same batches, the aux loss on from config.json."""
    name = "types-clamp-aux"
    _, folder = hf_folders[name]
    ref = build_hf(name)
    out = tmp_path / "run"
    argv = [
        "train", "--init-from", str(folder), "--plan", "off", "--engine", "zero",
        "--zero-stage", "0", "--precision", "fp32", "--device", "cpu", "--data", "synthetic",
        "--seq-len", "32", "--micro-batch", str(MB), "--grad-accum", "1", "--steps", str(STEPS),
        "--lr", str(LR), "--min-lr", str(LR), "--warmup", "0", "--eval-every", "0",
        "--log-every", "1", "--out", str(out),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code in (0, None)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in recs if r.get("kind") == "train"]
    src, _, _ = open_data(DataConfig(data="synthetic"), 32, 300, 0)
    loader = BatchLoader(src, MB, 0, 1)
    want = transformers_losses(ref, [loader.next()[:2] for _ in range(STEPS)])
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
    assert want[-1] < want[0] - 0.1  # it learns: the comparison is of moving losses


def test_the_engines_train_the_three_dimensional_experts_alike():
    """ZeRO-3, and offloaded, streamed blocks, against DDP in one process: the experts'
    [E, H, 2F] parameters and [E, 2F] biases sharded, streamed and stepped as any other (aux
    loss off: with it, Adam amplifies the rounding of near-zero expert-bias gradients between
    engines, as it would between any two summation orders)."""
    cfg = model_config_from_hf(
        BASE | CASES["window6-yarn"] | {"model_type": "gpt_oss", "max_position_embeddings": 32},
        "config.json",
    )
    ref = engine_losses(cfg, EngineConfig(engine="ddp"), CPU, 4, 1.0)
    for ecfg in (
        EngineConfig(engine="zero", zero_stage=3),
        EngineConfig(engine="zero", zero_stage=0, checkpointing="full", offload_optimizer="cpu",
                     offload_blocks=2, offload_params="cpu"),
    ):  # fmt: skip
        got = engine_losses(cfg, ecfg, CPU, 4, 1.0)
        assert close(got["loss"], ref["loss"]) and close(got["norm"], ref["norm"]), ecfg
    assert got["shapes"]["blocks.0.mlp.experts.gate_up"] == [4, 64, 64]


# ---- MXFP4 -------------------------------------------------------------------------------------
EDGE_SCALES = [0, 1, 2, 64, 126, 127, 128, 129, 200, 253, 254, 255]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantization_equals_transformers(dtype):
    """Every byte value in random blocks, scales at the edges (2^-127 subnormal, 2^127, 255's
    overflow to inf and NaN) and random ones, against convert_moe_packed_tensors."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code, both nibbles
    scales = torch.randint(100, 140, (3, 24, 4), generator=g, dtype=torch.uint8)
    scales[1].view(-1)[: len(EDGE_SCALES)] = torch.tensor(EDGE_SCALES, dtype=torch.uint8)
    ours = dequantize_param(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == theirs.shape == (3, 128, 24) and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(ours.isnan(), theirs.isnan()) and ours.isinf().any()
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))  # -0 stays -0


def mxfp4_folder(src, dest, seed: int = 0, drop: str | None = None, scale: int | None = None):
    """A copy of HF folder `src` whose experts' gate_up_proj and down_proj are stored as
    MXFP4, as the published folders: random blocks, scales around 2^-5, quantization_config
    mxfp4. `drop`: a tensor left out; `scale`: every scale of layer 0's gate_up set to it."""
    shutil.copytree(src, dest)
    g = torch.Generator().manual_seed(seed)
    state = tensors(src)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, i, o = state.pop(key).shape  # [E, I, O], packed as [E, O, I/32, 16]
        state[key + "_blocks"] = torch.randint(0, 256, (e, o, i // 32, 16), generator=g,
                                               dtype=torch.uint8)  # fmt: skip
        state[key + "_scales"] = torch.randint(119, 124, (e, o, i // 32), generator=g,
                                               dtype=torch.uint8)  # fmt: skip
    if scale is not None:
        state["model.layers.0.mlp.experts.gate_up_proj_scales"].fill_(scale)
    if drop is not None:
        del state[drop]
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def mxfp4(hf_folders, tmp_path_factory):
    return mxfp4_folder(hf_folders["window6-yarn"][1], tmp_path_factory.mktemp("q") / "mxfp4")


def test_an_mxfp4_folder_imports_as_transformers_loads_it(mxfp4, tmp_path):
    """transformers on the CPU (no triton kernels) dequantizes the folder as it loads it; its
    weights and logits against fitgpt's import of the same folder, then fitgpt's export in bf16
    (no quantization_config) loads back with the same weights: MXFP4 values are exact in bf16."""
    ref = AutoModelForCausalLM.from_pretrained(mxfp4, dtype=torch.float32).eval()
    theirs = dict(ref.named_parameters())
    run = import_hf(mxfp4, tmp_path / "run").ckpt.parent
    model, _ = load_model(run, torch.device("cpu"))
    ours = dict(model.named_parameters())
    for i in range(3):
        for a, b in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            w = theirs[f"model.layers.{i}.mlp.experts.{b}"]
            assert torch.equal(ours[f"blocks.{i}.mlp.experts.{a}"], w), (i, a)
    with torch.no_grad():
        torch.testing.assert_close(model(X)[..., :300], ref(X).logits, rtol=0, atol=1e-5)
    export_hf(run, tmp_path / "bf16", dtype="bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert_config_carried(mxfp4, tmp_path / "bf16")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    for n, p in back.named_parameters():
        if "experts" in n and "bias" not in n:
            assert torch.equal(p, theirs[n]), n


# ---- the CLI -----------------------------------------------------------------------------------
def test_cli_trains_from_an_mxfp4_folder_and_exports_what_transformers_loads(mxfp4, tmp_path):
    """`fitgpt train --init-from MXFP4_FOLDER` a few steps, `fitgpt export --format hf --dtype
    bf16`: transformers loads the folder, and its logits are the trained model's (its weights
    rounded to bf16)."""
    run, out = tmp_path / "run", tmp_path / "hf"
    for argv in (
        ["train", "--init-from", str(mxfp4), "--plan", "off", "--device", "cpu", "--data",
         "synthetic", "--seq-len", "32", "--micro-batch", "2", "--steps", "3", "--lr", "1e-3",
         "--eval-every", "0", "--log-every", "1", "--out", str(run)],
        ["export", "--ckpt", str(run), "--format", "hf", "--dtype", "bf16", "--out", str(out)],
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code in (0, None), argv
    model, _ = load_model(run, torch.device("cpu"))
    start, _ = load_model(import_hf(mxfp4, tmp_path / "start").ckpt.parent, torch.device("cpu"))
    moved = [
        (a - b).abs().max() for a, b in zip(model.parameters(), start.parameters(), strict=True)
    ]
    assert max(moved) > 1e-4  # it trained
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(X)[..., :300], back(X).logits, rtol=0, atol=1e-5)


# ---- the presets -------------------------------------------------------------------------------
PUBLISHED = {  # config.json's values of openai/gpt-oss-20b and -120b
    "gpt-oss-20b": dict(num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": dict(num_hidden_layers=36, num_local_experts=128),
}
SHAPE = dict(
    hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
    num_key_value_heads=8, num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096,
                     "rope_theta": 150000.0},
)  # fmt: skip


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_the_presets_count_what_transformers_builds(preset):
    """num_params equals transformers' model of the published config.json on the meta device
    and fitgpt's own network (20.9 B and 116.8 B); the published config imports as the preset;
    the active count less the input embedding is the published 3.6 B and 5.1 B."""
    hf_cfg = GptOssConfig(**SHAPE, **PUBLISHED[preset])
    cfg = get_preset(preset)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in GptOssForCausalLM(hf_cfg).parameters())
        ours = build_model(cfg).num_params()
    assert cfg.num_params() == ours == theirs
    assert model_config_from_hf(hf_cfg.to_dict(), preset) == cfg
    per_expert = 3 * 2880 * 2880 + 2 * 2880 + 2880
    idle = cfg.n_layer * (cfg.num_experts - 4) * per_expert
    assert family_of(cfg).active_params(cfg) == theirs - idle
    published = {"gpt-oss-20b": 3.61e9, "gpt-oss-120b": 5.13e9}[preset]
    assert abs(theirs - idle - 201088 * 2880 - published) < 0.01e9
    assert round(theirs / 1e8) / 10 == {"gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8}[preset]


# ---- refusals ----------------------------------------------------------------------------------
GPT_OSS = BASE | CASES["window6-yarn"] | {"model_type": "gpt_oss"}


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"layer_types": ["sliding_attention", "full_attention"]}, "has 2 entries for 3 layers"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
         "holds 'chunked_attention'"),
        ({"layer_types": "sliding_attention"}, "layer_types='sliding_attention' must be a list"),
        ({"attention_bias": False}, "attention_bias=False"),
        ({"swiglu_limit": -1}, "swiglu_limit=-1"),
        ({"sliding_window": None}, "sliding_window is not set"),
        ({"num_experts_per_tok": 5}, "exceeds the 4 experts"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method='gptq'"),
    ],
)  # fmt: skip
def test_config_json_refusals_are_one_line(change, needle):
    """config.json read as open_hf reads it: the config, then the maps of what it stores."""
    hf = GPT_OSS | change
    with pytest.raises(UserError) as e:
        cfg = model_config_from_hf(hf, "config.json")
        mapping_for_hf(hf, "config.json").stored_maps(cfg, hf, "config.json")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "drop, scale, needle",
    [
        ("model.layers.1.mlp.experts.down_proj_scales", None,
         "tensor model.layers.1.mlp.experts.down_proj_scales is missing"),
        (None, 255, "model.layers.0.mlp.experts.gate_up_proj_scales makes values infinite"),
    ],
)  # fmt: skip
def test_a_damaged_mxfp4_folder_is_refused_in_one_line(hf_folders, tmp_path, drop, scale, needle):
    folder = mxfp4_folder(hf_folders["window6-yarn"][1], tmp_path / "q", drop=drop, scale=scale)
    with pytest.raises(UserError) as e:
        import_hf(folder, tmp_path / "run")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()


def test_mxfp4_blocks_of_another_dtype_and_gpt_oss_fields_elsewhere_are_refused(
    hf_folders, tmp_path
):
    folder = mxfp4_folder(hf_folders["window6-yarn"][1], tmp_path / "q")
    state = tensors(folder)
    key = "model.layers.0.mlp.experts.down_proj_blocks"
    state[key] = state[key].to(torch.float32)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"tensor {key} is torch.float32; MXFP4 blocks and scales"):
        import_hf(folder, tmp_path / "run")
    with safe_open(str(folder / "model.safetensors"), "pt") as h:
        assert key in h.keys()  # noqa: SIM118 (safe_open is no dict)
    with pytest.raises(UserError, match=r"swiglu_limit=7\.0: the llama family has no such"):
        get_preset("llama3.1-8b").replace(swiglu_limit=7.0)
    with pytest.raises(UserError, match=r"layer_types=.*: the mixtral family has no such"):
        get_preset("mixtral-8x7b").replace(layer_types=("full_attention",) * 32)
    with pytest.raises(UserError, match="norm_topk_prob=False: gpt-oss"):
        get_preset("gpt-oss-20b").replace(norm_topk_prob=False)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: Inductor compiles flex")
@pytest.mark.parametrize(("window", "packed"), [(None, False), (24, True)])
def test_the_cuda_sink_kernel_equals_the_reference(window, packed):
    """What CUDA runs for the sinks (flex_sink_attention: FlexAttention's log-sum-exp, then
    σ(L − sink)) against the reference (sink_attention: the sink as one more key on SDPA),
    forward only, eager (FlexAttention has no CPU backward, and the CPU's Inductor no
    return_lse: benchmarks/peers/moe_gpu.py checks the compiled kernel and its gradients on a
    GPU). Grouped heads 4:2, 200 tokens (not a multiple of the 128-token block),
    sinks large and small, causal or a window, one sequence or three packed samples."""
    from torch.nn.attention.flex_attention import flex_attention

    from fitgpt.model.families.gpt_oss.model import flex_sink_attention, sink_attention, sink_keep
    from fitgpt.model.packing import block_mask, window_block_mask

    T = 200
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, T, 16, generator=g) for h in (4, 2, 2))
    sinks = torch.tensor([-3.0, 0.0, 2.0, 6.0])
    seg = None
    if packed:
        seg = torch.zeros(2, T, dtype=torch.int64)
        seg[0, 50:], seg[0, 130:], seg[1, 1:] = 1, 2, 1
    mask = block_mask(seg, window) if packed else window_block_mask(T, window, "cpu")
    with torch.no_grad():
        got = flex_sink_attention(q, k, v, sinks, mask, flex_attention)
        want = sink_attention(q, k, v, sinks, sink_keep(T, 0, window, "cpu", seg), 0.0)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2**-8)])
def test_expert_biases_take_their_gradient_summed_per_expert_as_a_gather_does(dtype, tol):
    """The experts' biases (row_bias: each row's expert's bias, its gradient a one-hot matmul)
    give a plain gather's forward and its gradient, the sum per expert, with rows spread over
    the experts and with all rows on two of them (a random router's collapse), an expert with
    no rows included (its gradient zero): within fp32's rounding of the exact sums, within one
    bf16 rounding in bf16 and never further from them than the gather's own bf16 sums; a
    frozen bias is gathered and takes no gradient."""
    g = torch.Generator().manual_seed(0)
    E, width = 8, 24
    for expert_M in (torch.randint(0, E - 2, (200,), generator=g), torch.tensor([3, 5] * 100)):
        expert_M = expert_M.sort().values  # the rows come grouped by expert
        bias = torch.randn(E, width, generator=g).to(dtype).requires_grad_()
        ref = bias.detach().clone().requires_grad_()
        grad_MO = torch.randn(len(expert_M), width, generator=g).to(dtype)
        exact = torch.zeros(E, width, dtype=torch.float64).index_add_(0, expert_M, grad_MO.double())
        out = row_bias(bias, expert_M)
        assert torch.equal(out, ref[expert_M])
        out.backward(grad_MO)
        ref[expert_M].backward(grad_MO)
        err, theirs = ((t.grad.double() - exact).abs().max() for t in (bias, ref))
        assert bias.grad.dtype == dtype and err <= tol * exact.abs().max() and err <= theirs + 1e-12
        unused = sorted(set(range(E)) - set(expert_M.tolist()))
        assert unused and not bias.grad[unused].any()
    frozen = torch.randn(E, width, generator=g)
    assert torch.equal(row_bias(frozen, expert_M), frozen[expert_M])
