"""`fitgpt data preprocess`: JSON lines -> .bin/.idx, bad input, and worker-count invariance."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_refusal import assert_refused, files, run_in_process, run_process

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


def _run(tmp_path, src, output="out", **kw):
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    return preprocess(PreprocessConfig(input=src, output_prefix=str(tmp_path / output), **kw))


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
    assert (r.empty, r.replaced_utf8, r.documents, r.lines) == (1, 2, 5, 10)
    assert [s.split(": ")[0] for s in r.shown] == [f"{src}:{n}" for n in (2, 3, 4, 5)]
    assert "no key 'text'" in r.shown[1]
    texts = _texts(r.prefix)
    assert texts[0] == "good one" and texts[-1] == "good two"
    assert texts[1] == "bad \ufffd byte" and "\ufffd" in texts[2]
    summary = r.summary()
    assert "1 malformed JSON" in summary and "1 documents with no tokens (kept" in summary


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
    assert (
        r.skipped["invalid UTF-8"] == 2 and r.replaced_utf8 == 0 and r.documents == 3
    )  # 2 texts, 1 empty


def test_missing_input_and_bad_flags(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        PreprocessConfig(input=str(tmp_path / "nope.jsonl"), output_prefix="x")
    src = _jsonl(tmp_path / "in.jsonl", ['{"text": "a"}'])
    with pytest.raises(UserError, match="negative"):
        PreprocessConfig(input=src, output_prefix="x", workers=-1)
    with pytest.raises(UserError, match="append-eod"):
        _run(tmp_path, src, tokenizer="bytes", append_eod=True)


def _damaged_gzip(path, lines=4000):
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps({"text": f"line {i} " + "x" * 50}) + "\n" for i in range(lines))
    path.write_bytes(path.read_bytes()[:-40])  # cut inside the last deflate block
    return str(path)


def test_damaged_gzip_keeps_the_lines_before_or_fails_in_one_line(tmp_path):
    src = _damaged_gzip(tmp_path / "in.jsonl.gz")
    r = _run(tmp_path, src)  # --on-error skip (the default)
    assert r.skipped == {"damaged gzip stream (rest of file)": 1} and 1000 < r.documents < 4000
    texts = _texts(r.prefix)
    assert texts == [f"line {i} " + "x" * 50 for i in range(r.documents)]  # a clean prefix
    assert r.shown == [f"{src}:{r.documents + 1}: " + r.shown[0].split(": ", 1)[1]]
    assert "gzip stream is damaged" in r.shown[0]
    before = files(tmp_path)
    with pytest.raises(
        UserError, match=f"in.jsonl.gz:{r.documents + 1}: the gzip stream is damaged"
    ):
        _run(tmp_path, src, on_error="fail", json_key="text")
    assert files(tmp_path) == before  # the earlier output untouched, no temporaries


@pytest.mark.parametrize(
    "line, why",
    [
        ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
        ('{"text": "big", "n": ' + "7" * 5000 + "}", "4300 digits"),
    ],
)
def test_valid_but_extreme_json_is_a_line_error(tmp_path, line, why):
    src = _jsonl(tmp_path / "x.jsonl", [json.dumps({"text": "kept"}), line, '{"text": "too"}'])
    r = _run(tmp_path, src)
    assert r.skipped == {"malformed JSON": 1} and _texts(r.prefix) == ["kept", "too"]
    assert r.shown[0].startswith(f"{src}:2: ") and why in r.shown[0]
    with pytest.raises(UserError, match=f"x.jsonl:2: .*{why}.*--on-error skip"):
        _run(tmp_path, src, on_error="fail", output="other")


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


# ---- refusals through the real CLI: exit 2, one line naming the input, nothing left behind ----
def _preprocess_cli(src, out, *extra, **kw):
    return run_process(
        "data", "preprocess", "--input", src, "--output-prefix", out, "--workers", "0", "--quiet",
        *extra, **kw,
    )  # fmt: skip


def test_wrong_json_key_or_empty_input_is_refused(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [json.dumps({"body": t, "id": 1}) for t in DOCS])
    before = files(tmp_path)
    r = _preprocess_cli(src, tmp_path / "o")
    line = assert_refused(r.returncode, r.stderr, src, "no documents", "4 missing key 'text'")
    assert "keys: body, id" in line and "--json-key" in line
    assert files(tmp_path) == before
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(UserError, match=r"empty\.jsonl: no documents in 2 lines"):
        _run(tmp_path, str(tmp_path / "empty.jsonl"))
    assert files(tmp_path) == {"in.jsonl", "empty.jsonl"}


def test_not_gzip_and_other_compressions_are_refused(tmp_path, capsys):
    fake_gz = tmp_path / "in.jsonl.gz"
    fake_gz.write_bytes(b"\x00\x01 not gzip at all\n" * 10)
    xz = tmp_path / "in.jsonl.xz"
    xz.write_bytes(b"\xfd7zXZ\x00" + b"\x00" * 40)
    before = files(tmp_path)
    for src, what in ((fake_gz, "is named .gz but is not gzip"), (xz, "is xz-compressed")):
        argv = ["data", "preprocess", "--input", src, "--output-prefix", tmp_path / "o", "--quiet"]
        code, err = run_in_process(capsys, *argv)
        assert what in assert_refused(code, err, src)
    assert files(tmp_path) == before


def _big_input(path, mb: float) -> str:
    text = stdlib_text(200_000)
    docs = [json.dumps({"text": text[i : i + 2000]}) for i in range(0, len(text), 2000)]
    block = "\n".join(docs) + "\n"
    path.write_text(block * max(1, int(mb * 1e6 / len(block))))
    return str(path)


def test_file_size_limit_during_write_leaves_no_temporaries(tmp_path):
    """A full disk simulated by RLIMIT_FSIZE: the write fails with EFBIG, a real OS error on the
    real write path (the tmpfs test below gives a real ENOSPC where namespaces allow mounts)."""
    import resource

    src = _big_input(tmp_path / "in.jsonl", 0.5)
    out = tmp_path / "out"
    out.mkdir()

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    r = _preprocess_cli(src, out / "c", preexec_fn=limit)
    assert "File too large" in assert_refused(r.returncode, r.stderr, out / "c_text_document")
    assert files(out) == set()


def test_full_tmpfs_leaves_no_temporaries(tmp_path):
    """A real full disk: a 256 KiB tmpfs, mounted in a user+mount namespace (skipped where the
    kernel or container forbids that)."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    src = _big_input(tmp_path / "in.jsonl", 0.5)
    disk, err = tmp_path / "disk", tmp_path / "stderr.txt"
    disk.mkdir()
    script = (
        'mount -t tmpfs -o size=256k tmpfs "$1" || exit 99; shift; '
        '"$@" 2>"$ERR" >/dev/null; echo "rc=$?"; ls -A "$DISK"'
    )
    cmd = [sys.executable, "-m", "fitgpt", "data", "preprocess", "--input", src, "--workers", "0"]
    cmd += ["--output-prefix", str(disk / "c"), "--quiet"]
    env = {**os.environ, "ERR": str(err), "DISK": str(disk)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    r = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", str(disk), *cmd],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    if r.returncode == 99 or "rc=" not in r.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[:200]}")
    rc, *left = r.stdout.split()
    line = assert_refused(int(rc.removeprefix("rc=")), err.read_text(), disk / "c_text_document")
    assert "No space left on device" in line and left == []


