"""Hugging Face Llama, Qwen2, Qwen3 and Mistral in and out: logits parity with transformers,
bit-exact round trips (fp32 and bf16, sharded in and out), greedy generation, the files carried
along, and the refusals.

Every HF model is built here from a config object with random weights and saved to a temporary
folder: nothing is downloaded. The models are tiny (2 layers, 64 wide) and built once per module.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from helpers import (
    assert_config_carried,
    imported_runs,
    run_config,
    saved_hf_models,
    tensors,
    train,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from fitgpt.cli import main
from fitgpt.data.config import open_data
from fitgpt.data.source import BatchLoader
from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.infer.generate import SampleConfig, generate, load_model
from fitgpt.interop.hf import model_config_from_hf
from fitgpt.interop.hf_export import export_hf
from fitgpt.interop.hf_import import import_hf
from fitgpt.interop.init_source import find_source
from fitgpt.train.init_from import model_from_source

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64)
# name -> (config class, its fields): GQA ratios 1:1, 2:1, 4:1, tied and untied, llama3 rope
# scaling, q/k/v biases (Qwen2), q/k norms with head_dim != hidden/heads (Qwen3), a sliding
# window shorter than the sequence (Mistral).
CASES = {
    "llama-gqa4-tied-llama3": (
        LlamaConfig,
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=300,
            tie_word_embeddings=True,
            rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE},
            rms_norm_eps=1e-5,
        ),
    ),
    "llama-mha-untied": (
        LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=4, vocab_size=1000),
    ),
    "qwen2-gqa2-bias": (
        Qwen2Config,
        dict(
            num_attention_heads=4, num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True
        ),
    ),
    "qwen3-qknorm-headdim": (
        Qwen3Config,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300),
    ),
    # YaRN past its original 16 positions (X has 32 tokens): transformers' defaults, and
    # every optional key given
    "qwen2-yarn": (
        Qwen2Config,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            rope_parameters={"rope_theta": 1e6, **YARN_ROPE},
        ),
    ),
    "llama-yarn-all-keys": (
        LlamaConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            rope_parameters={
                "rope_theta": 10000.0,
                **YARN_ROPE,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "attention_factor": 1.25,
                "truncate": False,
            },
        ),
    ),
    "mistral-window8": (
        MistralConfig,
        dict(num_attention_heads=4, num_key_value_heads=1, vocab_size=300, sliding_window=8),
    ),
}


def build_hf(name: str, seed: int = 0):
    """A random HF model of case `name`; norms near 1 and biases random too, so a mix-up (k
    for v, gate for up, q_norm for k_norm) cannot hide behind a default value."""
    cls, fields = CASES[name]
    torch.manual_seed(seed)
    # pad_token_id and initializer_range off transformers' defaults: export carries them back
    cfg = cls(
        **BASE, **fields, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.05
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(1.0 if "norm" in n else 0.0, 0.1 if "norm" in n or "bias" in n else 0.08)
    return model


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Each case's model, saved once: {name: (model, folder)}."""
    return saved_hf_models(build_hf, CASES, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def imported(hf_folders, tmp_path_factory):
    """Each case imported once: {name: run folder}."""
    return imported_runs(hf_folders, tmp_path_factory.mktemp("runs"))


X = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))


# ---- logits ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_import_gives_transformers_logits_and_loss(hf_folders, imported, name):
    ref, _ = hf_folders[name]
    model, meta = load_model(imported[name], torch.device("cpu"))
    cfg = model.cfg
    V = ref.config.vocab_size
    assert cfg.family == ref.config.model_type and cfg.vocab_size == V
    assert cfg.tie_embeddings == ref.config.tie_word_embeddings
    assert meta["optimizer_state"] is False and meta["imported_from"]["format"] == "hf-llama"
    with torch.no_grad():
        logits = model(X)
        want = ref(X).logits
        hf_loss = ref(X, labels=X).loss
        loss = model(X[:, :-1], X[:, 1:])
    torch.testing.assert_close(logits[..., :V], want, rtol=0, atol=1e-5)
    assert torch.isneginf(logits[..., V:]).all()
    assert abs(loss.item() - hf_loss.item()) < 1e-5


