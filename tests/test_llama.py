"""The Llama families (model/families/llama/, qwen2/, qwen3/, mistral/): config fields and
refusals, exact parameter counts (the presets' against transformers' models built on the meta
device), the activations the planner prices, KV-cache decoding, the sliding window, and training
through every engine on gloo."""

import json
from dataclasses import fields

import pytest
import torch
import transformers
from helpers import TINY, TWO_RANK_ENGINES, close, engine_losses, two_rank_losses

from fitgpt.cli import main
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig
from fitgpt.errors import UserError
from fitgpt.infer.generate import SampleConfig, generate
from fitgpt.model import PRESETS, KVCache, Llama, ModelConfig, build_model, family_of
from fitgpt.model.config import RopeScaling
from fitgpt.parallel.shard import tensor_parallel_refusal

BASE = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, seq_len=32, vocab_size=96, bias=False,
            position="rope", ffn_hidden=96, tie_embeddings=False)  # fmt: skip
NEEDS = {"qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}}  # what each family must have


def llama(family: str = "llama", **kw) -> ModelConfig:
    return ModelConfig(**{**BASE, "family": family, **NEEDS.get(family, {}), **kw})


# ---- the config ---------------------------------------------------------------------------
NEW_FIELDS = {"n_kv_head", "head_size", "ffn_hidden", "norm_eps", "rope_theta", "rope_scaling",
              "qkv_bias", "qk_norm", "sliding_window", "max_positions"}  # fmt: skip


def test_configs_round_trip_and_a_meta_json_without_the_new_fields_loads():
    c = llama(rope_scaling=RopeScaling(factor=8.0, original_max_positions=16), max_positions=64)
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    old = {k: v for k, v in TINY.to_dict().items() if k not in NEW_FIELDS}  # before the fields
    assert ModelConfig.from_dict(old) == TINY
    assert {f.name for f in fields(ModelConfig)} - set(old) == NEW_FIELDS
    assert (TINY.kv_heads, TINY.head_dim, TINY.ffn_width) == (4, 8, 128)  # GPT-2 as before
    assert (c.kv_heads, c.head_dim, llama(ffn_hidden=None).ffn_width) == (2, 16, 256)


@pytest.mark.parametrize(
    "family, changes, says",
    [
        ("gpt2", {"position": "rope"}, "position='rope': the gpt2 family"),
        ("gpt2", {"n_kv_head": 2}, "--kv-heads 2: the gpt2 family"),
        ("gpt2", {"ffn_hidden": 100}, "--ffn-hidden 100: the gpt2 family"),
        ("gpt2", {"qk_norm": True}, "--qk-norm: the gpt2"),
        ("gpt2", {"qkv_bias": True}, "--qkv-bias: the gpt2"),
        ("gpt2", {"sliding_window": 8}, "--sliding-window: the gpt2"),
        ("gpt2", {"head_size": 4}, "head_size=4: the gpt2"),
        ("llama", {"position": "learned"}, "uses rotary positions"),
        ("llama", {"bias": True}, "no biases"),
        ("llama", {"embed_norm": True}, "no norm after the embedding"),
        ("llama", {"qkv_bias": True}, "the llama family has no q/k/v biases"),
        ("llama", {"qk_norm": True}, "the llama family does not normalise q and k"),
        ("qwen2", {"qkv_bias": False}, "the qwen2 family always has q/k/v biases"),
        ("qwen3", {"qk_norm": False}, "the qwen3 family always normalises q and k"),
        ("qwen2", {"sliding_window": 8}, "has no sliding window \\(mistral has\\)"),
        ("llama", {"n_kv_head": 3}, "--kv-heads 3 does not divide heads=4"),
        ("llama", {"head_size": 7, "n_embd": 30}, "head dimension 7 must be even"),
        ("mistral", {"sliding_window": 0}, "sliding_window=0 must be a positive"),
    ],
)
def test_each_family_refuses_what_it_cannot_honour_in_one_line(family, changes, says):
    with pytest.raises(UserError, match=says) as e:
        TINY.replace(**changes) if family == "gpt2" else llama(family, **changes)
    assert "\n" not in str(e.value)


def test_rope_scaling_is_checked_and_rebuilt_from_its_dict():
    with pytest.raises(UserError, match="low_freq_factor < high_freq_factor"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(UserError, match="'dynamic' is not supported: use one of linear, llama3"):
        RopeScaling(kind="dynamic")
    d = llama(rope_scaling=RopeScaling(factor=32.0)).to_dict()
    assert d["rope_scaling"]["factor"] == 32.0
    assert ModelConfig.from_dict(d).rope_scaling == RopeScaling(factor=32.0)


# ---- counts -------------------------------------------------------------------------------
OPTIONS = [
    ("llama", {}), ("llama", {"tie_embeddings": True}), ("llama", {"n_kv_head": 1}),
    ("llama", {"n_kv_head": None, "ffn_hidden": None}), ("llama", {"head_size": 32}),
    ("qwen2", {}), ("qwen2", {"tie_embeddings": True, "n_kv_head": 4}),
    ("qwen3", {}), ("qwen3", {"head_size": 8, "n_embd": 48}),
    ("mistral", {"sliding_window": 8}), ("mistral", {"vocab_size": 200}),
]  # fmt: skip


@pytest.mark.parametrize("family, changes", OPTIONS)
def test_num_params_and_flops_are_exact_for_every_option(family, changes):
    cfg = llama(family, **changes)
    with torch.device("meta"):
        model = build_model(cfg)
    assert isinstance(model, Llama) and model.family is family_of(cfg)
    n, V, H = cfg.num_params(), cfg.padded_vocab_size, cfg.n_embd
    assert model.num_params() == n
    assert (model.lm_head is None) == cfg.tie_embeddings
    lookup = 0 if cfg.tie_embeddings else V * H  # the input embedding multiplies nothing
    attn = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.seq_len
    assert cfg.flops_per_token() == 6 * (n - lookup) + attn


# config.json's values of each model, as Hugging Face publishes them
HF_SHAPES = {
    "llama3.2-1b": ("Llama", 16, 2048, 32, 8, 8192, 128256, True, None),
    "llama3.2-3b": ("Llama", 28, 3072, 24, 8, 8192, 128256, True, None),
    "llama3.1-8b": ("Llama", 32, 4096, 32, 8, 14336, 128256, False, None),
    "llama3.1-70b": ("Llama", 80, 8192, 64, 8, 28672, 128256, False, None),
    "llama3.1-405b": ("Llama", 126, 16384, 128, 8, 53248, 128256, False, None),
    "qwen2.5-0.5b": ("Qwen2", 24, 896, 14, 2, 4864, 151936, True, None),
    "qwen2.5-1.5b": ("Qwen2", 28, 1536, 12, 2, 8960, 151936, True, None),
    "qwen2.5-3b": ("Qwen2", 36, 2048, 16, 2, 11008, 151936, True, None),
    "qwen2.5-7b": ("Qwen2", 28, 3584, 28, 4, 18944, 152064, False, None),
    "qwen2.5-14b": ("Qwen2", 48, 5120, 40, 8, 13824, 152064, False, None),
    "qwen2.5-32b": ("Qwen2", 64, 5120, 40, 8, 27648, 152064, False, None),
    "qwen2.5-72b": ("Qwen2", 80, 8192, 64, 8, 29568, 152064, False, None),
    "qwen3-8b": ("Qwen3", 36, 4096, 32, 8, 12288, 151936, False, 128),
    "qwen3-32b": ("Qwen3", 64, 5120, 64, 8, 25600, 151936, False, 128),
    "mistral-7b": ("Mistral", 32, 4096, 32, 8, 14336, 32768, False, None),
}


def test_the_presets_count_what_transformers_builds():
    for name, (kind, L, H, N, K, F, V, tied, D) in HF_SHAPES.items():
        hf_cfg = getattr(transformers, f"{kind}Config")(
            num_hidden_layers=L, hidden_size=H, num_attention_heads=N, num_key_value_heads=K,
            intermediate_size=F, vocab_size=V, tie_word_embeddings=tied, head_dim=D or H // N,
        )  # fmt: skip
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
            ours = build_model(PRESETS[name])
        want = sum(p.numel() for p in hf.parameters())
        cfg = PRESETS[name]
        assert cfg.num_params() == ours.num_params() == want, name
        assert cfg.padded_vocab_size == cfg.vocab_size == V, name  # no padding row added
        assert cfg.family == kind.lower() and cfg.seq_len == 4096, name


# ---- what the planner prices --------------------------------------------------------------
@pytest.mark.parametrize("family, changes", [("llama", {}), ("qwen3", {"n_kv_head": 4})])
def test_block_activations_are_what_a_block_saves(family, changes):
    """Distinct tensors attention and the MLP save for backward, per token, against the family's
    cut part (the whole part, the norms' inputs and outputs, differs on the CPU: the module
    docstring). Parameters, the rotary tables and per-token statistics are not activations."""
    cfg = llama(family, **changes)
    model = build_model(cfg)
    block, (B, T) = model.blocks[0], (2, cfg.seq_len)
    rope = model.block_aux(T, 0, "cpu")
    skip = {t.untyped_storage().data_ptr() for t in [*block.parameters(), rope]}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes() >= B * T * cfg.head_dim * t.element_size():
            saved[st.data_ptr()] = st.nbytes() // t.element_size()
        return t

    x = torch.randn(B, T, cfg.n_embd, requires_grad=True)
    a, m = block.ln_1(x), block.ln_2(x)
    skip |= {a.untyped_storage().data_ptr(), m.untyped_storage().data_ptr()}  # norm outputs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block.attn(a, None, 0, rope)
        block.mlp(m)
    # CPU's RMSNorm is decomposed: q_norm and k_norm keep their normalised input too (N·D + K·D
    # per token), which a fused norm does not
    cpu_norms = (cfg.n_head + cfg.kv_heads) * cfg.head_dim if cfg.qk_norm else 0
    assert sum(saved.values()) == (family_of(cfg).block_activations(cfg)[1] + cpu_norms) * B * T


# ---- decoding -----------------------------------------------------------------------------
def seeded(cfg: ModelConfig) -> Llama:
    model = build_model(cfg)
    model.reset_parameters(seed=3)
    return model.eval()


@pytest.mark.parametrize("family, changes", [("qwen3", {}), ("mistral", {"sliding_window": 8})])
def test_kv_cache_decoding_equals_recomputing_the_sequence(family, changes):
    cfg = llama(family, init_std=0.2, **changes)  # wide weights: no near-ties in the argmax
    model = seeded(cfg)
    cache = KVCache(cfg, 2, "cpu", torch.float32)
    assert cache.k[0].shape == (2, cfg.kv_heads, cfg.seq_len, cfg.head_dim)  # K heads cached
    prompt = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    greedy = SampleConfig(max_new_tokens=20, temperature=0.0)
    with torch.no_grad():
        cached = generate(model, prompt, greedy, use_cache=True)
        recomputed = generate(model, prompt, greedy, use_cache=False)
        assert torch.equal(cached, recomputed) and cached.shape == (2, 26)
        # several new tokens after a cache (the mask with a past, windowed past 8 tokens)
        seq = cached[:, :20]
        model(seq[:, :5], cache=cache)
        last = model(seq[:, 5:], cache=cache)[:, -1]
        assert torch.allclose(last, model(seq)[:, -1], atol=1e-5)


def test_a_sliding_window_sees_exactly_the_last_window_tokens():
    """One layer: the last token's logits with a window of 8 over 20 tokens are those of the
    same weights without a window on the last 8 alone (rotary scores depend on distances only)."""
    windowed = seeded(llama("mistral", n_layer=1, sliding_window=8))
    plain = seeded(llama("mistral", n_layer=1))
    x = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want, full = windowed(x)[:, -1], plain(x[:, -8:])[:, -1], plain(x)[:, -1]
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, full, atol=1e-3)
    assert torch.equal(windowed(x[:, :8]), plain(x[:, :8]))  # within the window: no mask at all


# ---- tensor parallelism and the engines ---------------------------------------------------
def test_a_tensor_parallel_degree_must_divide_the_key_value_heads():
    cfg = llama(n_head=8, n_kv_head=2)
    assert "does not divide the key/value heads (--kv-heads), 2" in tensor_parallel_refusal(4, cfg)
    assert tensor_parallel_refusal(2, cfg) is None


CPU = DistContext(0, 1, 0, torch.device("cpu"))
STEPS, CLIP = 6, 0.3
QWEN3 = llama("qwen3")  # GQA 4:2, untied, q/k norms: every new part at once
QWEN2 = llama("qwen2", tie_embeddings=True)  # q/k/v biases, cut as q and kv are
QWEN2_ENGINES = ["zero3", "tp2_ddp", "tp2_zero2_sp"]


def two_rank_worker(rank: int, world: int, tmp: str) -> None:
    runs = {"qwen3": (QWEN3, list(TWO_RANK_ENGINES)), "qwen2": (QWEN2, QWEN2_ENGINES)}
    two_rank_losses(runs, tmp, STEPS, CLIP)


def test_the_llama_families_train_through_every_engine_stage_offload_and_tensor_parallel(
    tmp_path, gloo
):
    refs = {
        name: engine_losses(cfg, EngineConfig(engine="ddp"), CPU, STEPS, CLIP)
        for name, cfg in (("qwen3", QWEN3), ("qwen2", QWEN2))
    }
    for ref in refs.values():
        assert max(ref["norm"]) > CLIP and len(set(ref["loss"])) == STEPS  # clipped, and moving
    gloo(2, two_rank_worker, str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())
    for name, runs in res.items():
        for key, got in runs.items():
            assert close(got["loss"], refs[name]["loss"]), (name, key, got["loss"])
            assert close(got["norm"], refs[name]["norm"]), (name, key)
    shapes = res["qwen3"]["tp2_ddp"]["shapes"]  # each rank: half the heads, kv heads and MLP
    assert shapes["blocks.0.attn.kv.weight"] == [32, 64]
    assert shapes["blocks.0.attn.q_norm.weight"] == [16]  # replicated
    assert res["qwen2"]["tp2_ddp"]["shapes"]["blocks.0.attn.kv.bias"] == [32]


# ---- the command line ---------------------------------------------------------------------
def test_train_and_plan_run_a_llama_preset(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--preset", "tiny-llama", "--layers", "2", "--hidden", "32",
              "--seq-len", "16", "--micro-batch", "2", "--device", "cpu", "--data", "synthetic",
              "--steps", "2", "--eval-every", "0", "--out", str(tmp_path / "run")])  # fmt: skip
    assert done.value.code in (0, None)
    assert "step      2 | loss" in capsys.readouterr().out
    meta = json.loads(next((tmp_path / "run").glob("step_*/meta.json")).read_text())
    assert ModelConfig.from_dict(meta["config"]["model"]).family == "llama"
    with pytest.raises(SystemExit) as done:
        main(["plan", "--preset", "llama3.1-8b", "--device", "cuda", "--gpu-mem", "80G",
              "--cpu-mem", "256G", "--data", "synthetic", "--micro-batch", "2"])  # fmt: skip
    assert done.value.code in (0, None)
    assert "8.03 B parameters (32×4096)" in capsys.readouterr().out
