"""The tokenizer record next to every pair (PREFIX.fitgpt.json): written by every `fitgpt data`
output, resolved by `--tokenizer auto`, and a mismatch refused in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from cli_refusal import assert_refused, files, run_in_process

from fitgpt.data import sidecar
from fitgpt.data.config import DataConfig, data_tokenizer, open_data
from fitgpt.data.indexed import IndexedDataset, IndexedWriter
from fitgpt.data.preprocess import PreprocessConfig, preprocess
from fitgpt.data.tokenizer import gpt2_files, load_tokenizer, train_tokenizer
from fitgpt.data.tools import CleanConfig, FakeConfig, clean, fake, inspect, merge
from fitgpt.errors import UserError

SUFFIXES = (".bin", ".idx", ".fitgpt.json")
TEXTS = [f"the cat sat on mat number {i}; the dog sat on log {i * 7}" for i in range(40)]


def _corpus(tmp_path, tokenizer: str, name: str = "c") -> str:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = str(tmp_path / name)
    cfg = PreprocessConfig(
        input=str(src), output_prefix=out, tokenizer=tokenizer, workers=0, progress=False
    )
    return preprocess(cfg).prefix


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real byte-level BPE of 300 tokens, in its own directory."""
    root = tmp_path_factory.mktemp("tok")
    (root / "t.txt").write_text("\n".join(TEXTS * 3))
    train_tokenizer([str(root / "t.txt")], 300, str(root / "tok"), show_progress=False)
    return root / "tok"


