"""A new user's first fine-tune, from the README's "Fine-tune your model" on the CPU: the
mistakes met on the way are one line naming the input and the fix, before any work, leaving no
output. Found by following the README with tiny Llama folders made by transformers:

- Ctrl-C during `fitgpt data preprocess` printed `fitgpt data: ` and nothing else (Ctrl-C's
  KeyboardInterrupt has no text), and during the start of any command (torch's import, 1-3 s)
  a traceback;
- every piped data command wrote a blank line to stderr (rich's erased bar), so a refusal was
  not the one line on stderr;
- `train --init-from FOLDER --seq-len N` past the folder's max_position_embeddings trained
  without a word, on positions the weights never saw, and exported a config claiming less;
- `--data PREFIX` with the --output-prefix given to preprocess (which writes
  PREFIX_chat_document) said only that PREFIX.bin/.idx does not exist."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_refusal import assert_refused, files, run_in_process
from helpers import tiny_llama_folder
from tokenizer_folders import llama3

import fitgpt

ROOT = Path(fitgpt.__file__).resolve().parents[1]  # the tree under test


def chats(path: Path, n: int) -> Path:
    """`n` conversations as the README's JSON lines."""
    line = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                         {"role": "assistant", "content": "Paris is. " * 3}]}  # fmt: skip
    path.write_text((json.dumps(line) + "\n") * n)
    return path


def shell_signals() -> None:
    """In the child: SIGINT at its default, as an interactive shell starts a command (a
    background job of a script would inherit it ignored)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted(argv: list, ready, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m fitgpt ARGV`, Ctrl-C'd (SIGINT) as soon as `ready(pid)` is true."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fitgpt", *map(str, argv)], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=shell_signals,
    )  # fmt: skip
    deadline = time.time() + timeout
    while proc.poll() is None and not ready(proc.pid) and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()  # still running when it is interrupted
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_one_stop_line(done: subprocess.CompletedProcess, name: str) -> None:
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"{name}: ") and "SIGINT" in lines[0], lines[0]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_ctrl_c_while_fitgpt_starts_is_one_line():
    """Interrupted while torch loads (before any command runs): one line, exit 130."""

    def loading_torch(pid: int) -> bool:
        try:
            return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False

    done = interrupted(["presets"], loading_torch)
    assert_one_stop_line(done, "fitgpt")


def test_ctrl_c_during_preprocess_is_one_line_and_leaves_no_file(tmp_path):
    """Interrupted while it tokenizes (its temporaries exist): one line saying so, and no file
    of the output left."""
    tok = llama3(tmp_path / "tok")
    src = chats(tmp_path / "chats.jsonl", 40_000)  # ~4 s of tokenizing: interrupted early
    out = tmp_path / "data"
    out.mkdir()
    argv = ["data", "preprocess", "--chat", "--input", src, "--tokenizer", tok]
    argv += ["--output-prefix", out / "chats", "--workers", "0"]
    done = interrupted(argv, lambda pid: bool(files(out)))
    assert_one_stop_line(done, "fitgpt data")
    assert not files(out)


def test_a_piped_refusal_of_a_data_command_is_its_one_line(tmp_path, capsys):
    """stderr not a terminal (a pipe, a log, CI): no bar is drawn, so none is erased with a
    blank line; the refusal is all of stderr."""
    tok = llama3(tmp_path / "tok")
    src = chats(tmp_path / "chats.jsonl", 3)
    src.write_text(src.read_text() + '{"messages": [\n')
    argv = ["data", "preprocess", "--chat", "--input", src, "--tokenizer", tok]
    code, err = run_in_process(capsys, *argv, "--output-prefix", tmp_path / "c", "--workers", "0")
    assert_refused(code, err, f"{src}:4", "malformed JSON")
    assert err.startswith("fitgpt data: error: "), repr(err)


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A tiny Llama folder (max_position_embeddings 64) with a chat tokenizer, and a fitgpt run
    fine-tuned from it for one step at 32 tokens."""
    from fitgpt.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("first_run")
    tok = load_tokenizer(str(llama3(root / "tok")))
    folder = tiny_llama_folder(root, tok.vocab_size)
    llama3(folder)
    run = root / "run"
    argv = ["train", "--init-from", folder, "--data", "synthetic", "--seq-len", "32",
            "--micro-batch", "1", "--grad-accum", "1", "--steps", "1", "--device", "cpu",
            "--save-optimizer", "none", "--out", run]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "fitgpt", *map(str, argv)], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {"folder": folder, "run": run, "root": root}


@pytest.mark.parametrize("source", ["folder", "run"])
def test_seq_len_past_the_models_context_is_refused_before_any_work(
    llama_run, source, tmp_path, capsys
):
    """--seq-len past max_position_embeddings (64), from the folder or from a run fine-tuned
    from it: one line naming both and the longest allowed, no run folder made; at 64 it is
    taken."""
    from fitgpt.data.config import DataConfig
    from fitgpt.interop.init_source import find_source
    from fitgpt.train.init_from import model_from_source

    src = llama_run[source]
    argv = ["train", "--init-from", src, "--data", "synthetic", "--seq-len", "65",
            "--device", "cpu", "--steps", "1", "--out", tmp_path / "run"]  # fmt: skip
    code, err = run_in_process(capsys, *argv)
    line = assert_refused(code, err, "--seq-len 65", str(src), "max_position_embeddings")
    assert "--seq-len 64 or less" in line
    assert not (tmp_path / "run").exists()
    opened = find_source(str(src))
    assert model_from_source(opened, {"seq_len": 64}, DataConfig(data="synthetic")).seq_len == 64


