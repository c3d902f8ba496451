"""What a run or an export must never do to what the user keeps (issue 48, items 4, 5, 6, 14):
train another model on `--resume`, write into or delete a run or the model folder it came from,
export an end of sequence that generation runs past, check --init-from's model flags against
another family, take an empty --preset for the default, or name a disk that is not the full one.

The models are transformers models with random weights saved by save_pretrained, the
tokenizers real folders (tokenizer_folders.py), the runs real `fitgpt` processes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizer_folders as tf
import torch
from cli_refusal import assert_refused, files, run_in_process

import fitgpt

transformers = pytest.importorskip("transformers")

# the fitgpt under test (this tree, or another one on PYTHONPATH): the processes run the same
ROOT = str(Path(fitgpt.__file__).resolve().parents[1])
TINY = (
    "--device", "cpu", "--eval-every", "0", "--log-every", "1", "--cpu-threads", "1",
    "--micro-batch", "2",
)  # fmt: skip


def fitgpt_process(*argv, env: dict | None = None, **kw):
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    cmd = [sys.executable, "-m", "fitgpt", *map(str, argv)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, **kw)


def qwen_folder(folder: Path, layers: int = 2) -> Path:
    """A Qwen 2.5-shaped base model: Qwen's tokenizer files (its chat template ends a turn with
    <|im_end|>) and a random Qwen2ForCausalLM whose config, as Qwen2.5's base model's, names
    <|endoftext|> as bos and eos."""
    from tokenizers import Tokenizer

    tf.qwen(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    cfg = transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=tok.get_vocab_size(), max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=eot, eos_token_id=eot,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    """Built once; every test copies it (`hf`) before pointing a command at it."""
    return qwen_folder(tmp_path_factory.mktemp("qwen") / "hf")


@pytest.fixture
def hf(qwen, tmp_path) -> Path:
    shutil.copytree(qwen, tmp_path / "hf")
    return tmp_path / "hf"


def losses(stdout: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"step +(\d+) \| loss (\S+)", stdout)}


def run_until_step(argv: list, step: int, tmp: Path) -> str:
    """Start `fitgpt ARGV`, which hangs before step `step` + 1 (FITGPT_FAULT), and kill it with
    SIGKILL once it has logged `step`: a run killed before its first checkpoint. Its output."""
    env = {**os.environ, "PYTHONPATH": ROOT, "FITGPT_FAULT": f"0:{step}:hang"}
    cmd = [sys.executable, "-m", "fitgpt", *map(str, argv)]
    log = tmp / "killed.log"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for _ in range(1200):
            if p.poll() is not None or re.search(rf"step +{step} \|", log.read_text()):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=0.1)
        assert p.poll() is None, log.read_text()  # still running: hung before the next step
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    return log.read_text()


# ---- 4: --resume of a run killed before its first checkpoint ----------------------------------
def test_resume_restarts_the_init_from_run_killed_before_its_first_checkpoint(hf, tmp_path):
    run = tmp_path / "run"
    argv = ["train", "--init-from", hf, "--out", run, "--data", "synthetic", "--steps", "4"]
    first = run_until_step([*argv, *TINY, "--seq-len", "16"], 2, tmp_path)
    assert not list(run.glob("step_*")), first
    # a restart loop: `--resume` alone, killed again (an abrupt exit in its first step), ...
    resume = ("train", "--resume", "--out", run, "--steps", "4")
    again = fitgpt_process(*resume, env={"FITGPT_FAULT": "0:1:die"})
    assert again.returncode == 17 and not list(run.glob("step_*")), again.stderr[-2000:]
    # ... and once more: the same run (its model, data and settings) from step 0
    r = fitgpt_process(*resume)
    assert r.returncode == 0, r.stderr[-2000:]
    assert losses(r.stdout) == {**losses(first), **losses(r.stdout)}  # the same first steps
    assert sorted(losses(r.stdout)) == [1, 2, 3, 4]
    meta = json.loads((run / "step_00000004" / "meta.json").read_text())
    ref = transformers.AutoConfig.from_pretrained(hf)
    model = meta["config"]["model"]
    assert meta["init_from"] == str(hf) and meta["config"]["train"]["finetune"]
    assert (model["family"], model["n_layer"], model["n_embd"]) == ("qwen2", 2, ref.hidden_size)
    assert (model["vocab_size"], model["n_kv_head"]) == (ref.vocab_size, 2)
    assert model["ffn_hidden"] == ref.intermediate_size and meta["config"]["model"]["qkv_bias"]
    assert "run.json records the run" in r.stdout
    assert not (run / "run.json").exists()  # the checkpoint says what the run is now


def test_resume_refuses_a_recorded_source_that_holds_another_model_now(
    hf, tmp_path, capsys, monkeypatch
):
    """A run that failed in its first step (after recording itself) whose --init-from folder
    was replaced since: `--resume` is refused in one line, not trained on the other model."""
    from helpers import run_config, train

    from fitgpt.dist import DistContext
    from fitgpt.interop.init_source import find_source
    from fitgpt.train.init_from import model_from_source

    source = find_source(str(hf))
    run = run_config(tmp_path / "run", steps=3, micro_batch=2)
    run = dataclasses.replace(run, model=model_from_source(source, {"seq_len": 16}, run.data))
    monkeypatch.setenv("FITGPT_FAULT", "0:1:error")
    with pytest.raises(RuntimeError, match="injected fault"):
        train(run, DistContext(0, 1, 0, torch.device("cpu")), init_from=source)
    monkeypatch.delenv("FITGPT_FAULT")
    shutil.rmtree(hf)
    qwen_folder(hf, layers=3)
    before = files(tmp_path)
    code, err = run_in_process(capsys, "train", "--resume", "--out", tmp_path / "run")
    assert_refused(code, err, str(tmp_path / "run" / "run.json"), str(hf), "another model")
    assert files(tmp_path) == before


def test_resume_of_a_run_that_failed_before_its_first_checkpoint_takes_its_preset_and_data(
    tmp_path, monkeypatch
):
    """No --init-from: a tiny-llama run on synthetic data that failed in its first step (after
    recording itself) is resumed as that run, not as the default preset on the default data."""
    from fitgpt.cli import build_parser
    from fitgpt.cli.train import asked_by

    argv = ["train", "--preset", "tiny-llama", "--data", "synthetic", "--vocab-size", "64",
            "--seq-len", "16", "--steps", "3", "--out", str(tmp_path / "run"), *TINY]  # fmt: skip
    monkeypatch.setenv("FITGPT_FAULT", "0:1:error")
    with pytest.raises(RuntimeError, match="injected fault"):
        build_parser().parse_args(argv).func(build_parser().parse_args(argv))
    monkeypatch.delenv("FITGPT_FAULT")
    args = build_parser().parse_args(["train", "--resume", "--out", str(tmp_path / "run")])
    settings = asked_by(args)
    run, notes = settings.config, settings.notes
    assert (run.model.family, run.model.vocab_size, run.model.seq_len) == ("llama", 64, 16)
    assert (run.data.data, run.train.steps, settings.resume) == ("synthetic", 3, "")
    assert "records the run (from scratch)" in notes[0]


def test_resume_of_a_resumed_run_killed_before_its_first_checkpoint_resumes_it_again(hf, tmp_path):
    """--resume CKPT --out NEW killed before NEW's first checkpoint: `--resume --out NEW`
    continues from CKPT again (an imported model's step 0 here), not from a fresh model."""
    from fitgpt.interop.hf_import import import_hf

    imported = import_hf(hf, tmp_path / "imported").ckpt
    new = tmp_path / "new"
    r = fitgpt_process(
        "train", "--resume", imported, "--out", new, "--steps", "3", *TINY,
        env={"FITGPT_FAULT": "0:1:die"},
    )  # fmt: skip
    assert r.returncode == 17 and not list(new.glob("step_*")), r.stderr[-2000:]
    r = fitgpt_process("train", "--resume", "--out", new, "--steps", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from {imported}" in r.stdout
    meta = json.loads((new / "step_00000003" / "meta.json").read_text())
    assert meta["config"]["model"]["family"] == "qwen2"


# ---- 5: nothing the user keeps is written into or deleted -------------------------------------
EXPORT_OUTS = [
    "run", "run/", "link", "link/", ".", "x/..", "run/step_00000000", "run/hf", "hf", "hf/out",
]  # fmt: skip


@pytest.mark.parametrize("out", EXPORT_OUTS)
def test_export_never_writes_into_the_run_it_reads_or_the_model_it_came_from(
    hf, tmp_path, monkeypatch, capsys, out
):
    from fitgpt.interop.hf_import import import_hf

    import_hf(hf, tmp_path / "run")
    os.symlink(tmp_path / "run", tmp_path / "link")
    (tmp_path / "x").mkdir()
    monkeypatch.chdir(tmp_path)
    before = files(tmp_path)
    for fmt in ("hf", "fitgpt"):
        if fmt == "fitgpt" and out in (".", "x/.."):  # its file lies beside the run: allowed
            continue
        target = out if fmt == "hf" else os.path.join(out, "w.safetensors")
        code, err = run_in_process(
            capsys, "export", "--ckpt", "run", "--format", fmt, "--out", target, "--overwrite"
        )
        assert_refused(code, err, f"--out {target.rstrip('/')}", "choose an --out apart")
        assert files(tmp_path) == before


def test_export_beside_the_run_still_works(hf, tmp_path):
    from fitgpt.interop.hf_export import export_hf
    from fitgpt.interop.hf_import import import_hf

    import_hf(hf, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "run-hf")  # a name that starts like the run's
    export_hf(tmp_path / "run", tmp_path / "run-hf", overwrite=True)
    assert (tmp_path / "run-hf" / "model.safetensors").is_file()


TRAIN_OUTS = [
    ("hf", "hf"), ("hf", "hf/"), ("hf/", "hf/run"), ("hf", "."), ("hf", "hflink"),
    ("hf/model.safetensors", "hf"), ("run", "run/ft"), ("run", "hf"),
]  # fmt: skip


@pytest.mark.parametrize("source, out", TRAIN_OUTS)
def test_train_out_is_never_the_model_it_starts_from(
    hf, tmp_path, monkeypatch, capsys, source, out
):
    """--out is, lies inside or holds the --init-from source (or the folder a fitgpt source was
    imported from), by any spelling: refused before any work, with --overwrite too."""
    from fitgpt.interop.hf_import import import_hf

    import_hf(hf, tmp_path / "run")
    os.symlink(tmp_path / "hf", tmp_path / "hflink")
    monkeypatch.chdir(tmp_path)
    before = files(tmp_path)
    for extra in ([], ["--overwrite"]):
        code, err = run_in_process(
            capsys, "train", "--init-from", source, "--out", out, "--data", "synthetic",
            "--steps", "1", "--seq-len", "16", *TINY, *extra,
        )  # fmt: skip
        assert_refused(code, err, f"--out {out.rstrip('/')}", "choose an --out apart")
        assert files(tmp_path) == before


@pytest.mark.parametrize("out", ["hf", "hf/", "hf/run", ".", "hflink"])
def test_import_never_replaces_the_model_it_reads(hf, tmp_path, monkeypatch, capsys, out):
    os.symlink(tmp_path / "hf", tmp_path / "hflink")
    monkeypatch.chdir(tmp_path)
    before = files(tmp_path)
    code, err = run_in_process(capsys, "import", "hf", "hf", "--out", out, "--overwrite")
    assert_refused(code, err, "the model it imports", "choose an --out apart")
    assert files(tmp_path) == before


def test_overwrite_never_empties_a_folder_holding_the_data(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _ = run_in_process(
        capsys, "data", "fake", "--output-prefix", "corpus/d", "--vocab", "64", "--tokens", "4000",
        "--doc-len", "100",
    )  # fmt: skip
    assert code == 0
    before = files(tmp_path)
    code, err = run_in_process(
        capsys, "train", "--data", "corpus/d", "--tokenizer", "none", "--vocab-size", "64",
        "--out", "corpus", "--overwrite", "--steps", "1", "--seq-len", "16", *TINY,
    )  # fmt: skip
    assert_refused(code, err, "--out corpus", "the data --data reads")
    assert files(tmp_path) == before


# ---- 6: the export stops where the chat fine-tune learnt to stop ------------------------------
def chat_data(tok: Path, tmp_path: Path, capsys) -> Path:
    lines = [
        {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                      {"role": "assistant", "content": f"It is {2 * i}."}]}
        for i in range(40)
    ]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    prefix = tmp_path / "chat"
    code, err = run_in_process(
        capsys, "data", "preprocess", "--input", tmp_path / "chat.jsonl", "--output-prefix",
        prefix, "--tokenizer", tok, "--chat", "--quiet",
    )  # fmt: skip
    assert code == 0, err
    return Path(f"{prefix}_chat_document")


def export(run: Path, out: Path, capsys) -> None:
    code, err = run_in_process(capsys, "export", "--ckpt", run, "--format", "hf", "--out", out)
    assert code == 0, err


def assert_generate_stops_at_end_of_turn(folder: Path, eot: int) -> None:
    """transformers' generate on the export stops at the template's end of turn: the end of
    turn is forced as the third new token (every eos id barred before it), and generate must
    stop there instead of running to max_new_tokens."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    x = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    n = x.shape[1]

    class ThirdIsEndOfTurn(transformers.LogitsProcessor):
        def __call__(self, ids, scores):
            scores = scores.clone()
            if ids.shape[1] == n + 2:
                scores[:] = -float("inf")
                scores[:, eot] = 0.0
            else:
                scores[:, [*eos, eot]] = -float("inf")
            return scores

    out = model.generate(
        x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
        logits_processor=transformers.LogitsProcessorList([ThirdIsEndOfTurn()]), pad_token_id=eot,
    )  # fmt: skip
    assert out.shape[1] == n + 3 and out[0, -1].item() == eot, (out, eos)
    assert eot in transformers.GenerationConfig.from_pretrained(folder).eos_token_id


def test_export_with_a_tokenizer_save_pretrained_wrote_stops_at_the_end_of_turn(
    hf, tmp_path, capsys
):
    """The data's tokenizer is a folder tokenizer.save_pretrained wrote (no
    generation_config.json) whose eos_token is the end of document, as Qwen2.5's base model
    declares it: only the chat template says that a turn ends at <|im_end|>."""
    auto = transformers.AutoTokenizer.from_pretrained(hf)
    auto.eos_token = "<|endoftext|>"
    auto.save_pretrained(tmp_path / "tok")
    assert not (tmp_path / "tok" / "generation_config.json").exists()
    data = chat_data(tmp_path / "tok", tmp_path, capsys)
    r = fitgpt_process(
        "train", "--init-from", hf, "--data", data, "--out", tmp_path / "run", "--steps", "2",
        "--seq-len", "64", *TINY,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    export(tmp_path / "run", tmp_path / "out", capsys)
    eot = auto.convert_tokens_to_ids("<|im_end|>")
    assert_generate_stops_at_end_of_turn(tmp_path / "out", eot)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert eot in config["eos_token_id"] and auto.eos_token_id in config["eos_token_id"]


def test_export_after_import_and_init_from_the_import_stops_at_the_end_of_turn(
    hf, tmp_path, capsys
):
    """`import hf` → `train --init-from RUN` → export: the import carries the base model's
    generation_config.json (eos: the end of document); the tokenizer declares <|im_end|>."""
    code, err = run_in_process(capsys, "import", "hf", hf, "--out", tmp_path / "imported")
    assert code == 0, err
    data = chat_data(tmp_path / "imported" / "tokenizer", tmp_path, capsys)
    r = fitgpt_process(
        "train", "--init-from", tmp_path / "imported", "--data", data, "--out", tmp_path / "run",
        "--steps", "2", "--seq-len", "64", *TINY,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    export(tmp_path / "run", tmp_path / "out", capsys)
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    assert_generate_stops_at_end_of_turn(tmp_path / "out", tok.eos_token_id)  # <|im_end|>
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    base = transformers.GenerationConfig.from_pretrained(hf)
    assert gen["eos_token_id"][0] == base.eos_token_id  # the model's own first, kept
    assert gen["bos_token_id"] == base.bos_token_id


# ---- 14: flags checked against the source, an empty preset, the disk that is full -------------
@pytest.mark.parametrize(
    "flags, field",
    [
        (["--qkv-bias"], None), (["--ffn-hidden", "64"], None), (["--no-qk-norm"], None),
        (["--qk-norm"], "qk_norm=False"), (["--sliding-window", "8"], "sliding_window=None"),
        (["--ffn-hidden", "96"], "ffn_hidden=64"),
    ],
)  # fmt: skip
def test_init_from_model_flags_are_checked_against_the_source(qwen, flags, field):
    """A Qwen2 source has q/k/v biases and a 64-wide MLP: the flags are the source's family's,
    never the default preset's (GPT-2, which has neither)."""
    from fitgpt.cli import build_parser
    from fitgpt.cli.train import asked_by
    from fitgpt.errors import UserError

    args = build_parser().parse_args(
        ["train", "--init-from", str(qwen), "--data", "synthetic", *flags]
    )
    if field is None:
        model = asked_by(args).config.model
        assert (model.family, model.qkv_bias, model.ffn_hidden) == ("qwen2", True, 64)
        return
    with pytest.raises(UserError) as e:
        asked_by(args)
    assert f"--init-from {qwen}" in str(e.value) and field in str(e.value)
    assert "gpt2" not in str(e.value)


def test_an_empty_preset_is_refused_not_taken_for_the_default(tmp_path, capsys):
    for argv in (
        ["train", "--preset", "", "--out", tmp_path / "run", "--data", "synthetic", "--steps",
         "1", "--seq-len", "16", *TINY],
        ["plan", "--preset", ""],
    ):  # fmt: skip
        code, err = run_in_process(capsys, *argv)
        assert_refused(code, err, "preset ''")
    assert not (tmp_path / "run").exists()


def test_a_disk_filling_during_export_is_named_as_the_output_s(hf, tmp_path):
    """--out on a 512 KiB tmpfs (mounted in a user namespace of its own): the weights fit, the
    tokenizer's 2 MB chat template does not. The copy's error names its source file first;
    the line must name --out and its disk's free space, not the source's."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a small disk")
    from fitgpt.interop.hf_import import import_hf

    import_hf(hf, tmp_path / "run")
    big = tmp_path / "run" / "tokenizer" / "chat_template.jinja"
    big.write_text("{#- " + "x" * 2_000_000 + " -#}")
    (tmp_path / "small").mkdir()
    mount = f"mount -t tmpfs -o size=512k tmpfs {tmp_path / 'small'}"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", mount], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({probe.stderr.decode()[:80]})")
    out = tmp_path / "small" / "exp"
    cmd = f"{mount} && exec {sys.executable} -m fitgpt export --ckpt {tmp_path / 'run'} " + (
        f"--format hf --out {out}"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, env=env)
    line = assert_refused(r.returncode, r.stderr, f"--out {out}", "no space left")
    assert str(big) not in line and "GB free" not in line, line  # the tmpfs has KB, not GB
