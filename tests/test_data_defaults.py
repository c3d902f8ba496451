"""Defaults a newcomer meets on their own small data (issue 33): the default split on a small
corpus, a run that does not validate, and data made by `fitgpt data fake --vocab V`."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from cli_refusal import assert_refused, files, run_in_process

from fitgpt.data.config import MEGATRON_SPLIT, DataConfig, open_data, resolve_split
from fitgpt.data.indexed import IndexedWriter
from fitgpt.data.splits import split_ranges
from fitgpt.errors import UserError

TRAIN = shlex.split(
    "train --preset tiny --layers 2 --hidden 32 --heads 2 --seq-len 16 --steps 2 "
    "--micro-batch 2 --device cpu --plan off --engine ddp --log-every 1"
)


def _corpus(prefix: Path, docs: int, doc_len: int = 40, vocab: int = 256) -> str:
    """`docs` documents of `doc_len` byte tokens, no tokenizer record (a pair from Megatron)."""
    rng = np.random.default_rng(0)
    with IndexedWriter(str(prefix), np.uint16) as w:
        w.add(rng.integers(0, vocab, docs * doc_len), np.full(docs, doc_len))
    return str(prefix)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # train's thread rule must not change this process


def _meta(run: Path) -> dict:
    return json.loads(sorted(run.glob("step_*/meta.json"))[-1].read_text())


# ---- the default split ------------------------------------------------------------------------
def test_auto_split_is_megatrons_wherever_that_gives_every_split_a_document():
    for docs in (1500, 10_000, 1_000_000):
        split_ranges(MEGATRON_SPLIT, docs)  # every split gets a document...
        assert resolve_split("auto", docs) == MEGATRON_SPLIT  # ...so auto is Megatron's split


def test_auto_split_on_a_small_corpus_validates_on_its_share_and_drops_test():
    assert resolve_split("auto", 400) == "388,12,0"
    assert resolve_split("auto", 10) == "9,1,0"  # at least one document to validate on
    assert resolve_split("auto", 2) == "1,1,0"
    for docs in (2, 3, 10, 33, 34, 400, 1499):
        r = split_ranges(resolve_split("auto", docs), docs)
        assert r["train"][1] - r["train"][0] >= 1 and r["valid"][1] - r["valid"][0] >= 1
    assert resolve_split("auto", 1, validates=False) == "1,0,0"
    assert resolve_split("969,30,1", 400) == "969,30,1"  # an explicit split is Megatron's, strict
    with pytest.raises(UserError, match="test would be empty"):
        split_ranges(resolve_split("969,30,1", 400), 400)


def test_a_400_document_corpus_trains_with_the_default_split(tmp_path, capsys):
    prefix = _corpus(tmp_path / "c", 400)
    argv = [*TRAIN, "--data", prefix, "--tokenizer", "bytes", "--eval-every", "2"]
    code, err = run_in_process(capsys, *argv, "--out", tmp_path / "run")
    assert code in (0, None), err
    assert _meta(tmp_path / "run")["config"]["data"]["split"] == "auto"  # resumes the same way


# ---- a run that does not validate -------------------------------------------------------------
def test_no_validation_share_trains_when_the_run_does_not_validate(tmp_path, capsys):
    prefix = _corpus(tmp_path / "c", 50)
    argv = [*TRAIN, "--data", prefix, "--tokenizer", "bytes", "--split", "100,0,0"]
    code, err = run_in_process(capsys, *argv, "--eval-every", "0", "--no-save")
    assert code in (0, None), err
    before = files(tmp_path)
    code, err = run_in_process(capsys, *argv, "--eval-every", "1", "--out", tmp_path / "r")
    assert_refused(code, err, "--split 100,0,0", "--eval-every 0")
    assert files(tmp_path) == before


def test_open_data_opens_no_validation_split_for_a_run_without_validation(tmp_path):
    prefix = _corpus(tmp_path / "c", 20)
    cfg = DataConfig(data=prefix, tokenizer="bytes", split="1,0,0")
    train, valid, _ = open_data(cfg, seq_len=8, vocab_size=256, seed=0, num_samples=(64, 0))
    assert valid is None and train.get(np.arange(4)).shape == (4, 9)
    with pytest.raises(UserError, match="--eval-every 0"):
        open_data(cfg, seq_len=8, vocab_size=256, seed=0, num_samples=(64, 8))


# ---- data made by `fitgpt data fake` ----------------------------------------------------------
def test_fake_data_trains_its_own_vocabulary_and_is_not_decoded_as_gpt2(tmp_path, capsys):
    fake = ["data", "fake", "--tokens", "4000", "--vocab", "512", "--doc-len", "40"]
    code, err = run_in_process(capsys, *fake, "--output-prefix", tmp_path / "f")
    assert code in (0, None), err
    run = tmp_path / "run"
    code, err = run_in_process(
        capsys, *TRAIN, "--data", tmp_path / "f", "--eval-every", "0", "--out", run
    )
    assert code in (0, None), err
    meta = _meta(run)
    assert meta["config"]["model"]["vocab_size"] == 512  # not GPT-2's 50,257
    assert meta["tokenizer"] is None  # no tokenizer made these ids: none is recorded
    code, err = run_in_process(capsys, "generate", "--ckpt", run, "--max-new-tokens", "4")
    assert_refused(code, err, "without a tokenizer", "data fake")
    code, err = run_in_process(capsys, "generate", "--ckpt", run, "--tokenizer", "gpt2")
    assert_refused(code, err, "--tokenizer gpt2", "512")  # more tokens than the model knows


# ---- outputs that would come out empty ---------------------------------------------------------
def test_a_clean_that_keeps_nothing_is_refused_and_writes_nothing(tmp_path, capsys):
    prefix = str(tmp_path / "c")
    with IndexedWriter(prefix, np.uint16) as w:  # every document holds 0xff: never UTF-8
        w.add(np.tile(np.array([104, 255, 105], np.int64), 5), np.full(5, 3))
    before = files(tmp_path)
    argv = ["data", "clean", "--input", prefix, "--output-prefix", tmp_path / "o"]
    code, err = run_in_process(capsys, *argv, "--tokenizer", "bytes", "--fix-unicode")
    assert_refused(code, err, "--fix-unicode", "all 5 documents")
    code, err = run_in_process(capsys, *argv, "--min-tokens", "4")
    assert_refused(code, err, "--min-tokens 4", "all 5 documents", "has 3 tokens")
    assert files(tmp_path) == before
