"""`fitgpt data fake|clean|merge|inspect` on tiny real files."""

from __future__ import annotations

import os
import unicodedata

import numpy as np
import pytest
from cli_refusal import assert_refused, files, run_in_process, run_process

from fitgpt.cli import main
from fitgpt.data.indexed import IndexedDataset, IndexedWriter
from fitgpt.data.tokenizer import load_tokenizer
from fitgpt.data.tools import CleanConfig, FakeConfig, clean, fake, inspect, merge
from fitgpt.errors import UserError


def _write(prefix, docs, dtype=np.uint16) -> str:
    with IndexedWriter(str(prefix), dtype) as w:
        w.add(np.concatenate(docs), np.array([len(d) for d in docs]))
    return str(prefix)


def test_fake_markov_is_learnable_and_valid(tmp_path):
    d = fake(FakeConfig(output_prefix=str(tmp_path / "f"), tokens=200_000, vocab=500, doc_len=64))
    assert d.num_tokens == 200_000 and d.dtype == np.uint16 and d.max_token() < 500
    assert 2000 < d.num_documents < 4500 and d.lengths.min() >= 1
    t = np.asarray(d.tokens, dtype=np.int64)
    pairs = np.zeros((500, 500), dtype=np.int64)
    np.add.at(pairs, (t[:-1], t[1:]), 1)
    top4 = np.sort(pairs, axis=1)[:, -4:].sum()
    assert top4 / pairs.sum() > 0.95  # 4 successors per token; the rest are seams between walks


def test_fake_uniform_deterministic_and_wide_vocab(tmp_path):
    cfg = dict(tokens=10_000, vocab=100_000, structure="uniform", doc_len=100, seed=1)
    a = fake(FakeConfig(output_prefix=str(tmp_path / "a"), **cfg))
    fake(FakeConfig(output_prefix=str(tmp_path / "b"), **cfg))
    assert a.dtype == np.int32 and a.max_token() > 65535
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes()
    with pytest.raises(UserError, match="--doc-len"):
        FakeConfig(output_prefix="x", doc_len=0)


def test_clean_drops_short_documents(tmp_path):
    src = _write(tmp_path / "s", [np.arange(5), np.arange(1), np.arange(3), np.arange(2)])
    r = clean(CleanConfig(input=src, output_prefix=str(tmp_path / "o"), min_tokens=3))
    out = IndexedDataset(str(tmp_path / "o"))
    assert [out[i].tolist() for i in range(len(out))] == [[0, 1, 2, 3, 4], [0, 1, 2]]
    assert (r.documents_in, r.documents_out, r.tokens_in, r.tokens_out) == (4, 2, 11, 8)
    assert r.dropped == {"under 3 tokens": 2} and "2 under 3 tokens" in r.summary("o")


def test_clean_fixes_unicode_and_reports(tmp_path):
    tok = load_tokenizer("gpt2")
    decomposed = unicodedata.normalize("NFD", "café crème")
    texts = ["plain text here", "bad \ufffd byte", decomposed, "ok"]
    src = _write(tmp_path / "s", [np.array(tok.encode(t)) for t in texts])
    r = clean(
        CleanConfig(input=src, output_prefix=str(tmp_path / "o"), min_tokens=2, fix_unicode=True)
    )
    out = IndexedDataset(str(tmp_path / "o"))
    assert [tok.decode(out[i].tolist()) for i in range(len(out))] == [texts[0], "café crème"]
    assert r.dropped == {"holding U+FFFD": 1, "under 2 tokens": 1} and r.normalised == 1


def test_merge_keeps_documents_and_checks_dtypes(tmp_path):
    a = _write(tmp_path / "a", [np.arange(3), np.arange(2)])
    with IndexedWriter(str(tmp_path / "b"), np.uint16) as w:  # one document of two sequences
        w.add(np.arange(10, 14), np.array([1, 3]), doc_ends=np.array([2]))
    m = merge([a, str(tmp_path / "b")], str(tmp_path / "m"))
    assert m.lengths.tolist() == [3, 2, 1, 3] and m.doc_idx.tolist() == [0, 1, 2, 4]
    assert np.asarray(m.tokens).tolist() == [0, 1, 2, 0, 1, 10, 11, 12, 13]
    wide = _write(tmp_path / "w", [np.array([70000, 1])], dtype=np.int32)
    with pytest.raises(UserError, match="different tokenizers"):
        merge([a, wide], str(tmp_path / "x"))
    assert not (tmp_path / "x.idx").exists()
    forced = merge([a, wide], str(tmp_path / "x"), force=True)
    assert forced.dtype == np.int32 and np.asarray(forced.tokens)[-2:].tolist() == [70000, 1]
    small = _write(tmp_path / "u8", [np.array([7, 8])], dtype=np.uint8)
    assert merge([small, a], str(tmp_path / "y")).dtype == np.uint16  # widened within 16 bits
    with pytest.raises(UserError, match="at least two"):
        merge([a], str(tmp_path / "z"))