def _children(pid: int) -> dict[int, str]:
    """{pid: command line} of the live (not zombie) children of `pid`, from /proc."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(stat.parent.name)] = _cmdline(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_the_parent_is_killed(tmp_path):
    src = _big_input(tmp_path / "in.jsonl", 40)  # ~10 s of tokenizing: the parent is busy
    cmd = [sys.executable, "-m", "fitgpt", "data", "preprocess", "--input", src, "--quiet"]
    cmd += ["--output-prefix", str(tmp_path / "o"), "--workers", "2"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parent = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 90
        workers: dict[int, str] = {}
        while time.monotonic() < deadline and parent.poll() is None:
            kids = _children(parent.pid)
            workers = {p: c for p, c in kids.items() if "spawn_main" in c}
            if len(workers) == 2:
                break
            time.sleep(0.2)
        assert len(workers) == 2, f"workers never started (exit {parent.poll()})"
        kids = _children(parent.pid)  # the workers and multiprocessing's resource tracker
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(map(_alive, kids)):
            time.sleep(0.1)
        assert not [c for p, c in kids.items() if _alive(p)], "children outlived the parent"
    finally:  # on failure, leave no stray process behind
        parent.kill()
        for p, c in kids.items():  # only if still the same program (pids are reused)
            if _alive(p) and _cmdline(p) == c:
                os.kill(p, signal.SIGKILL)


# ---- empty documents, kept as Megatron-LM keeps them --------------------------------------------
def _megatron_idx(doc_tokens: list[list[int]], code: int = 8) -> bytes:
    """The .idx Megatron-LM's preprocess_data.py writes for these documents (uint16 tokens),
    spelled out from its IndexedDatasetBuilder: a document with tokens adds one sequence, an
    empty one adds none, and every document appends the sequence count to document_indices."""
    lengths = [len(d) for d in doc_tokens if d]
    pointers = [2 * sum(lengths[:i]) for i in range(len(lengths))]
    doc_idx, n = [0], 0
    for d in doc_tokens:
        n += 1 if d else 0
        doc_idx.append(n)
    head = b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([code])
    head += len(lengths).to_bytes(8, "little") + len(doc_idx).to_bytes(8, "little")
    body = np.array(lengths, np.int32).tobytes() + np.array(pointers, np.int64).tobytes()
    return head + body + np.array(doc_idx, np.int64).tobytes()


@pytest.mark.parametrize("eod", [False, True])
def test_empty_documents_are_kept_byte_identical_to_megatron(tmp_path, eod):
    """`{"text": ""}` is a document of no sequence in Megatron's .idx (its document-index entry
    repeats the one before), and gets no <|endoftext|> under --append-eod; the chunk boundary
    falls between documents, so an empty one first in a chunk is covered too."""
    texts = ["", "Hello world", "", "", "naïve", ""]
    src = _jsonl(tmp_path / "e.jsonl", [json.dumps({"text": t}) for t in texts])
    r = _run(tmp_path, src, append_eod=eod, chunk_bytes=20)
    tok = load_tokenizer("gpt2")
    docs = [tok.encode(t) + ([tok.eod_id] if eod and t else []) for t in texts]
    assert Path(r.prefix + ".idx").read_bytes() == _megatron_idx(docs)
    assert (
        Path(r.prefix + ".bin").read_bytes()
        == np.array([t for d in docs for t in d], np.uint16).tobytes()
    )
    d = IndexedDataset(r.prefix)
    assert d.doc_idx.tolist() == [0, 0, 1, 1, 1, 2, 2] and d.num_sequences == 2
    assert (r.documents, r.empty) == (6, 4) and "4 documents with no tokens" in r.summary()


def test_empty_documents_train_inspect_and_clean(tmp_path, capsys):
    """The loaders sample sequences, so documents of no sequence are invisible to them; inspect
    and clean walk documents and carry them through."""
    from fitgpt.data.gpt_dataset import open_megatron_split

    texts = [""] + [f"document {i} " * 6 for i in range(12)] + [""]
    src = _jsonl(tmp_path / "e.jsonl", [json.dumps({"text": t}) for t in texts])
    r = _run(tmp_path, src, tokenizer="bytes")
    stream = set(Path(r.prefix + ".bin").read_bytes())
    for order in ("fitgpt", "megatron"):
        ds = open_megatron_split(r.prefix, "1,0,0", "train", 16, 0, sample_order=order)
        rows = ds.get(np.arange(20))
        assert rows.shape == (20, 17) and set(rows.ravel().tolist()) <= stream
    with pytest.raises(SystemExit) as e:
        main(["data", "inspect", r.prefix, "--tokenizer", "bytes", "--docs", "2"])
    assert e.value.code in (0, None) and "14 (12 sequences)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["data", "clean", "--input", r.prefix, "--output-prefix", str(tmp_path / "c")])
    assert e.value.code in (0, None)
    assert IndexedDataset(str(tmp_path / "c")).num_sequences == 12


def test_only_empty_documents_is_refused(tmp_path):
    src = _jsonl(tmp_path / "e.jsonl", [json.dumps({"text": ""})] * 3)
    with pytest.raises(UserError, match=r"e\.jsonl: no tokens in 3 lines \(3 empty documents\)"):
        _run(tmp_path, src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.jsonl"]