def test_the_cases_cover_what_the_families_vary(imported):
    cfgs = {n: load_model(r, torch.device("cpu"))[0].cfg for n, r in imported.items()}
    assert {c.n_head // c.kv_heads for c in cfgs.values()} == {1, 2, 4}
    assert cfgs["llama-gqa4-tied-llama3"].rope_scaling.kind == "llama3"
    assert cfgs["llama-gqa4-tied-llama3"].rope_theta == 500000.0
    assert cfgs["qwen2-gqa2-bias"].qkv_bias and cfgs["qwen3-qknorm-headdim"].qk_norm
    assert cfgs["qwen3-qknorm-headdim"].head_dim == 32 != 64 // 4
    assert cfgs["mistral-window8"].sliding_window == 8 < X.shape[1]
    assert cfgs["llama-mha-untied"].max_positions == 64


# ---- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_import_then_export_is_bit_exact_and_loads_in_transformers(
    hf_folders, imported, tmp_path, name
):
    ref, folder = hf_folders[name]
    r = export_hf(imported[name], tmp_path / "out")
    a, b = tensors(folder), tensors(tmp_path / "out")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert r.params == sum(t.numel() for t in a.values()) and r.files == 1
    src, out = (json.loads((p / "config.json").read_text()) for p in (folder, tmp_path / "out"))
    for key in (
        "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
        "vocab_size", "tie_word_embeddings", "rope_parameters", "sliding_window",
    ):  # fmt: skip
        assert src.get(key) == out.get(key), key
    assert_config_carried(folder, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert type(back) is type(ref)
    with torch.no_grad():
        assert torch.equal(back(X).logits, ref(X).logits)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_sharded_source_to_sharded_half_export(tmp_path, dtype):
    """A bf16 or fp16 checkpoint in shards with its index comes in (fp32, exactly) and goes
    out in its dtype in several shards whose index transformers follows: every bit as it was."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    ref = build_hf("qwen2-gqa2-bias").to(torch_dtype)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    import_hf(tmp_path / "hf" / "model.safetensors.index.json", tmp_path / "run")
    r = export_hf(tmp_path / "run", tmp_path / "out", dtype=dtype, max_shard_bytes=60_000)
    a, b = tensors(tmp_path / "hf"), tensors(tmp_path / "out")
    assert r.files > 2 and len(list((tmp_path / "out").glob("*.safetensors"))) == r.files
    assert all(t.dtype == torch_dtype for t in b.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(b)
    assert index["metadata"]["total_size"] == sum(2 * t.numel() for t in b.values())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == str(torch_dtype).removeprefix("torch.")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert back.dtype == torch_dtype
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ref.state_dict().items())


def test_cli_import_and_sharded_export(hf_folders, tmp_path, capsys):
    ref, folder = hf_folders["mistral-window8"]
    for argv in (
        ["import", "hf", str(folder), "--out", str(tmp_path / "run")],
        ["export", "--ckpt", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "out"),
         "--max-shard-size", "40KB"],
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code in (0, None), argv
    out = capsys.readouterr().out.splitlines()
    assert "mistral" in out[0] and "4 heads (1 key/value)" in out[0] and "64 positions" in out[0]
    assert "MistralForCausalLM" in out[1] and "safetensors shards" in out[1]
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ref.state_dict().items())


# ---- generation --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["llama-gqa4-tied-llama3", "qwen3-qknorm-headdim", "mistral-window8"]
)
def test_greedy_generation_equals_transformers(hf_folders, imported, name):
    """30 tokens with fitgpt's KV cache: the Mistral case runs 35 positions through a window
    of 8."""
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


# ---- what travels with the weights -----------------------------------------------------------
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"


def _tokenizer(folder) -> PreTrainedTokenizerFast:
    """A byte-level BPE of 290 tokens with bos/eos and a chat template, trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT
    fast.save_pretrained(folder)
    return fast


def test_tokenizer_generation_config_and_chat_template_travel(tmp_path):
    ref = build_hf("llama-mha-untied")
    ref.save_pretrained(tmp_path / "hf")
    _tokenizer(tmp_path / "hf")
    gen = {"bos_token_id": 1, "eos_token_id": [2, 5], "temperature": 0.6, "do_sample": True}
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(gen))
    r = import_hf(tmp_path / "hf", tmp_path / "run")
    carried = sorted(p.name for p in (tmp_path / "run" / "tokenizer").iterdir())
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(carried)
    assert "chat_template.jinja" in carried or "chat_template" in json.loads(
        (tmp_path / "run" / "tokenizer" / "tokenizer_config.json").read_text()
    )
    assert r.tokenizer == str((tmp_path / "run" / "tokenizer").resolve())
    export_hf(tmp_path / "run", tmp_path / "out")
    out = tmp_path / "out"
    assert json.loads((out / "generation_config.json").read_text()) == gen
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, [2, 5])
    theirs, ours = (
        AutoTokenizer.from_pretrained(out),
        AutoTokenizer.from_pretrained(tmp_path / "hf"),
    )
    msgs = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "jumps"}]
    assert theirs.apply_chat_template(msgs, tokenize=False) == ours.apply_chat_template(
        msgs, tokenize=False
    )
    assert theirs.encode("the lazy dog") == ours.encode("the lazy dog")