def test_inspect_describes_and_decodes(tmp_path):
    tok = load_tokenizer("gpt2")
    src = _write(tmp_path / "s", [np.array(tok.encode("Hello world")), np.arange(1, 40)])
    text = inspect(src, "gpt2", documents=1)
    assert "documents  2 (2 sequences)" in text and "tokens     41" in text
    assert "min 2  median 20  mean 20.5  max 39" in text
    assert "'Hello world'" in text and "32-63" in text
    assert "not decoded" in inspect(_write(tmp_path / "w", [np.array([70000])], np.int32))


def test_cli_fake_clean_merge_inspect(tmp_path, capsys):
    p = str(tmp_path)

    def run(*argv):
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        return e.value.code

    assert (
        run("data", "fake", "--tokens", "20k", "--vocab", "300", "--output-prefix", p + "/f") == 0
    )
    assert (
        run(
            "data", "clean", "--input", p + "/f", "--output-prefix", p + "/c", "--min-tokens", "100"
        )
        == 0
    )
    assert run("data", "merge", p + "/f", p + "/c", "--output-prefix", p + "/m") == 0
    assert run("data", "inspect", p + "/m", "--tokenizer", "none") == 0
    out = capsys.readouterr().out
    assert "20,000 uint16 tokens" in out and "under 100 tokens" in out and "MMIDIDX" in out
    assert run("data", "inspect", p + "/missing") == 2
    assert "missing.bin does not exist" in capsys.readouterr().err


# ---- refusals: exit 2, one stderr line naming the input, no file left behind --------------------
def _pair(tmp_path) -> str:
    fake(FakeConfig(output_prefix=str(tmp_path / "p"), tokens=2000, vocab=300, doc_len=40))
    (tmp_path / "dir").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "q.bin").mkdir()  # where an output's .bin would go
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    return str(tmp_path / "p")


REFUSALS = [  # (argv with {t} for the test directory, what the line must name)
    ("data fake --output-prefix {t}/adir/", ["{t}/adir/", "ends in a directory"]),
    ("data fake --output-prefix {t}/dir", ["{t}/dir is a directory"]),
    ("data fake --output-prefix {t}/afile/x", ["{t}/afile is a file, not a directory"]),
    ("data fake --output-prefix {t}/q", ["{t}/q.bin is a directory"]),
    ("data fake --output-prefix {t}/f --seed -1", ["--seed -1"]),
    ("data fake --output-prefix {t}/f --tokens 0", ["--tokens 0"]),
    ("data inspect {t}/p --docs -1", ["--docs -1"]),
    ("data inspect {t}/p --chars 0", ["--chars 0"]),
    ("data inspect {t}/missing", ["{t}/missing.bin does not exist"]),
    ("data clean --input {t}/p --output-prefix {t}/dir/", ["{t}/dir/"]),
    ("data clean --input {t}/p --output-prefix {t}/q", ["{t}/q.bin is a directory"]),
    ("data clean --input {t}/p --output-prefix {t}/./p", ["is the input"]),
    ("data clean --input {t}/p --output-prefix {t}/c --min-tokens -1", ["--min-tokens -1"]),
    ("data merge {t}/p {t}/p --output-prefix {t}/dir", ["{t}/dir is a directory"]),
    ("data merge {t}/p {t}/missing --output-prefix {t}/m", ["{t}/missing.bin"]),
    ("data preprocess --input {t}/in.jsonl --output-prefix {t}/afile/c", ["{t}/afile is a file"]),
    ("data preprocess --input {t}/in.jsonl --output-prefix {t}/x --workers 100000", ["--workers"]),
    ("data preprocess --input {t}/nope.jsonl --output-prefix {t}/x", ["{t}/nope.jsonl"]),
]


@pytest.mark.parametrize("argv, names", REFUSALS, ids=[a for a, _ in REFUSALS])
def test_bad_input_is_refused_in_one_line(tmp_path, capsys, argv, names):
    _pair(tmp_path)
    t = str(tmp_path)
    before = files(tmp_path)
    code, err = run_in_process(capsys, *argv.format(t=t).split())
    assert_refused(code, err, *(n.format(t=t) for n in names))
    assert files(tmp_path) == before


def test_unwritable_output_is_refused_before_work(tmp_path, capsys):
    import tempfile

    try:  # sysfs refuses new files even to root; skip where it does not
        os.close(tempfile.mkstemp(dir="/sys")[0])
        pytest.skip("/sys is writable here")
    except OSError:
        pass
    code, err = run_in_process(capsys, "data", "fake", "--output-prefix", "/sys/fitgpt/x")
    assert "cannot write in /sys" in assert_refused(code, err, "/sys/fitgpt/x")


def test_directory_prefix_refused_by_the_real_cli(tmp_path):
    (tmp_path / "adir").mkdir()
    r = run_process("data", "fake", "--output-prefix", "adir/", "--tokens", "1000", cwd=tmp_path)
    assert_refused(r.returncode, r.stderr, "--output-prefix 'adir/' ends in a directory")
    assert files(tmp_path) == set()  # no hidden adir/.bin, adir/.idx