def test_a_yarn_scaled_folder_s_context_is_the_stretched_one(llama_run, tmp_path, capsys):
    """Qwen2.5's long-context recipe: YaRN (factor 4 over the 64 positions) added to the
    config, max_position_embeddings left at 64, as transformers reads it: --seq-len up to 256
    is taken, past it refused naming 256."""
    import shutil

    from fitgpt.data.config import DataConfig
    from fitgpt.interop.init_source import find_source
    from fitgpt.train.init_from import model_from_source

    folder = tmp_path / "yarn"
    shutil.copytree(llama_run["folder"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 64}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    opened, data = find_source(str(folder)), DataConfig(data="synthetic")
    assert model_from_source(opened, {"seq_len": 256}, data).seq_len == 256
    argv = ["train", "--init-from", folder, "--data", "synthetic", "--seq-len", "257",
            "--device", "cpu", "--steps", "1", "--out", tmp_path / "run"]  # fmt: skip
    code, err = run_in_process(capsys, *argv)
    assert "--seq-len 256 or less" in assert_refused(code, err, "--seq-len 257", str(folder))


def test_data_named_by_the_preprocess_prefix_names_the_file_it_wrote(llama_run, tmp_path, capsys):
    """`--data data/chats` after `preprocess --output-prefix data/chats`: the line names
    data/chats_chat_document, the --data to pass."""
    src = chats(tmp_path / "chats.jsonl", 4)
    prefix = tmp_path / "data" / "chats"
    argv = ["data", "preprocess", "--chat", "--input", src, "--tokenizer", llama_run["folder"]]
    code, _ = run_in_process(capsys, *argv, "--output-prefix", prefix, "--workers", "0")
    assert code in (0, None)
    argv = ["train", "--init-from", llama_run["folder"], "--data", prefix, "--seq-len", "32",
            "--device", "cpu", "--steps", "1", "--out", tmp_path / "run"]  # fmt: skip
    code, err = run_in_process(capsys, *argv)
    assert_refused(code, err, f"--data {prefix}", f"--data {prefix}_chat_document")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train", "export", "import"])
def test_overwrite_of_a_folder_of_other_files_is_refused_and_deletes_nothing(
    llama_run, command, tmp_path, capsys
):
    """`--out . --overwrite` from a project folder (or a typo naming one's own folder):
    --overwrite empties or replaces --out, so a folder of other files is refused in one line
    and keeps them; a folder the command wrote is still replaced."""
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "src").mkdir()
    before = files(mine)
    folder, run = llama_run["folder"], llama_run["run"]
    argv, own = {
        "train": (["train", "--init-from", folder, "--data", "synthetic", "--seq-len", "32",
                   "--device", "cpu", "--steps", "1", "--save-optimizer", "none"], run),
        "export": (["export", "--ckpt", run, "--format", "hf"], llama_run["root"] / "export"),
        "import": (["import", "hf", folder], llama_run["root"] / "import"),
    }[command]  # fmt: skip
    code, err = run_in_process(capsys, *argv, "--out", mine, "--overwrite")
    assert_refused(code, err, f"--out {mine}", "notes.txt", "--overwrite")
    assert files(mine) == before and (mine / "src").is_dir()
    for _ in range(2):  # the second replaces what the first wrote
        code, err = run_in_process(capsys, *argv, "--out", own, "--overwrite")
        assert code in (0, None), err[-2000:]