def test_init_from_a_qwen2_folder_trains_from_transformers_loss(hf_folders, tmp_path):
    """`fitgpt train --init-from HF_FOLDER`: the first loss is transformers' on that batch."""
    ref, shared = hf_folders["qwen2-gqa2-bias"]
    folder = shutil.copytree(shared, tmp_path / "hf")  # a generation_config.json of its own
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_p": 0.8}))
    source = find_source(str(folder))
    assert source.model.family == "qwen2" and source.weights is not None
    run = run_config(tmp_path / "run", steps=2, micro_batch=2, data="synthetic")
    run = dataclasses.replace(run, model=model_from_source(source, {}, run.data))
    train_src, _, _ = open_data(run.data, run.model.seq_len, run.model.vocab_size, 0)
    x, y, _ = BatchLoader(train_src, 2, 0, 1).next()
    with torch.no_grad():
        logits = ref(x).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    got = train(run, DistContext(0, 1, 0, torch.device("cpu")), init_from=source)["losses"]
    assert got[0] == pytest.approx(want, abs=1e-5) and got[1] == got[1]
    # its export carries the folder's config.json fields and generation_config.json back
    export_hf(tmp_path / "run", tmp_path / "out")
    assert_config_carried(folder, tmp_path / "out")
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["top_p"] == 0.8 and generation["eos_token_id"] == 2
    # a folder that holds another model now is no source: fitgpt's own fields alone
    other = json.loads((folder / "config.json").read_text()) | {"num_hidden_layers": 3}
    (folder / "config.json").write_text(json.dumps(other))
    export_hf(tmp_path / "run", tmp_path / "stale")
    stale = json.loads((tmp_path / "stale" / "config.json").read_text())
    assert stale["num_hidden_layers"] == 2 and stale["initializer_range"] != 0.05
    assert "top_p" not in json.loads((tmp_path / "stale" / "generation_config.json").read_text())


def test_export_config_round_trips_through_import():
    """config.json written by export reads back as the same ModelConfig."""
    from fitgpt.interop.hf import mapping_for_model

    for name, (cls, fields) in CASES.items():
        hf = cls(**BASE, **fields).to_dict()
        cfg = model_config_from_hf(hf, name)
        again = mapping_for_model(cfg).hf_config(cfg, {}) | {"model_type": cfg.family}
        assert model_config_from_hf(again, name) == cfg, name


