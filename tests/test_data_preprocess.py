"""`fitgpt data preprocess`: JSON lines -> .bin/.idx, bad input, and worker-count invariance."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from fitgpt.cli import main
from fitgpt.data.indexed import IndexedDataset
from fitgpt.data.preprocess import PreprocessConfig, preprocess
from fitgpt.data.text import stdlib_text
from fitgpt.data.tokenizer import load_tokenizer
from fitgpt.errors import UserError

DOCS = ["Hello world", " Hello world!", "naïve café\n\tdef f(x):\n        return x", "日本語 🙂"]


def _jsonl(path, lines: list[bytes | str]) -> str:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return str(path)


def _run(tmp_path, src, **kw):
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    return preprocess(PreprocessConfig(input=src, output_prefix=str(tmp_path / "out"), **kw))


def _texts(prefix, tok="gpt2"):
    d, t = IndexedDataset(prefix), load_tokenizer(tok)
    return [t.decode(d[i].tolist()) for i in range(len(d))]


def test_roundtrip_text_to_tokens_to_text(tmp_path):
    src = _jsonl(
        tmp_path / "in.jsonl", [json.dumps({"text": t, "id": i}) for i, t in enumerate(DOCS)]
    )
    r = _run(tmp_path, src, append_eod=True)
    assert r.prefix == str(tmp_path / "out_text_document")
    d = IndexedDataset(r.prefix)
    assert d.dtype == np.uint16 and d.num_documents == 4 and d.doc_idx.tolist() == [0, 1, 2, 3, 4]
    assert d[0].tolist() == [15496, 995, 50256] and d[1].tolist() == [18435, 995, 0, 50256]
    assert _texts(r.prefix) == [t + "<|endoftext|>" for t in DOCS]
    assert (r.documents, r.tokens, r.lines) == (4, d.num_tokens, 4)
    assert "documents  4" in r.summary()


def test_gzip_input_other_key_and_bytes_tokenizer(tmp_path):
    src = tmp_path / "in.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in DOCS)
    r = _run(tmp_path, str(src), json_key="body", tokenizer="bytes")
    assert r.prefix.endswith("out_body_document") and _texts(r.prefix, "bytes") == DOCS


def test_worker_count_does_not_change_output_bytes(tmp_path):
    text = stdlib_text(120_000)
    docs = [text[i : i + 3000] for i in range(0, len(text), 3000)]
    src = _jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t}) for t in docs] + ["{broken"])
    outputs = []
    for workers in (1, 2, 0):
        r = preprocess(
            PreprocessConfig(
                input=src,
                output_prefix=str(tmp_path / f"w{workers}"),
                workers=workers,
                append_eod=True,
                chunk_bytes=8_000,
                progress=False,
            )
        )
        assert r.documents == len(docs) and r.skipped == {"malformed JSON": 1}
        outputs.append([Path(r.prefix + ext).read_bytes() for ext in (".bin", ".idx")])
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0][0]) > 40_000  # many chunks, so ordering across workers is exercised


def _bad_lines():
    return [
        json.dumps({"text": "good one"}),
        "{not json",
        json.dumps({"body": "no text key"}),
        json.dumps({"text": 42}),
        json.dumps(["a", "list"]),
        json.dumps({"text": ""}),
        "   ",
        b'{"text": "bad \xff byte"}',
        json.dumps({"text": "lone \ud800 surrogate"}),
        json.dumps({"text": "good two"}),
    ]


def test_bad_lines_are_skipped_counted_and_located(tmp_path):
    src = _jsonl(tmp_path / "bad.jsonl", _bad_lines())
    r = _run(tmp_path, src)
    assert r.skipped == {
        "malformed JSON": 1,
        "missing key 'text'": 1,
        "not a string": 1,
        "not a JSON object": 1,
    }
    assert (r.dropped_empty, r.replaced_utf8, r.documents, r.lines) == (1, 2, 4, 10)
    assert [s.split(": ")[0] for s in r.shown] == [f"{src}:{n}" for n in (2, 3, 4, 5)]
    assert "no key 'text'" in r.shown[1]
    texts = _texts(r.prefix)
    assert texts[0] == "good one" and texts[-1] == "good two"
    assert texts[1] == "bad \ufffd byte" and "\ufffd" in texts[2]
    summary = r.summary()
    assert "1 malformed JSON" in summary and "1 empty documents" in summary


@pytest.mark.parametrize(
    "kw, line, hint",
    [
        ({"on_error": "fail"}, 2, "--on-error skip"),
        ({"on_bad_utf8": "fail"}, 8, "--on-bad-utf8 replace"),
    ],
)
def test_fail_modes_stop_at_the_line_and_leave_nothing(tmp_path, kw, line, hint):
    src = _jsonl(tmp_path / "bad.jsonl", _bad_lines())
    with pytest.raises(UserError, match=f"bad.jsonl:{line}: .*{hint}"):
        _run(tmp_path, src, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no .bin/.idx, no temps


def test_bad_utf8_skip_mode(tmp_path):
    src = _jsonl(tmp_path / "bad.jsonl", _bad_lines())
    r = _run(tmp_path, src, on_bad_utf8="skip")
    assert r.skipped["invalid UTF-8"] == 2 and r.replaced_utf8 == 0 and r.documents == 2


def test_missing_input_and_bad_flags(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        PreprocessConfig(input=str(tmp_path / "nope.jsonl"), output_prefix="x")
    src = _jsonl(tmp_path / "in.jsonl", ['{"text": "a"}'])
    with pytest.raises(UserError, match="negative"):
        PreprocessConfig(input=src, output_prefix="x", workers=-1)
    with pytest.raises(UserError, match="append-eod"):
        _run(tmp_path, src, tokenizer="bytes", append_eod=True)


def test_damaged_gzip_is_reported(tmp_path):
    src = tmp_path / "in.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.writelines(json.dumps({"text": "x" * 50}) + "\n" for _ in range(2000))
    src.write_bytes(src.read_bytes()[:-40])
    with pytest.raises(UserError, match="damaged"):
        _run(tmp_path, str(src))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl.gz"]


def test_cli_preprocess(tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t}) for t in DOCS] + ["oops"])
    with pytest.raises(SystemExit) as e:
        main(
            [
                "data",
                "preprocess",
                "--input",
                src,
                "--output-prefix",
                str(tmp_path / "c"),
                "--workers",
                "0",
                "--append-eod",
                "--quiet",
            ]
        )
    assert e.value.code == 0
    captured = capsys.readouterr()
    assert "documents  4" in captured.out and "1 malformed JSON" in captured.out
    assert f"{src}:5: malformed JSON" in captured.err
    with pytest.raises(SystemExit) as e:
        main(
            [
                "data",
                "preprocess",
                "--input",
                src,
                "--output-prefix",
                str(tmp_path / "c"),
                "--workers",
                "0",
                "--on-error",
                "fail",
                "--quiet",
            ]
        )
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and f"{src}:5:" in err
