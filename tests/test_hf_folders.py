"""Hugging Face folders as people have them (issue 48, items 1-3 and 9b): embeddings with more
rows than the tokenizer has ids (Qwen2.5, Qwen3), config.json with both of transformers 5's rope
keys, and broken weights (overlapping safetensors bytes, a distinct head under
tie_word_embeddings, NaN or inf values); and data made with a same-sized but other tokenizer.

Every model is built here by transformers with random weights and saved with save_pretrained,
every tokenizer trained here (tests/tokenizer_folders.py); where transformers accepts a folder,
fitgpt must compute what it computes (logits within 1e-5 in fp32), before and after a
fine-tune's export; where it refuses, fitgpt refuses in one line naming the file and the field.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import tokenizer_folders
import torch
from cli_refusal import assert_refused, files, run_in_process

from fitgpt.cli import main
from fitgpt.errors import UserError
from fitgpt.infer.generate import load_model
from fitgpt.interop.hf_import import import_hf
from fitgpt.interop.init_source import find_source

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (after the skip)

SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
TRAIN = (
    "--steps", "3", "--micro-batch", "2", "--seq-len", "32", "--device", "cpu", "--plan",
    "off", "--engine", "ddp", "--eval-every", "0", "--log-every", "1", "--cpu-threads", "1",
)  # fmt: skip
CPU = torch.device("cpu")


def hf_model(folder, cls, rows: int, tokenizer=None, **fields):
    """A random model of config class `cls` with `rows` embedding rows, saved by transformers
    into `folder` (with `tokenizer`'s files beside it, as released folders have them); returns
    transformers' model read back from the folder in fp32."""
    torch.manual_seed(0)
    cfg = cls(**SHAPE, vocab_size=rows, **fields)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(1.0 if "norm" in n else 0.0, 0.1 if "norm" in n or "bias" in n else 0.08)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer(folder)
    return reload(folder)


def reload(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def ok(*argv) -> None:
    """`fitgpt ARGV` in this process; it must succeed."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    assert e.value.code in (0, None), argv


def preprocess(tmp_path, tokenizer, name: str = "d") -> str:
    """tokenizer_folders' corpus as a .bin/.idx pair made with `tokenizer`; its prefix."""
    docs = tmp_path / f"{name}.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in tokenizer_folders.CORPUS))
    ok("data", "preprocess", "--input", docs, "--output-prefix", tmp_path / name,
       "--tokenizer", tokenizer, "--workers", "0", "--append-eod", "--quiet")  # fmt: skip
    return str(tmp_path / f"{name}_text_document")


def fitgpt_logits(run, x):
    model, _ = load_model(run, CPU)
    with torch.no_grad():
        return model.float()(x)


def losses(run) -> list[float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r.get("kind") == "train"]


# ---- 1. more embedding rows than tokenizer ids ---------------------------------------------------
PADDED = {
    # Qwen2.5: 152,064 rows (a multiple of 128) for 151,665 ids; here 512 for 482
    "qwen2.5": (transformers.Qwen2Config, 512, tokenizer_folders.qwen, {}),
    # Qwen3: 151,936 rows for 151,669 ids; here 640 for 482, q/k norms, head_dim given
    "qwen3": (transformers.Qwen3Config, 640, tokenizer_folders.qwen, {"head_dim": 8}),
    # not in the issue: a Mistral-shaped folder whose 700 rows fitgpt itself pads to 768
    "mistral": (transformers.MistralConfig, 700, tokenizer_folders.mistral, {}),
}


@pytest.mark.parametrize("name", list(PADDED))
def test_a_folder_with_padded_rows_fine_tunes_on_its_own_tokenizer_and_exports_its_rows(
    tmp_path, name, capsys
):
    cls, rows, tokenizer, fields = PADDED[name]
    folder = tmp_path / "hf"
    ref = hf_model(folder, cls, rows, tokenizer, tie_word_embeddings=False, **fields)
    data = preprocess(tmp_path, folder)  # the folder's own tokenizer: fewer ids than rows
    run = tmp_path / "run"
    ok("train", "--init-from", folder, "--data", data, "--out", run, *TRAIN)
    assert len(losses(run)) == 3 and all(v == v for v in losses(run))  # trained, no NaN
    model, _ = load_model(run, CPU)
    assert model.cfg.vocab_size == rows  # the rows are the model's, kept through training
    ok("export", "--ckpt", run, "--format", "hf", "--out", tmp_path / "out")
    theirs = reload(tmp_path / "out")
    assert theirs.config.vocab_size == rows
    assert theirs.model.embed_tokens.weight.shape[0] == theirs.lm_head.weight.shape[0] == rows
    assert not torch.equal(theirs.lm_head.weight, ref.lm_head.weight)  # the fine-tuned weights
    x = torch.randint(0, rows, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(x).logits
    torch.testing.assert_close(fitgpt_logits(run, x)[..., :rows], want, rtol=0, atol=1e-5)

    # a tokenizer of more ids than the rows is refused before any work, in one line
    gpt2 = preprocess(tmp_path, "gpt2", "g")
    before = files(tmp_path)
    code, err = run_in_process(
        capsys, "train", "--init-from", folder, "--data", gpt2, "--out", tmp_path / "r2", *TRAIN
    )
    assert_refused(code, err, str(folder), f"{rows} embedding rows", "50257 ids")
    assert files(tmp_path) == before


def test_an_imported_qwen_folder_fine_tunes_from_its_run(tmp_path):
    """`fitgpt import hf` then `--init-from RUN`, on data of the folder's tokenizer."""
    folder = tmp_path / "hf"
    ref = hf_model(folder, transformers.Qwen2Config, 512, tokenizer_folders.qwen)
    import_hf(folder, tmp_path / "imported")
    data = preprocess(tmp_path, folder)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(x).logits
    torch.testing.assert_close(fitgpt_logits(tmp_path / "imported", x), want, rtol=0, atol=1e-5)
    run = tmp_path / "run"
    ok("train", "--init-from", tmp_path / "imported", "--data", data, "--out", run, *TRAIN)
    assert load_model(run, CPU)[0].cfg.vocab_size == 512 and len(losses(run)) == 3
    ok("train", "--resume", "--out", run, "--steps", "4", "--cpu-threads", "1")  # rows kept
    assert len(losses(run)) == 4


# ---- 9b. another tokenizer of the same size ------------------------------------------------------
def swapped(src, dest):
    """`src`'s tokenizer with two ordinary tokens' ids exchanged: as many ids, other text."""
    dest.mkdir()
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dest / f.name)
    tj = json.loads((dest / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dest / "tokenizer.json").write_text(json.dumps(tj))
    return dest


def test_data_of_another_tokenizer_of_the_same_size_is_refused(tmp_path, capsys):
    folder = tmp_path / "hf"  # as many rows as its tokenizer has ids: every size check passes
    hf_model(folder, transformers.Qwen2Config, 482, tokenizer_folders.qwen)
    other = preprocess(tmp_path, swapped(folder, tmp_path / "other"), "o")
    import_hf(folder, tmp_path / "imported")
    for src in (folder, tmp_path / "imported"):  # the folder, and the run import made of it
        before = files(tmp_path)
        argv = ("train", "--init-from", src, "--data", other, "--out", tmp_path / "r", *TRAIN)
        code, err = run_in_process(capsys, *argv)
        assert_refused(code, err, str(src), "another vocabulary", str(tmp_path / "other"))
        assert files(tmp_path) == before
    # the same tokenizer from a copy of its files is the same vocabulary: it trains
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "imported" / "tokenizer", copy)
    same = preprocess(tmp_path, copy, "s")
    ok("train", "--init-from", folder, "--data", same, "--out", tmp_path / "run", *TRAIN)


# ---- 2. rope_scaling beside transformers 5's rope_parameters ---------------------------------
ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    # not in the issue: an older file's `type`, its own rope_theta, a top-level rope_theta
    "yarn-type": {"type": "yarn", "factor": 2.0, "beta_fast": 8.0, "rope_theta": 2e4},
    "linear-top-theta": {"rope_type": "linear", "factor": 2.0, "_top_theta": 5e5},
}


def rope_folder(folder, scaling: dict):
    """A Llama saved by transformers 5 (rope_parameters, theta 1e6), then rope_scaling added
    to its config.json as a model card says; transformers' model read from that folder."""
    hf_model(folder, transformers.LlamaConfig, 300,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
    cfg = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in cfg
    scaling = dict(scaling)
    if "_top_theta" in scaling:
        cfg["rope_theta"] = scaling.pop("_top_theta")
    (folder / "config.json").write_text(json.dumps(cfg | {"rope_scaling": scaling}))
    return reload(folder)


@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(tmp_path, kind):
    ref = rope_folder(tmp_path / "hf", ROPE[kind])
    x = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))  # past 16
    with torch.no_grad():
        want = ref(x).logits
    run = import_hf(tmp_path / "hf", tmp_path / "run").ckpt.parent
    assert load_model(run, CPU)[0].cfg.rope_scaling is not None
    torch.testing.assert_close(fitgpt_logits(run, x)[..., :300], want, rtol=0, atol=1e-5)
    # the export writes the scaling back: transformers reads the same model from it
    ok("export", "--ckpt", run, "--format", "hf", "--out", tmp_path / "out")
    with torch.no_grad():
        again = reload(tmp_path / "out")(x).logits
    torch.testing.assert_close(again, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "scaling, names",
    [
        # transformers refuses it (KeyError: low_freq_factor, high_freq_factor)
        ({"rope_type": "llama3", "factor": 8.0}, ["low_freq_factor", "high_freq_factor"]),
        # transformers has no function for it (KeyError when the model is built)
        ({"rope_type": "llama-3", "factor": 8.0}, ["'llama-3'", "fix rope_type"]),
        # transformers computes it; fitgpt does not (docs/interop.md)
        ({"rope_type": "dynamic", "factor": 2.0}, ["'dynamic'", "remove rope_scaling"]),
        ({"type": "longrope", "factor": 2.0}, ["'longrope'"]),
    ],
)
def test_rope_configs_fitgpt_cannot_read_are_refused_not_imported_as_plain_rope(
    tmp_path, capsys, scaling, names
):
    hf_model(tmp_path / "hf", transformers.LlamaConfig, 300)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg | {"rope_scaling": scaling}))
    before = files(tmp_path)
    for argv in (
        ("import", "hf", tmp_path / "hf", "--out", tmp_path / "run"),
        ("train", "--init-from", tmp_path / "hf", "--out", tmp_path / "r", *TRAIN),
    ):
        code, err = run_in_process(capsys, *argv)
        assert_refused(code, err, "config.json", "rope_scaling", *names)
    assert files(tmp_path) == before