def test_generate_reads_the_source_models_context_as_transformers_does(llama_run, tmp_path, capsys):
    """Fine-tuned at 32 tokens from a folder of 64 positions: a prompt and reply of 50 tokens
    are read whole, as transformers generates with the export (greedy: the same ids), not
    through a sliding window of the last 32; the CLI says nothing about a context."""
    import torch
    import transformers
    from cli_refusal import run_main

    from fitgpt.infer.generate import (
        SampleConfig,
        checkpoint_meta,
        generate,
        generation_context,
        load_model,
    )
    from fitgpt.interop.hf_export import export_hf

    run = llama_run["run"]
    cfg = checkpoint_meta(run)[2]
    assert (cfg.seq_len, generation_context(cfg)) == (32, 64)
    model, _ = load_model(run, torch.device("cpu"), None, generation_context(cfg))
    x = torch.randint(0, 200, (1, 10), generator=torch.Generator().manual_seed(0))
    sample = SampleConfig(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    ours = generate(model, x, sample, note=pytest.fail)[0, 10:].tolist()
    export_hf(run, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    theirs = hf.generate(x, do_sample=False, max_new_tokens=40, min_new_tokens=40,
                         eos_token_id=None, pad_token_id=0)[0, 10:].tolist()  # fmt: skip
    assert ours == theirs
    code, _, err = run_main(capsys, "generate", "--ckpt", run, "--prompt", "Hello world",
                            "--max-new-tokens", "40", "--temperature", "0",
                            "--tokenizer", llama_run["folder"])  # fmt: skip
    assert code == 0 and "context" not in err, err


def test_presets_table_columns_line_up(capsys):
    """`fitgpt presets`: every number ends under its column's name, for every family's preset
    (qwen3_moe's name and a 405 B count outgrew fixed widths and shifted their rows)."""
    from cli_refusal import run_main

    code, out, _ = run_main(capsys, "presets")
    head, *rows = [x for x in out.splitlines() if x and not x.startswith(("*", "Parameter"))]
    assert code == 0 and len(rows) > 10
    for col in ("layers", "hidden", "heads", "seq", "params"):
        end = head.index(col) + len(col)
        for row in rows:
            assert row[end - 1].isdigit() and row[end] == " ", (col, row)
    starts = {row.index(row.split()[1], len(row.split()[0])) for row in rows}
    assert starts == {head.index("family")}  # the family names start under theirs


@pytest.mark.parametrize("chat", [True, False])
def test_a_file_with_a_bom_gives_what_it_gives_without(chat, tmp_path, capsys):
    """A UTF-8 BOM before the first line (Notepad, Excel, PowerShell's Out-File): the same
    files, byte for byte, as without it, for conversations and for plain text lines."""
    tok = llama3(tmp_path / "tok")
    plain = chats(tmp_path / "plain.jsonl", 3)
    if not chat:
        plain.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b", "c", "d e f"]))
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    made = {}
    for src in (plain, marked):
        out = tmp_path / src.stem
        argv = ["data", "preprocess", *(["--chat"] if chat else []), "--input", src]
        argv += ["--tokenizer", tok, "--output-prefix", out / "d", "--workers", "0"]
        code, err = run_in_process(capsys, *argv)
        assert code in (0, None), err
        made[src] = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".bin", ".idx")}
    assert made[plain] == made[marked] and len(made[plain]) == (4 if chat else 2)


@pytest.mark.parametrize("indent", [None, 2])
def test_a_conversation_file_saved_as_one_json_array_is_named_so(indent, tmp_path, capsys):
    """`json.dump(rows, f)` (one line, or pretty-printed): one line saying it is an array, not
    JSON lines, and how to convert it; nothing written."""
    rows = [json.loads(x) for x in chats(tmp_path / "c.jsonl", 2).read_text().splitlines()]
    src = tmp_path / "chats.json"
    src.write_text(json.dumps(rows, indent=indent))
    out = tmp_path / "data"
    argv = ["data", "preprocess", "--chat", "--input", src, "--tokenizer", llama3(tmp_path / "t")]
    code, err = run_in_process(capsys, *argv, "--output-prefix", out / "c", "--workers", "0")
    assert_refused(code, err, f"{src}:1", "JSON array", "one conversation a line")
    assert not out.exists() or not files(out)


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_data_named_by_a_file_of_the_pair_names_its_prefix(llama_run, suffix, tmp_path, capsys):
    """`--data data/chats_chat_document.bin` (tab completion gives a file): the line names the
    prefix to pass, for train and for the data tools."""
    src = chats(tmp_path / "chats.jsonl", 4)
    prefix = tmp_path / "chats"
    argv = ["data", "preprocess", "--chat", "--input", src, "--tokenizer", llama_run["folder"]]
    code, _ = run_in_process(capsys, *argv, "--output-prefix", prefix, "--workers", "0")
    assert code in (0, None)
    named = f"{prefix}_chat_document{suffix}"
    argv = ["train", "--init-from", llama_run["folder"], "--data", named, "--seq-len", "32",
            "--device", "cpu", "--steps", "1", "--out", tmp_path / "run"]  # fmt: skip
    code, err = run_in_process(capsys, *argv)
    assert_refused(code, err, f"--data {named}", f"its prefix, {prefix}_chat_document ")
    code, err = run_in_process(capsys, "data", "inspect", named)
    assert_refused(code, err, named, f"its prefix, {prefix}_chat_document ")
    assert not (tmp_path / "run").exists()


def test_exported_files_are_readable_as_the_umask_says(llama_run, tmp_path, capsys):
    """An export is for others to serve: every file the hf and fitgpt formats write has the
    mode the umask gives new files (safetensors creates its own 0600)."""
    run = llama_run["run"]
    before = os.umask(0o027)  # a stricter umask than the default, so the mode is the umask's
    try:
        for argv, out in (
            (["--format", "hf"], tmp_path / "hf"),
            (["--format", "fitgpt"], tmp_path / "m.safetensors"),
        ):
            code, err = run_in_process(capsys, "export", "--ckpt", run, *argv, "--out", out)
            assert code == 0, err
            written = [p for p in [out, *out.rglob("*")] if p.is_file()]
            assert written and {p.stat().st_mode & 0o777 for p in written} == {0o640}, written
    finally:
        os.umask(before)
