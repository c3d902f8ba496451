"""Hugging Face GPT-2 in and out: logits parity, bit-exact round trips, tokenizers, refusals.

Every HF model is built here with random weights and saved to tmp_path: nothing is downloaded.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_config_carried, run_config, train
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, GPT2Tokenizer

from fitgpt.data.tokenizer import gpt2_files, load_tokenizer, train_tokenizer
from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.infer.generate import SampleConfig, generate, load_model
from fitgpt.interop.hf import check_exportable, model_config_from_hf
from fitgpt.interop.hf_export import export_hf
from fitgpt.interop.hf_import import import_hf
from fitgpt.interop.hf_tokenizer import write_hf_tokenizer
from fitgpt.model import ModelConfig

CPU = DistContext(0, 1, 0, torch.device("cpu"))
TEXTS = ["Hello world", " two  spaces\n\nand\ttabs ", "naïve café 日本語 🙂", "a<|endoftext|>b"]


def hf_model(folder, vocab=1000, positions=64, tie=True, seed=0, save=True, **fields):
    """A random GPT2LMHeadModel (GPT2Config with `fields`); LayerNorms and biases random too,
    so a mix-up cannot hide."""
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        n_positions=positions,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=None,
        **fields,
    )
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0, 0.1)
    if save:
        model.save_pretrained(folder)
    return model


def fitgpt_logits(run, x):
    model, meta = load_model(run, torch.device("cpu"))
    with torch.no_grad():
        return model(x), model, meta


def hf_state(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)


# ---- import ------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [True, False])
def test_import_gives_hf_logits_and_loss(tmp_path, tie):
    ref = hf_model(tmp_path / "hf", vocab=1000, positions=64, tie=tie)
    r = import_hf(tmp_path / "hf", tmp_path / "run")
    assert r.cfg.tie_embeddings is tie and r.cfg.seq_len == 64 and r.tokenizer is None
    x = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
    logits, model, meta = fitgpt_logits(tmp_path / "run", x)
    with torch.no_grad():
        want = ref(x).logits
        hf_loss = ref(x, labels=x).loss
    assert logits.shape == (2, 64, 1024)  # fitgpt pads the vocabulary to a multiple of 128
    torch.testing.assert_close(logits[..., :1000], want, rtol=0, atol=1e-5)
    assert torch.isneginf(logits[..., 1000:]).all()  # padded rows are no tokens
    # the padded rows' -inf keep the loss HF's own: zero rows would add log(1024/1000) to it
    with torch.no_grad():
        loss = model(x[:, :-1], x[:, 1:])
    assert abs(loss.item() - hf_loss.item()) < 1e-5
    assert meta["optimizer_state"] is False and meta["step"] == 0
    files = sorted(p.name for p in r.ckpt.iterdir())
    assert files == sorted([*meta["files"], "meta.json"])
    assert all(f.startswith(("c0", "index-r000")) for f in meta["files"])
    with safe_open(str(r.ckpt / "c0000-r000.safetensors"), "pt") as f:
        assert list(f.keys()) == ["master"]  # weights only, fp32
        assert f.get_tensor("master").dtype == torch.float32


def test_gpt2_vocabulary_and_a_tokenizer_json_only_folder(tmp_path):
    """transformers 5 saves tokenizer.json alone; the run gets vocab/merges derived from it."""
    ref = hf_model(tmp_path / "hf", vocab=50257, positions=32)
    GPT2Tokenizer(*(str(f) for f in gpt2_files())).save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf" / "vocab.json").exists()
    r = import_hf(tmp_path / "hf", tmp_path / "run")
    assert r.tokenizer == str((tmp_path / "run" / "tokenizer").resolve())
    tok, gpt2 = load_tokenizer(r.tokenizer), load_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eod_id) == (50257, 50256)
    assert all(tok.encode(t) == gpt2.encode(t) for t in TEXTS)
    x = torch.tensor([gpt2.encode("The quick brown fox jumps over the lazy dog")])
    logits, _, _ = fitgpt_logits(tmp_path / "run", x)
    with torch.no_grad():
        torch.testing.assert_close(logits[..., :50257], ref(x).logits, rtol=0, atol=1e-5)
    # no tokenizer files, GPT-2's vocabulary size: GPT-2's tokenizer is recorded
    (tmp_path / "hf" / "tokenizer.json").unlink()
    (tmp_path / "hf" / "tokenizer_config.json").unlink()
    assert import_hf(tmp_path / "hf", tmp_path / "run2").tokenizer == "gpt2"


def test_unprefixed_pytorch_model_bin_imports(tmp_path):
    """openai-community/gpt2's own layout: GPT2Model names (no `transformer.`), causal-mask
    buffers stored alongside, a pickled .bin; passed as the file itself."""
    ref = hf_model(tmp_path / "hf", save=False)
    (tmp_path / "hf").mkdir()
    ref.config.save_pretrained(tmp_path / "hf")
    sd = {k.removeprefix("transformer."): v for k, v in ref.state_dict().items()}
    sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    sd["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    torch.save(sd, tmp_path / "hf" / "pytorch_model.bin")
    import_hf(tmp_path / "hf" / "pytorch_model.bin", tmp_path / "run")
    x = torch.randint(0, 1000, (1, 20))
    logits, _, _ = fitgpt_logits(tmp_path / "run", x)
    with torch.no_grad():
        torch.testing.assert_close(logits[..., :1000], ref(x).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_import_then_export_is_bit_exact(tmp_path, tie):
    # fields off transformers' defaults that fitgpt's model does not hold: carried back
    hf_model(tmp_path / "hf", tie=tie, pad_token_id=0, initializer_range=0.05, n_ctx=64)
    import_hf(tmp_path / "hf", tmp_path / "run")
    r = export_hf(tmp_path / "run", tmp_path / "out")
    a, b = hf_state(tmp_path / "hf"), hf_state(tmp_path / "out")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert r.params == sum(t.numel() for t in a.values())
    src, out = (
        json.loads((p / "config.json").read_text()) for p in (tmp_path / "hf", tmp_path / "out")
    )
    for key in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "tie_word_embeddings"):
        assert src[key] == out[key], key
    assert GPT2LMHeadModel.from_pretrained(tmp_path / "out").config.activation_function == (
        "gelu_pytorch_tanh"
    )
    assert_config_carried(tmp_path / "hf", tmp_path / "out", skip=("activation_function",))


def test_sharded_safetensors_checkpoint_imports(tmp_path):
    ref = hf_model(tmp_path / "hf", save=False)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    import_hf(tmp_path / "hf", tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "out")
    b = hf_state(tmp_path / "out")
    assert all(torch.equal(v, b[k]) for k, v in ref.state_dict().items() if k in b)
    assert len(b) == len([k for k in ref.state_dict() if k != "lm_head.weight"])


# ---- export ------------------------------------------------------------------------------------
def test_bias_free_model_exports_with_zero_biases(tmp_path):
    train(run_config(tmp_path / "run", steps=2, bias=False, tie_embeddings=False), CPU)
    r = export_hf(tmp_path / "run", tmp_path / "out")
    assert r.tokenizer is None and not (tmp_path / "out" / "tokenizer.json").exists()
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert all(hf.state_dict()[k].abs().sum() == 0 for k in hf.state_dict() if k.endswith("bias"))
    x = torch.randint(0, 96, (2, 32))
    logits, _, _ = fitgpt_logits(tmp_path / "run", x)
    with torch.no_grad():
        torch.testing.assert_close(logits[..., :96], hf(x).logits, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def stdlib_run(tmp_path_factory):
    """A tiny model trained on real text with a real tokenizer (UTF-8 bytes)."""
    out = tmp_path_factory.mktemp("stdlib") / "run"
    train(run_config(out, steps=30, data="stdlib", lr=1e-2, seq_len=64), CPU)
    return out


def test_trained_model_exports_to_transformers(stdlib_run, tmp_path):
    export_hf(stdlib_run, tmp_path / "out")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    model, meta = load_model(stdlib_run, torch.device("cpu"))
    tok = load_tokenizer(meta["tokenizer"])
    assert all(hf_tok.encode(t) == tok.encode(t) for t in TEXTS)
    x = torch.tensor([tok.encode("def main(args):\n    return ")])
    with torch.no_grad():
        torch.testing.assert_close(model(x)[..., :256], hf(x).logits, rtol=0, atol=1e-5)
    greedy = SampleConfig(max_new_tokens=20, temperature=0.0)
    ours = generate(model, x, greedy)[0].tolist()
    theirs = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20)
    assert ours == theirs[0].tolist()
    assert tok.decode(ours) == hf_tok.decode(theirs[0])


@pytest.mark.parametrize("kind", ["gpt2", "bpe"])
def test_exported_tokenizer_encodes_as_fitgpt(tmp_path, kind):
    if kind == "gpt2":
        spec = "gpt2"
    else:
        (tmp_path / "corpus.txt").write_text("def hello(world):\n    return world * 2\n" * 50)
        spec = str(tmp_path / "bpe")
        train_tokenizer([str(tmp_path / "corpus.txt")], 300, spec, show_progress=False)
    (tmp_path / "out").mkdir()
    write_hf_tokenizer(spec, tmp_path / "out", 1024)
    hf_tok, tok = AutoTokenizer.from_pretrained(tmp_path / "out"), load_tokenizer(spec)
    assert all(hf_tok.encode(t) == tok.encode(t) for t in [*TEXTS, "def hello(world):"])
    assert len(hf_tok) == tok.vocab_size and hf_tok.eos_token_id == tok.eod_id


def test_cli_import_generate_export(tmp_path, capsys):
    from cli_refusal import run_main

    hf_model(tmp_path / "hf", vocab=300, positions=32)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two cores: no thread oversubscription

    # the three commands' own path in this process (their output and files are the test); the
    # refusal at the end, a process's exit and stderr line, in a process of its own
    code, out, err = run_main(capsys, "import", "hf", tmp_path / "hf", "--out", tmp_path / "run")
    assert code == 0, err
    assert "2 layers" in out and "vocabulary 300 padded to 384" in out
    assert "peak RSS" in out and len(out.strip().splitlines()) == 1
    # generate and export read only `master`: they work on a weights-only checkpoint
    code, _, err = run_main(
        capsys, "generate", "--ckpt", tmp_path / "run", "--tokenizer", "bytes",
        "--max-new-tokens", "5",
    )  # fmt: skip
    assert code == 0, err
    code, _, err = run_main(
        capsys, "export", "--ckpt", tmp_path / "run", "--out", tmp_path / "w.safetensors"
    )
    assert code == 0, err
    assert load_file(tmp_path / "w.safetensors")["wte.weight"].shape == (384, 32)
    cmd = [sys.executable, "-m", "fitgpt", "import", "hf", str(tmp_path / "hf")]
    r = subprocess.run(
        [*cmd, "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 2 and "not empty" in r.stderr and "--overwrite" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    hf_model(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    with pytest.raises(UserError, match=r"is a model .* came from"):  # never the run's source
        export_hf(tmp_path / "run", tmp_path / "hf", overwrite=True)
    hf_model(tmp_path / "hf2", seed=1)
    import_hf(tmp_path / "hf2", tmp_path / "run", overwrite=True)
    with pytest.raises(UserError, match="already exists; pass --overwrite"):
        export_hf(tmp_path / "run", tmp_path / "hf")
    export_hf(tmp_path / "run", tmp_path / "hf", overwrite=True)
    a, b = hf_state(tmp_path / "hf2"), hf_state(tmp_path / "hf")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf2", "run"]  # no leftovers


# ---- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, needle",
    [
        ({"activation_function": "gelu"}, "activation_function='gelu'"),
        ({"activation_function": "relu"}, "tanh GELU"),
        ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
        ({"n_inner": 100}, "n_inner=100"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"model_type": "gpt_neox"}, "only GPT-2"),
        ({"n_layer": "two"}, "n_layer='two'"),
    ],
)
def test_hf_configs_fitgpt_cannot_compute_are_refused(change, needle):
    cfg = {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64, "vocab_size": 100}
    assert model_config_from_hf(cfg, "config.json").n_layer == 2
    with pytest.raises(UserError, match=r"config\.json") as e:
        model_config_from_hf(cfg | change, "config.json")
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, needle", [({"position": "alibi"}, "alibi"), ({"embed_norm": True}, "embed-norm")]
)
def test_options_hf_cannot_represent_are_refused(change, needle):
    with pytest.raises(UserError, match=needle):
        check_exportable(ModelConfig(**change))


def test_damaged_or_wrong_checkpoints_are_refused_before_writing(tmp_path):
    ref = hf_model(tmp_path / "hf", vocab=1000)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg | {"n_positions": 128}))
    with pytest.raises(UserError, match=r"wpe.weight has shape \[64, 32\], config.json implies"):
        import_hf(tmp_path / "hf", tmp_path / "run")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": False}))
    with pytest.raises(UserError, match=r"lm_head\.weight is missing"):
        import_hf(tmp_path / "hf", tmp_path / "run")
    assert not (tmp_path / "run").exists()
    ref.save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError, match=r"has no config\.json"):
        import_hf(tmp_path, tmp_path / "run")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(UserError, match="not a safetensors file"):
        import_hf(tmp_path / "hf", tmp_path / "run")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