# ---- 3. broken weights -------------------------------------------------------------------------
def rewrite_header(path, change) -> None:
    """`path`'s safetensors header edited by `change(header)`, the data left as it is."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


@pytest.mark.parametrize("how", ["same-bytes", "partial", "past-the-end", "trailing"])
def test_a_shard_whose_header_does_not_tile_its_bytes_is_refused(tmp_path, capsys, how):
    hf_model(tmp_path / "hf", transformers.LlamaConfig, 300)
    st = tmp_path / "hf" / "model.safetensors"
    k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "kv")

    def change(h):
        a, b = h[k]["data_offsets"]
        if how == "same-bytes":  # v_proj's header points at k_proj's bytes
            h[v]["data_offsets"] = [a, b]
        elif how == "partial":  # half of v_proj's bytes are k_proj's
            h[v]["data_offsets"] = [a + (b - a) // 2, b + (b - a) // 2]
        elif how == "past-the-end":  # the last tensor's bytes lie past the end of the file
            last = max((n for n in h if n != "__metadata__"), key=lambda n: h[n]["data_offsets"])
            h[last]["data_offsets"] = [o + 64 for o in h[last]["data_offsets"]]

    rewrite_header(st, change)
    if how == "trailing":
        st.write_bytes(st.read_bytes() + b"\0" * 16)
    with pytest.raises(Exception):  # noqa: B017  (safetensors' own error type)  it refuses too
        load_file(st)
    before = files(tmp_path)
    for argv in (
        ("import", "hf", tmp_path / "hf", "--out", tmp_path / "run"),
        ("train", "--init-from", tmp_path / "hf", "--out", tmp_path / "r", *TRAIN),
    ):
        code, err = run_in_process(capsys, *argv)
        line = assert_refused(code, err, str(st))
        assert {"same-bytes": "overlaps", "partial": "overlaps", "past-the-end": "truncated",
                "trailing": "not the header of this file"}[how] in line  # fmt: skip
    assert files(tmp_path) == before


@pytest.mark.parametrize("cls", [transformers.LlamaConfig, transformers.Qwen2Config])
def test_a_distinct_head_under_tie_word_embeddings_is_kept_as_transformers_keeps_it(tmp_path, cls):
    """transformers 5 unties a tied config whose weights hold a head other than the embedding
    (and ties one whose stored head equals it); fitgpt's logits must be its."""
    folder = tmp_path / "hf"
    hf_model(folder, cls, 300, tie_word_embeddings=False)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    ref = reload(folder)
    assert not torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)  # kept untied
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(x).logits
    imported = import_hf(folder, tmp_path / "run")
    assert "kept untied, as transformers keeps it" in imported.note  # said, as transformers does
    run = imported.ckpt.parent
    torch.testing.assert_close(fitgpt_logits(run, x)[..., :300], want, rtol=0, atol=1e-5)
    assert find_source(str(folder)).model.tie_embeddings is False
    # a stored head equal to the embedding: tied, as transformers ties it
    sd = load_file(folder / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, folder / "model.safetensors", {"format": "pt"})
    ref = reload(folder)
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        want = ref(x).logits
    imported = import_hf(folder, tmp_path / "tied")
    run = imported.ckpt.parent
    assert load_model(run, CPU)[0].cfg.tie_embeddings is True and imported.note is None
    torch.testing.assert_close(fitgpt_logits(run, x)[..., :300], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "bad, dtype", [(float("nan"), torch.float32), (float("inf"), torch.bfloat16)]
)
def test_nan_or_inf_in_the_source_is_refused_before_training(tmp_path, capsys, bad, dtype):
    folder = tmp_path / "hf"
    hf_model(folder, transformers.LlamaConfig, 300)
    sd = {k: v.to(dtype) for k, v in load_file(folder / "model.safetensors").items()}
    name = "model.layers.1.mlp.down_proj.weight"
    sd[name][3, 5] = bad
    save_file(sd, folder / "model.safetensors", {"format": "pt"})
    before = files(tmp_path)
    with pytest.raises(UserError) as e:
        import_hf(folder, tmp_path / "run")
    assert str(folder / "model.safetensors") in str(e.value) and name in str(e.value)
    assert "\n" not in str(e.value)
    argv = ("train", "--init-from", folder, "--data", "synthetic", "--out", tmp_path / "r", *TRAIN)
    code, err = run_in_process(capsys, *argv)
    assert_refused(code, err, str(folder / "model.safetensors"), name, "NaN or infinite")
    # no step was run: no metrics, no checkpoint (the run folder's record may stay, for
    # --resume, as after any failure once the trainer is built: train/rundir.py)
    assert files(tmp_path) - before <= {"r/run.json"}