def test_released_shapes_import_with_their_parameter_counts():
    """Llama 3.1 8B's and Qwen2.5 7B's config.json (their published shapes) give the published
    parameter counts, the context capped; an MLP width that is the family's default is left
    unset (as a preset leaves it)."""
    llama = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    cfg = model_config_from_hf(llama.to_dict(), "llama")
    assert cfg.num_params() == 8_030_261_248 and cfg.ffn_hidden == 14336 and cfg.kv_heads == 8
    assert (cfg.seq_len, cfg.max_positions) == (4096, 131072)
    llama2 = llama.to_dict() | {"intermediate_size": 11008, "num_key_value_heads": 32}
    assert model_config_from_hf(llama2, "llama2").ffn_hidden is None  # 8·4096/3 rounded to 256
    qwen = Qwen2Config(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    assert model_config_from_hf(qwen.to_dict(), "qwen").num_params() == 7_615_616_512


# ---- refusals ----------------------------------------------------------------------------------
LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "vocab_size": 300,
}


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"rope_scaling": {"rope_type": "yarn", "beta_fast": 8.0}}, "lacks factor"),
        ({"rope_scaling": {**YARN_ROPE, "mscale": 0.7}}, "mscale=0.7"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'"),
        ({"rope_parameters": {"rope_type": "liner", "factor": 2.0}}, "'liner'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"head_dim": 15}, "head_dim=15 is odd"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide"),
        (
            {"num_attention_heads": 5, "num_key_value_heads": 5},
            "not divisible by num_attention_heads=5",
        ),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false'"),
        ({"model_type": "gemma"}, "model_type='gemma'"),
        ({"model_type": None}, "has no model_type"),
        ({"intermediate_size": 0}, "intermediate_size=0"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=True"),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 1,
            },
            "slides a window of 8 in 1 of 2 layers",
        ),
    ],
)
def test_configs_fitgpt_cannot_compute_are_refused_in_one_line(change, needle):
    assert model_config_from_hf(LLAMA, "config.json").kv_heads == 2
    cfg = {k: v for k, v in (LLAMA | change).items() if v is not None}
    with pytest.raises(UserError, match=r"config\.json") as e:
        model_config_from_hf(cfg, "config.json")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_qwen_without_a_sliding_layer_is_taken():
    """Qwen2.5 configs carry sliding_window with use_sliding_window false, or a
    max_window_layers past the last layer: no layer slides, so fitgpt's full attention is
    exact; a window in every layer is refused as one in some."""
    q = LLAMA | {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8}
    assert model_config_from_hf(q | {"max_window_layers": 2}, "c").sliding_window is None
    assert model_config_from_hf(q | {"use_sliding_window": False}, "c").sliding_window is None
    with pytest.raises(UserError, match="slides a window of 8 in 2 of 2 layers"):
        model_config_from_hf(q | {"max_window_layers": 0}, "c")


def test_damaged_or_mismatched_checkpoints_write_nothing(hf_folders, tmp_path):
    _, folder = hf_folders["qwen3-qknorm-headdim"]
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in folder.iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((hf / "config.json").read_text())
    # a stored tensor the config has no place for (o_proj biases): named, not dropped
    (hf / "config.json").write_text(json.dumps(cfg | {"model_type": "qwen2", "layer_types": None}))
    with pytest.raises(UserError, match=r"q_proj\.bias is missing"):
        import_hf(hf, tmp_path / "run")
    (hf / "config.json").write_text(json.dumps(cfg | {"model_type": "llama"}))
    with pytest.raises(UserError, match=r"k_norm\.weight and 3 more has no place"):
        import_hf(hf, tmp_path / "run")
    (hf / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 3}))
    with pytest.raises(UserError, match="num_hidden_layers=3, but the weights hold 2 blocks"):
        import_hf(hf, tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written