def test_preprocess_records_its_tokenizer_next_to_an_unchanged_pair(tmp_path):
    prefix = _corpus(tmp_path, "bytes")
    rec = json.loads((tmp_path / "c_text_document.fitgpt.json").read_text())
    assert rec == {
        "format": "fitgpt-data-sidecar",
        "version": 1,
        "tokenizer": "bytes",
        "tokenizer_abs": "bytes",
        "vocab_size": 256,
        "eod_id": None,
        "fingerprint": sidecar.fingerprint(load_tokenizer("bytes")),
        "made_by": "fitgpt data preprocess",
        "bin_bytes": (tmp_path / "c_text_document.bin").stat().st_size,
        "idx_bytes": (tmp_path / "c_text_document.idx").stat().st_size,
    }
    assert sidecar.read(prefix) == rec
    assert files(tmp_path) == {"c.jsonl", *(f"c_text_document{s}" for s in SUFFIXES)}
    # The pair is the one the writer makes without a record: Megatron reads it as before.
    d = IndexedDataset(prefix)
    raw = (tmp_path / "c_text_document.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" and len(raw) == 34 + 12 * len(d) + 8 * (len(d) + 1)


def test_fingerprint_names_the_tokenizer_not_how_it_was_loaded(trained):
    gpt2, by_files = load_tokenizer("gpt2"), load_tokenizer(",".join(map(str, gpt2_files())))
    mine = load_tokenizer(str(trained))
    assert sidecar.fingerprint(gpt2) == sidecar.fingerprint(by_files)
    assert sidecar.fingerprint(gpt2).startswith("50257:")
    assert sidecar.fingerprint(mine) == sidecar.fingerprint(
        load_tokenizer(f"{trained}/vocab.json,{trained}/merges.txt")
    )
    prints = {sidecar.fingerprint(t) for t in (gpt2, mine, load_tokenizer("bytes"))}
    assert len(prints) == 3


def test_auto_resolves_the_recorded_tokenizer_and_a_mismatch_is_refused(
    tmp_path, trained, monkeypatch
):
    shutil.copytree(trained, tmp_path / "tok")
    monkeypatch.chdir(tmp_path)
    prefix = str(tmp_path / _corpus(tmp_path, "tok"))  # the spec as given: relative
    rec = sidecar.read(prefix)
    assert rec["tokenizer"] == "tok" and rec["tokenizer_abs"] == str(tmp_path / "tok")
    monkeypatch.chdir(tmp_path.parent)  # elsewhere: the absolute spec still loads
    cfg = DataConfig(data=prefix, split="8,1,1")
    assert cfg.tokenizer_spec() == str(tmp_path / "tok")
    train, _, tok = open_data(cfg, seq_len=8, vocab_size=96, seed=0)
    assert tok.name == str(tmp_path / "tok") and train.vocab_size == tok.vocab_size <= 300
    with pytest.raises(UserError) as e:
        open_data(DataConfig(data=prefix, tokenizer="gpt2", split="8,1,1"), 8, 96, 0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{prefix}: cannot train on it with tokenizer gpt2")
    assert "made with tok (" in msg and f"--tokenizer {tmp_path / 'tok'}" in msg
    (tmp_path / "tok").rename(tmp_path / "moved")  # neither spec loads any more
    with pytest.raises(UserError, match=r"made with tokenizer tok .*cannot be loaded as it was"):
        DataConfig(data=prefix).tokenizer_spec()
    ok = DataConfig(data=prefix, tokenizer=str(tmp_path / "moved"), split="8,1,1")
    assert open_data(ok, 8, 96, 0)[2].vocab_size == tok.vocab_size  # same fingerprint: accepted


def test_megatron_pair_without_record_works_as_before(tmp_path):
    prefix = _corpus(tmp_path, "bytes")
    sidecar.path(prefix).unlink()
    assert sidecar.read(prefix) is None
    assert DataConfig(data=prefix).tokenizer_spec() == "gpt2"
    _, _, tok = open_data(DataConfig(data=prefix, tokenizer="bytes", split="8,1,1"), 8, 96, 0)
    assert tok.name == "bytes"  # nothing recorded, nothing to refuse (ids are checked later)


def test_stale_or_damaged_record_is_refused(tmp_path):
    prefix = _corpus(tmp_path, "bytes")
    with IndexedWriter(str(tmp_path / "other"), np.uint16) as w:
        w.add(np.arange(5), np.array([5]))
    for ext in (".bin", ".idx"):  # another tool rewrites the pair, not the record
        shutil.copy(tmp_path / f"other{ext}", prefix + ext)
    with pytest.raises(UserError, match=r"rewritten by another tool; delete c_text_document\.fit"):
        sidecar.read(prefix)
    sidecar.path(prefix).write_bytes(b"\xff{not json")
    with pytest.raises(UserError, match=r"c_text_document\.fitgpt\.json is not a fitgpt data"):
        sidecar.read(prefix)


def test_fake_data_records_no_tokenizer(tmp_path):
    a = fake(FakeConfig(output_prefix=str(tmp_path / "a"), tokens=3000, vocab=300, doc_len=50))
    fake(FakeConfig(output_prefix=str(tmp_path / "b"), tokens=3000, vocab=500, doc_len=50))
    rec = sidecar.read(a.prefix)
    assert rec["tokenizer"] is None and rec["vocab_size"] == 300 and rec["fingerprint"] is None
    # ids of no tokenizer: not GPT-2 text; the recorded vocabulary sizes the model (issue 33)
    assert DataConfig(data=a.prefix).tokenizer_spec() == "none"
    assert data_tokenizer(DataConfig(data=a.prefix)).vocab_size == 300
    assert data_tokenizer(DataConfig(data=a.prefix, tokenizer="none")) is None  # --vocab-size's
    text = inspect(a.prefix)
    assert (
        "tokenizer  no tokenizer (fitgpt data fake, 300 ids)" in text and "document 0" not in text
    )
    merge([a.prefix, str(tmp_path / "b")], str(tmp_path / "m"))
    assert sidecar.read(str(tmp_path / "m"))["vocab_size"] == 500


def test_merge_refuses_different_tokenizers(tmp_path, capsys):
    b, g = _corpus(tmp_path, "bytes", "b"), _corpus(tmp_path, "gpt2", "g")
    before = files(tmp_path)
    code, err = run_in_process(capsys, "data", "merge", b, g, "--output-prefix", tmp_path / "m")
    line = assert_refused(code, err, b, g, "different tokenizers", "--force")
    assert "bytes (256 tokens)" in line and "gpt2 (50,257 tokens)" in line
    assert files(tmp_path) == before
    merge([b, g], str(tmp_path / "m"), force=True)
    assert sidecar.read(str(tmp_path / "m")) is None  # mixed ids: no tokenizer to record
    b2 = _corpus(tmp_path, "bytes", "b2")
    merge([b, b2], str(tmp_path / "same"))
    assert sidecar.read(str(tmp_path / "same"))["tokenizer"] == "bytes"


def test_clean_carries_the_record_and_refuses_another_tokenizer(tmp_path, capsys):
    prefix = _corpus(tmp_path, "bytes")
    clean(CleanConfig(input=prefix, output_prefix=str(tmp_path / "o"), min_tokens=50))
    assert sidecar.read(str(tmp_path / "o"))["tokenizer"] == "bytes"
    before = files(tmp_path)
    argv = ["data", "clean", "--input", prefix, "--output-prefix", tmp_path / "u"]
    code, err = run_in_process(capsys, *argv, "--fix-unicode", "--tokenizer", "gpt2")
    line = assert_refused(code, err, prefix, "cannot clean it (--fix-unicode)", "bytes")
    assert "--tokenizer at auto" in line and files(tmp_path) == before
    r = clean(CleanConfig(input=prefix, output_prefix=str(tmp_path / "u"), fix_unicode=True))
    assert r.documents_out == len(TEXTS) and r.dropped == {}  # auto: decoded as bytes


def test_inspect_decodes_with_the_recorded_tokenizer(tmp_path, capsys):
    prefix = _corpus(tmp_path, "bytes")
    text = inspect(prefix)
    assert f"document 0 ({len(TEXTS[0])} tokens, bytes): {TEXTS[0]!r}" in text
    assert "tokenizer  bytes (256 tokens), recorded in c_text_document.fitgpt.json" in text
    code, err = run_in_process(capsys, "data", "inspect", prefix, "--tokenizer", "gpt2")
    assert_refused(code, err, prefix, "cannot decode it with tokenizer gpt2")


def test_a_record_that_cannot_be_written_takes_the_pair_with_it(tmp_path):
    with IndexedWriter(str(tmp_path / "p"), np.uint16) as w:
        w.add(np.arange(5), np.array([5]))
    (tmp_path / "p.fitgpt.json").mkdir()  # the rename onto it fails
    with pytest.raises(
        UserError, match=r"p\.fitgpt\.json: cannot write .*the new pair was removed"
    ):
        sidecar.write(str(tmp_path / "p"), load_tokenizer("bytes"))
    assert files(tmp_path) == set()


def test_rewriting_a_pair_removes_its_old_record(tmp_path):
    prefix = _corpus(tmp_path, "bytes")
    with IndexedWriter(prefix, np.uint16) as w:  # e.g. a tool that records nothing
        w.add(np.arange(5), np.array([5]))
    assert sidecar.read(prefix) is None and not sidecar.path(prefix).exists()
