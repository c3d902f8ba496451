"""Every subcommand, fed bad input, fails the same way: a non-zero exit, exactly one line on
stderr that names the input, no traceback, and no file left behind.

One row per case, each its own test id. The cases run in this process through
`fitgpt.cli.main` (a SystemExit carries the exit code), against real files: a tiny trained run,
a .bin/.idx pair, a trained tokenizer, made once per module. Paths in the argv are templates:

  {t}     this case's own empty folder (the working directory too)
  {file}  a regular file in it            {dir}   a folder in it
  {empty} an empty file in it             {ro}    a folder this process cannot write in
  {run}   the trained run folder          {data}  the .bin/.idx prefix it trained on
  {tok}   a trained BPE tokenizer folder  {jsonl} a JSON-lines file with a "text" key
  {text}  a text file                     {sweep} a sweep results file with one ok trial
  {npy}   a 4x4 .npy matrix               {gdata} a .bin/.idx prefix made with the gpt2 tokenizer

A case whose fix belongs to another part of the work carries its owner; while that owner's
work is not merged, the case is expected to fail (strict: it fails once it passes, so the
owner is then removed from PENDING_OWNERS).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hf_bad_inputs import broken as hf_broken
from hf_bad_inputs import broken_llama

from fitgpt.cli import main

# Owners whose fixes are not on this branch yet: their cases are xfail(strict=True). The lead
# empties this set as each branch is merged.
PENDING_OWNERS: set[str] = set()

# A tiny, valid training command: each train case breaks one thing in it.
TRAIN = (
    "train --preset tiny --layers 2 --hidden 32 --heads 2 --seq-len 16 --steps 2 "
    "--micro-batch 2 --device cpu --plan off --engine ddp --eval-every 0 --log-every 1"
)
TRAIN_SYN = TRAIN + " --data synthetic --vocab-size 64 --no-save"
# The same on the shared .bin/.idx pair (a run must resume with the data it trained on).
TRAIN_DATA = TRAIN + " --data {data} --tokenizer bytes --split 9,1,0"
BENCH = "bench sweep --systems fitgpt --sizes 1 --hidden 32 --heads 2 --seq-len 16 --device cpu"
CAPACITY = "capacity --hidden 32 --heads 2 --seq-len 16 --device cpu"


def unwritable(tmp: Path) -> Path:
    """An existing folder this process cannot write in. chmod does not stop root, so as root:
    /proc, where no file can be created."""
    if os.geteuid() == 0:
        return Path("/proc")
    ro = tmp / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return ro


@dataclass(frozen=True)
class Case:
    id: str
    argv: str  # a template (see the module docstring)
    names: str  # what the error line must contain: the flag or path at fault
    setup: Callable[[dict], None] | None = None  # makes the bad input, given the paths
    code: int = 2
    owner: str | None = None  # the branches whose fixes this case waits for, space-separated
    env: tuple[tuple[str, str], ...] = ()


def run_ok(argv: list[str]) -> None:
    """Run a command that must succeed (the fixtures' set-up)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code in (0, None), argv


# ---- set-up helpers: each makes one kind of bad input in the case's folder ----------------------
def write(rel: str, text: str | bytes) -> Callable[[dict], None]:
    def f(p: dict) -> None:
        path = Path(p["t"]) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())

    return f


def mkdir(rel: str) -> Callable[[dict], None]:
    return lambda p: (Path(p["t"]) / rel).mkdir(parents=True)


def copy_run(rel: str = "run") -> Callable[[dict], None]:
    return lambda p: shutil.copytree(p["run"], Path(p["t"]) / rel)


def chain(*fs: Callable[[dict], None]) -> Callable[[dict], None]:
    def f(p: dict) -> None:
        for g in fs:
            g(p)

    return f


def empty_pair(rel: str) -> Callable[[dict], None]:
    """A .bin/.idx pair of zero bytes each."""
    return chain(write(rel + ".bin", b""), write(rel + ".idx", b""))


def copy_pair(rel: str, idx_bytes: int | None = None) -> Callable[[dict], None]:
    """The shared pair copied to {t}/rel, its .idx cut to `idx_bytes` when given."""

    def f(p: dict) -> None:
        dst = Path(p["t"]) / rel
        shutil.copy(p["data"] + ".bin", str(dst) + ".bin")
        idx = Path(p["data"] + ".idx").read_bytes()
        (Path(str(dst) + ".idx")).write_bytes(idx if idx_bytes is None else idx[:idx_bytes])

    return f


def corrupt_meta(content: bytes) -> Callable[[dict], None]:
    """The shared run copied to {t}/run, every checkpoint's meta.json replaced by `content`."""

    def f(p: dict) -> None:
        copy_run()(p)
        for meta in (Path(p["t"]) / "run").glob("step_*/meta.json"):
            meta.write_bytes(content)

    return f


def fake_pair(rel: str, vocab: int) -> Callable[[dict], None]:
    """A small synthetic .bin/.idx pair at {t}/rel (int32 tokens for a vocabulary over 65536)."""
    argv = ["data", "fake", "--tokens", "1000", "--vocab", str(vocab), "--output-prefix"]
    return lambda p: run_ok([*argv, f"{p['t']}/{rel}"])


def metrics(text: str) -> Callable[[dict], None]:
    return chain(mkdir("r"), write("r/metrics.jsonl", text))


OK_TRIAL = {"system": "fitgpt", "status": "ok", "params": 1000, "layers": 1, "tokens_per_s": 5.0}
OK_WITHOUT_SPEED = {k: v for k, v in OK_TRIAL.items() if k != "tokens_per_s"}
FAILED_TRIAL = {"system": "ddp", "status": "error", "params": 1000, "layers": 1, "reason": "x"}

# ---- the table --------------------------------------------------------------------------------
# fmt: off
CASES: list[Case] = [
    # train: output location
    Case("train-out-is-file", f"{TRAIN_SYN} --out {{file}}", "--out"),
    Case("train-out-under-file", f"{TRAIN_SYN} --out {{file}}/run", "--out"),
    Case("train-out-unwritable", f"{TRAIN_SYN} --out {{ro}}/run", "--out"),
    # train: numbers out of range
    Case("train-steps-0", f"{TRAIN_SYN} --steps 0", "--steps"),
    Case("train-cpu-mem-0", f"{TRAIN_SYN} --cpu-mem 0GB", "--cpu-mem"),
    Case("train-gpu-mem-words", f"{TRAIN_SYN} --gpu-mem lots", "--gpu-mem"),
    # the stated RAM reaches the planner in the run's config (8 GB: 7.5 GiB, no reserve taken)
    Case("train-does-not-fit-stated-ram", "train --device cpu --data synthetic --vocab-size 64 --no-save --preset 40b --cpu-mem 8GB", "host RAM (has 7.5, short by"),
    Case("train-steps-negative", f"{TRAIN_SYN} --steps -3", "--steps"),
    Case("train-profile-negative", f"{TRAIN_SYN} --profile -1", "--profile"),
    Case("train-steps-not-int", f"{TRAIN_SYN} --steps 1.5", "--steps"),
    Case("train-micro-batch-0", f"{TRAIN_SYN} --micro-batch 0", "--micro-batch"),
    Case("train-grad-accum-0", f"{TRAIN_SYN} --grad-accum 0", "--grad-accum"),
    Case("train-tp-not-dividing", f"{TRAIN_SYN} --tensor-parallel 3", "--tensor-parallel 3"),
    Case("train-tp-gpus", f"{TRAIN_SYN} --tensor-parallel 2 --gpus 3", "--tensor-parallel 2"),
    Case("train-tp-negative", f"{TRAIN_SYN} --tensor-parallel -2", "--tensor-parallel"),
    Case("train-tp-auto-unplanned", f"{TRAIN_SYN} --tensor-parallel auto --plan off", "--tensor-parallel auto"),
    Case("train-ep-dense-model", f"{TRAIN_SYN} --expert-parallel 2", "has no experts"),
    Case("train-ep-ddp", f"{TRAIN_SYN} --engine ddp --expert-parallel 2", "--expert-parallel 2"),
    Case("train-ep-auto-unplanned", f"{TRAIN_SYN} --expert-parallel auto --plan off", "--expert-parallel auto"),
    Case("train-sp-without-tp", f"{TRAIN_SYN} --sequence-parallel", "--sequence-parallel"),
    Case("train-lr-0", f"{TRAIN_SYN} --lr 0", "--lr"),
    Case("train-lr-negative", f"{TRAIN_SYN} --lr -1", "--lr"),
    Case("train-min-lr-above-lr", f"{TRAIN_SYN} --lr 0.001 --min-lr 0.01", "--min-lr"),
    Case("train-warmup-negative", f"{TRAIN_SYN} --warmup -1", "--warmup"),
    Case("train-eval-every-negative", f"{TRAIN_SYN} --eval-every -5", "--eval-every"),
    Case("train-save-every-negative", f"{TRAIN_SYN} --save-every -1", "--save-every"),
    Case("train-keep-0", f"{TRAIN_SYN} --keep 0", "--keep"),
    Case("train-log-every-0", f"{TRAIN_SYN} --log-every 0", "--log-every"),
    Case("train-dist-timeout-0", f"{TRAIN_SYN} --dist-timeout 0", "--dist-timeout"),
    Case("train-layers-0", f"{TRAIN_SYN} --layers 0", "layer"),
    Case("train-seq-len-0", f"{TRAIN_SYN} --seq-len 0", "seq"),
    Case("train-vocab-0", f"{TRAIN_SYN} --vocab-size 0", "vocab"),
    Case("train-heads-not-dividing", f"{TRAIN_SYN} --hidden 30 --heads 4", "heads"),
    Case("train-dropout-1", f"{TRAIN_SYN} --dropout 1.0", "dropout"),
    Case("train-beta1-1", f"{TRAIN_SYN} --beta1 1.0", "beta"),
    Case("train-eps-0", f"{TRAIN_SYN} --eps 0", "--eps"),
    Case("train-grad-clip-negative", f"{TRAIN_SYN} --grad-clip -1", "--grad-clip"),
    Case("train-gpus-0", f"{TRAIN_SYN} --gpus 0", "--gpus"),
    Case("train-offload-fraction-2", f"{TRAIN_SYN} --engine zero --offload-fraction 2", "--offload-fraction"),
    Case("train-nvme-fraction-negative", f"{TRAIN_SYN} --engine zero --nvme-fraction -1", "--nvme-fraction"),
    Case("train-zero-stage-5", f"{TRAIN_SYN} --engine zero --zero-stage 5", "--zero-stage"),
    Case("train-growth-interval-0", f"{TRAIN_SYN} --growth-interval 0", "--growth-interval"),
    # train: wrong keys and choices
    Case("train-preset-unknown", f"{TRAIN_SYN} --preset gpt5", "gpt5"),
    Case("train-engine-unknown", f"{TRAIN_SYN} --engine fsdp", "--engine"),
    Case("train-precision-unknown", f"{TRAIN_SYN} --precision fp8", "--precision"),
    Case("train-checkpointing-unknown", f"{TRAIN_SYN} --checkpointing some", "--checkpointing"),
    Case("train-device-unknown", f"{TRAIN_SYN} --device tpu", "--device"),
    Case("train-flag-unknown", f"{TRAIN_SYN} --stepz 3", "--stepz"),
    Case("train-flag-abbreviated", f"{TRAIN_SYN} --micro 3", "--micro"),
    Case("train-ddp-with-stage", f"{TRAIN_SYN} --zero-stage 1", "--engine ddp"),
    Case("train-offload-params-nvme", f"{TRAIN_SYN} --engine zero --offload-params nvme --offload-optimizer nvme --nvme-path {{dir}}", "--offload-params"),
    Case("train-offload-params-alone", f"{TRAIN_SYN} --engine zero --offload-params cpu", "--offload-params"),
    Case("train-delayed-update-removed", f"{TRAIN_SYN} --engine zero --offload-optimizer cpu --delayed-update", "--delayed-update: the one-step-delayed update was removed"),
    Case("train-delayed-update-after-removed", f"{TRAIN_SYN} --delayed-update-after 40", "--delayed-update-after: the one-step-delayed update was removed"),
    Case("train-nvme-without-path", f"{TRAIN_SYN} --engine zero --offload-optimizer nvme", "--nvme-path"),
    # train: data and tokenizer
    Case("train-data-missing", f"{TRAIN} --data {{t}}/nothing --out {{t}}/r", "--data"),
    Case("train-data-empty-pair", f"{TRAIN} --data {{t}}/e --tokenizer bytes --out {{t}}/r", "e.idx", setup=empty_pair("e"), owner="ckpt"),
    Case("train-data-truncated-idx", f"{TRAIN} --data {{t}}/c --tokenizer bytes --out {{t}}/r", "c.idx", setup=copy_pair("c", 40), owner="ckpt"),
    Case("train-data-only-bin", f"{TRAIN} --data {{t}}/b --out {{t}}/r", "--data", setup=write("b.bin", b"\0" * 64)),
    Case("train-tokenizer-unknown", f"{TRAIN_DATA} --tokenizer nonsense --out {{t}}/r", "nonsense", owner="ckpt"),
    Case("train-tokenizer-too-small", f"{TRAIN} --data {{gdata}} --split 9,1,0 --tokenizer bytes --out {{t}}/r", "token", owner="ckpt"),
    Case("train-tokenizer-not-the-datas", f"{TRAIN} --data {{gdata}} --tokenizer bytes --split 9,1,0 --out {{t}}/r", "tokenizer", owner="data11"),
    Case("train-split-malformed", f"{TRAIN} --data {{data}} --tokenizer bytes --split abc --out {{t}}/r", "split", owner="ckpt"),
    # train: resume
    Case("train-resume-other-layers", f"{TRAIN_DATA} --out {{t}}/run --resume --layers 3", "layers", setup=copy_run()),
    Case("train-resume-other-hidden", f"{TRAIN_DATA} --out {{t}}/run --resume --hidden 64", "hidden", setup=copy_run()),
    Case("train-resume-other-data", f"{TRAIN_SYN} --out {{t}}/run --resume", "data", setup=copy_run(), owner="ckpt"),
    Case("train-resume-other-tokenizer", f"{TRAIN_DATA} --tokenizer gpt2 --out {{t}}/run --resume", "tokenizer", setup=copy_run(), owner="ckpt"),
    Case("train-resume-missing-ckpt", f"{TRAIN_SYN} --out {{t}}/r --resume {{t}}/nothing", "nothing", owner="ckpt"),
    Case("train-resume-corrupt-meta", f"{TRAIN_DATA} --out {{t}}/run --resume", "meta", setup=corrupt_meta(b"\xff\xfe{"), owner="ckpt"),
    Case("train-existing-run", f"{TRAIN_DATA} --out {{t}}/run", "--resume", setup=copy_run()),
    # generate
    Case("generate-ckpt-missing", "generate --ckpt {t}/nothing", "--ckpt"),
    Case("generate-ckpt-empty-dir", "generate --ckpt {dir}", "adir"),
    Case("generate-ckpt-is-file", "generate --ckpt {file}", "afile"),
    Case("generate-max-new-0", "generate --ckpt {run} --max-new-tokens 0", "--max-new-tokens"),
    Case("generate-temperature-negative", "generate --ckpt {run} --temperature -1", "--temperature"),
    Case("generate-top-k-negative", "generate --ckpt {run} --top-k -1", "--top-k"),
    Case("generate-top-p-0", "generate --ckpt {run} --top-p 0", "--top-p"),
    Case("generate-top-p-above-1", "generate --ckpt {run} --top-p 1.5", "--top-p"),
    Case("generate-tokenizer-unknown", "generate --ckpt {run} --tokenizer nonsense", "nonsense"),
    Case("generate-tokenizer-mismatch", "generate --ckpt {run} --tokenizer gpt2", "tokenizer", owner="hf"),
    Case("generate-tokenizer-other-bpe", "generate --ckpt {run} --tokenizer {tok}", "tokenizer", owner="hf"),
    Case("generate-device-unknown", "generate --ckpt {run} --device tpu", "--device"),
    Case("generate-missing-ckpt-flag", "generate --prompt hi", "--ckpt"),
    Case("generate-corrupt-meta", "generate --ckpt {t}/run", "meta", setup=corrupt_meta(b"{")),
    # presets
    Case("presets-extra-argument", "presets gpt2", "gpt2"),
    Case("presets-unknown-flag", "presets --layers 2", "--layers"),
    Case("presets-abbreviated-help", "presets --he", "--he"),
    # data preprocess
    Case("preprocess-input-missing", "data preprocess --input {t}/no.jsonl --output-prefix {t}/o --tokenizer bytes", "no.jsonl"),
    Case("preprocess-input-is-dir", "data preprocess --input {dir} --output-prefix {t}/o --tokenizer bytes", "adir"),
    Case("preprocess-input-empty", "data preprocess --input {empty} --output-prefix {t}/o --tokenizer bytes", "empty", owner="data11"),
    Case("preprocess-wrong-key", "data preprocess --input {jsonl} --output-prefix {t}/o --tokenizer bytes --json-key body", "body", owner="data11"),
    Case("preprocess-not-gzip", "data preprocess --input {t}/x.jsonl.gz --output-prefix {t}/o --tokenizer bytes", "x.jsonl.gz", setup=write("x.jsonl.gz", '{"text": "plain"}\n'), owner="data11"),
    Case("preprocess-not-json", "data preprocess --input {text} --output-prefix {t}/o --tokenizer bytes --on-error fail", "text.txt", owner="data11"),
    Case("preprocess-output-under-file", "data preprocess --input {jsonl} --output-prefix {file}/o --tokenizer bytes", "--output-prefix"),
    Case("preprocess-output-unwritable", "data preprocess --input {jsonl} --output-prefix {ro}/o --tokenizer bytes", "--output-prefix"),
    Case("preprocess-output-bin-is-dir", "data preprocess --input {jsonl} --output-prefix {t}/o --tokenizer bytes", "o_text_document.bin", setup=mkdir("o_text_document.bin"), owner="data11"),
    Case("preprocess-output-trailing-slash", "data preprocess --input {jsonl} --output-prefix {dir}/ --tokenizer bytes", "--output-prefix", owner="data11"),
    Case("preprocess-workers-negative", "data preprocess --input {jsonl} --output-prefix {t}/o --tokenizer bytes --workers -2", "--workers"),
    Case("preprocess-tokenizer-unknown", "data preprocess --input {jsonl} --output-prefix {t}/o --tokenizer nonsense", "nonsense"),
    Case("preprocess-tokenizer-missing-dir", "data preprocess --input {jsonl} --output-prefix {t}/o --tokenizer {t}/notok", "notok"),
    Case("preprocess-on-error-unknown", "data preprocess --input {jsonl} --output-prefix {t}/o --on-error ignore", "--on-error"),
    Case("preprocess-missing-input-flag", "data preprocess --output-prefix {t}/o", "--input"),
    # data fake
    Case("fake-tokens-0", "data fake --output-prefix {t}/f --tokens 0 --vocab 64", "--tokens"),
    Case("fake-tokens-negative", "data fake --output-prefix {t}/f --tokens -5 --vocab 64", "--tokens"),
    Case("fake-tokens-not-a-count", "data fake --output-prefix {t}/f --tokens lots --vocab 64", "--tokens"),
    Case("fake-vocab-0", "data fake --output-prefix {t}/f --tokens 1000 --vocab 0", "--vocab"),
    Case("fake-vocab-1", "data fake --output-prefix {t}/f --tokens 1000 --vocab 1", "--vocab"),
    Case("fake-doc-len-0", "data fake --output-prefix {t}/f --tokens 1000 --vocab 64 --doc-len 0", "--doc-len"),
    Case("fake-structure-unknown", "data fake --output-prefix {t}/f --tokens 1000 --structure zipf", "--structure"),
    Case("fake-output-trailing-slash", "data fake --output-prefix {dir}/ --tokens 1000 --vocab 64", "--output-prefix", owner="data11"),
    Case("fake-output-under-file", "data fake --output-prefix {file}/f --tokens 1000 --vocab 64", "--output-prefix"),
    Case("fake-output-unwritable", "data fake --output-prefix {ro}/f --tokens 1000 --vocab 64", "--output-prefix"),
    Case("fake-output-bin-is-dir", "data fake --output-prefix {t}/f --tokens 1000 --vocab 64", "f.bin", setup=mkdir("f.bin"), owner="data11"),
    # data clean
    Case("clean-input-missing", "data clean --input {t}/nothing --output-prefix {t}/o --tokenizer bytes", "nothing"),
    Case("clean-input-empty-pair", "data clean --input {t}/e --output-prefix {t}/o --tokenizer bytes", "e.idx", setup=empty_pair("e")),
    Case("clean-input-truncated-idx", "data clean --input {t}/c --output-prefix {t}/o --tokenizer bytes", "c.idx", setup=copy_pair("c", 40)),
    Case("clean-min-tokens-negative", "data clean --input {data} --output-prefix {t}/o --tokenizer bytes --min-tokens -1", "--min-tokens"),
    Case("clean-tokenizer-unknown", "data clean --input {data} --output-prefix {t}/o --tokenizer nonsense --fix-unicode", "nonsense"),
    Case("clean-wrong-tokenizer", "data clean --input {gdata} --output-prefix {t}/o --tokenizer bytes --fix-unicode", "tokenizer"),
    Case("clean-output-under-file", "data clean --input {data} --output-prefix {file}/o --tokenizer bytes", "--output-prefix"),
    Case("clean-output-unwritable", "data clean --input {data} --output-prefix {ro}/o --tokenizer bytes", "--output-prefix"),
    Case("clean-output-is-input", "data clean --input {t}/c --output-prefix {t}/c --tokenizer bytes", "--output-prefix", setup=copy_pair("c")),
    # data merge
    Case("merge-input-missing", "data merge {data} {t}/nothing --output-prefix {t}/m", "nothing"),
    Case("merge-input-empty-pair", "data merge {data} {t}/e --output-prefix {t}/m", "e.idx", setup=empty_pair("e")),
    Case("merge-dtypes-differ", "data merge {data} {t}/w --output-prefix {t}/m", "--force", setup=fake_pair("w", vocab=70000)),
    Case("merge-output-under-file", "data merge {data} {data} --output-prefix {file}/m", "--output-prefix"),
    Case("merge-output-unwritable", "data merge {data} {data} --output-prefix {ro}/m", "--output-prefix"),
    Case("merge-output-is-input", "data merge {t}/c {data} --output-prefix {t}/c", "--output-prefix", setup=copy_pair("c")),
    Case("merge-no-output-flag", "data merge {data} {data}", "--output-prefix"),
    # data inspect
    Case("inspect-missing", "data inspect {t}/nothing", "nothing"),
    Case("inspect-dir", "data inspect {dir}", "adir"),
    Case("inspect-empty-pair", "data inspect {t}/e", "e.idx", setup=empty_pair("e")),
    Case("inspect-truncated-idx", "data inspect {t}/c --tokenizer bytes", "c.idx", setup=copy_pair("c", 40)),
    Case("inspect-garbage-idx", "data inspect {t}/g --tokenizer bytes", "g.idx", setup=chain(write("g.bin", b"\0" * 64), write("g.idx", b"NOTANIDX" * 8))),
    Case("inspect-docs-negative", "data inspect {data} --tokenizer bytes --docs -1", "--docs", owner="data11"),
    Case("inspect-chars-negative", "data inspect {data} --tokenizer bytes --chars -1", "--chars", owner="data11"),
    Case("inspect-tokenizer-unknown", "data inspect {data} --tokenizer nonsense", "nonsense"),
    Case("inspect-wrong-tokenizer", "data inspect {gdata} --tokenizer bytes", "tokenizer", owner="data11"),
    Case("data-no-subcommand", "data", "data"),
    Case("data-subcommand-unknown", "data shuffle", "shuffle"),
    # tokenizer
    Case("tokenizer-train-input-missing", "tokenizer train --input {t}/no.txt --vocab-size 300 --output {t}/tk", "no.txt"),
    Case("tokenizer-train-input-is-dir", "tokenizer train --input {dir} --vocab-size 300 --output {t}/tk", "adir"),
    Case("tokenizer-train-input-empty", "tokenizer train --input {empty} --vocab-size 300 --output {t}/tk", "empty", owner="data11"),
    Case("tokenizer-train-wrong-key", "tokenizer train --input {jsonl} --vocab-size 300 --output {t}/tk --json-key body", "body", owner="data11"),
    Case("tokenizer-train-vocab-small", "tokenizer train --input {text} --vocab-size 100 --output {t}/tk", "--vocab-size"),
    Case("tokenizer-train-vocab-negative", "tokenizer train --input {text} --vocab-size -1 --output {t}/tk", "--vocab-size"),
    Case("tokenizer-train-min-frequency-0", "tokenizer train --input {text} --vocab-size 300 --output {t}/tk --min-frequency 0", "--min-frequency", owner="data11"),
    Case("tokenizer-train-output-is-file", "tokenizer train --input {text} --vocab-size 300 --output {file}", "--output"),
    Case("tokenizer-train-output-under-file", "tokenizer train --input {text} --vocab-size 300 --output {file}/tk", "--output"),
    Case("tokenizer-train-output-unwritable", "tokenizer train --input {text} --vocab-size 300 --output {ro}/tk", "--output"),
    Case("tokenizer-encode-unknown", "tokenizer encode --tokenizer nonsense hello", "nonsense"),
    Case("tokenizer-encode-missing-dir", "tokenizer encode --tokenizer {t}/notok hello", "notok"),
    Case("tokenizer-encode-dir-without-files", "tokenizer encode --tokenizer {dir} hello", "adir"),
    Case("tokenizer-decode-not-ids", "tokenizer decode --tokenizer bytes abc", "abc"),
    Case("tokenizer-decode-out-of-range", "tokenizer decode --tokenizer bytes 99999", "99999", owner="data11"),
    Case("tokenizer-decode-negative", "tokenizer decode --tokenizer bytes -- -1", "-1", owner="data11"),
    Case("tokenizer-no-subcommand", "tokenizer", "tokenizer"),
    # export
    Case("export-ckpt-missing", "export --ckpt {t}/nothing --out {t}/m.safetensors", "--ckpt"),
    Case("export-ckpt-is-file", "export --ckpt {file} --out {t}/m.safetensors", "afile"),
    Case("export-ckpt-empty-dir", "export --ckpt {dir} --out {t}/m.safetensors", "adir"),
    Case("export-out-is-dir", "export --ckpt {run} --out {dir}", "--out"),
    Case("export-out-under-file", "export --ckpt {run} --out {file}/m.safetensors", "--out"),
    Case("export-out-unwritable", "export --ckpt {run} --out {ro}/m.safetensors", "--out"),
    Case("export-out-trailing-slash", "export --ckpt {run} --out {t}/newdir/", "--out"),
    Case("export-dtype-unknown", "export --ckpt {run} --out {t}/m.safetensors --dtype fp8", "--dtype"),
    Case("export-corrupt-meta", "export --ckpt {t}/run --out {t}/m.safetensors", "meta", setup=corrupt_meta(b"[1, 2")),
    Case("export-no-out-flag", "export --ckpt {run}", "--out"),
    # matmul
    Case("matmul-n-0", "matmul --n 0 --device-mem 1", "--n"),
    Case("matmul-n-negative", "matmul --n -5", "--n"),
    Case("matmul-repeat-0", "matmul --n 8 --repeat 0", "--repeat"),
    Case("matmul-panel-negative", "matmul --n 8 --panel -1", "--panel"),
    Case("matmul-tile-rows-negative", "matmul --n 8 --tile-rows -1", "--tile-rows"),
    Case("matmul-samples-negative", "matmul --n 8 --samples -1", "--samples"),
    Case("matmul-ref-n-below-auto", "matmul --n 8 --ref-n -2", "--ref-n"),
    Case("matmul-host-mem-negative", "matmul --n 8 --host-mem -1", "--host-mem"),
    Case("matmul-device-mem-negative", "matmul --n 8 --device-mem -1", "--device-mem"),
    Case("matmul-device-not-a-flag", "matmul --n 8 --device cpu", "--device"),
    Case("matmul-dtype-unknown", "matmul --n 8 --dtype fp64", "--dtype"),
    Case("matmul-layout-unknown", "matmul --n 8 --layout 3d", "--layout"),
    Case("matmul-a-missing", "matmul --a {t}/a.npy --b {npy}", "--a"),
    Case("matmul-a-not-npy", "matmul --a {file} --b {npy}", "--a"),
    Case("matmul-a-wrong-shape", "matmul --a {t}/r.npy --b {npy}", "--a", setup=lambda p: np.save(Path(p["t"]) / "r.npy", np.zeros((4, 3), np.float32))),
    Case("matmul-out-not-npy", "matmul --n 8 --out {t}/c.txt", "--out"),
    Case("matmul-out-is-dir", "matmul --n 8 --out {t}/c.npy", "--out", setup=mkdir("c.npy")),
    Case("matmul-out-under-file", "matmul --n 8 --out {file}/c.npy", "--out"),
    Case("matmul-out-unwritable", "matmul --n 8 --out {ro}/c.npy", "--out"),
    Case("matmul-json-is-dir", "matmul --n 8 --json {dir}", "--json"),
    Case("matmul-json-under-file", "matmul --n 8 --json {file}/r.json", "--json"),
    Case("matmul-json-unwritable", "matmul --n 8 --json {ro}/r.json", "--json"),
    Case("matmul-gpus-0", "matmul --n 8 --gpus 0", "--gpus"),
    Case("matmul-out-of-core-on-2", "matmul --n 8 --gpus 2 --out-of-core", "--out-of-core"),
    Case("matmul-2d-on-3", "matmul --n 8 --gpus 3 --layout 2d", "3"),
    # plan
    Case("plan-delayed-update-removed", "plan --device cpu --delayed-update", "--delayed-update: the one-step-delayed update was removed"),
    Case("plan-cpu-mem-0", "plan --device cpu --cpu-mem 0GB", "--cpu-mem"),
    Case("plan-cpu-mem-words", "plan --device cpu --cpu-mem lots", "--cpu-mem"),
    Case("plan-cpu-mem-negative", "plan --device cpu --cpu-mem=-4GB", "--cpu-mem"),
    Case("plan-cpu-mem-unit", "plan --device cpu --cpu-mem 4XB", "--cpu-mem"),
    Case("plan-gpu-mem-0", "plan --gpu-mem 0", "--gpu-mem"),
    Case("plan-gpus-0", "plan --device cpu --gpus 0", "--gpus"),
    Case("plan-micro-batch-0", "plan --device cpu --micro-batch 0", "--micro-batch"),
    Case("plan-grad-accum-0", "plan --device cpu --grad-accum 0", "--grad-accum"),
    Case("plan-preset-unknown", "plan --preset gpt5", "gpt5"),
    Case("plan-layers-0", "plan --device cpu --layers 0", "layer"),
    Case("plan-heads-not-dividing", "plan --device cpu --hidden 30 --heads 4", "heads"),
    Case("plan-nvme-missing", "plan --device cpu --nvme {t}/nothing", "--nvme"),
    Case("plan-nvme-is-file", "plan --device cpu --nvme {file}", "--nvme"),
    Case("plan-nvme-0", "plan --device cpu --nvme 0GB", "--nvme"),
    Case("plan-device-unknown", "plan --device tpu", "--device"),
    Case("plan-ddp-with-stage", "plan --device cpu --engine ddp --zero-stage 2", "--engine ddp"),
    Case("plan-does-not-fit", "plan --device cpu --preset 40b --cpu-mem 8GB", "B parameters at micro-batch 24 do not fit"),
    # probe
    Case("probe-nvme-missing", "probe --nvme {t}/nothing", "--nvme"),
    Case("probe-nvme-is-file", "probe --nvme {file}", "--nvme"),
    Case("probe-nvme-unwritable", "probe --nvme {ro}", "--nvme"),
    Case("probe-gpus-0", "probe --gpus 0", "--gpus"),
    Case("probe-cache-under-file", "probe", "FITGPT_CACHE", env=(("FITGPT_CACHE", "{file}/cache"),)),
    Case("probe-cache-unwritable", "probe", "FITGPT_CACHE", env=(("FITGPT_CACHE", "{ro}/cache"),)),
    # capacity
    Case("capacity-max-trials-0", f"{CAPACITY} --max-trials 0", "--max-trials"),
    Case("capacity-start-0", f"{CAPACITY} --start 0", "--start"),
    Case("capacity-start-negative", f"{CAPACITY} --start -2", "--start"),
    Case("capacity-gpus-0", f"{CAPACITY} --gpus 0", "--gpus"),
    Case("capacity-steps-0", f"{CAPACITY} --steps 0", "--steps"),
    Case("capacity-nvme-path-missing", f"{CAPACITY} --nvme-path {{dir}}/nope", "--nvme-path"),
    Case("capacity-warmup-negative", f"{CAPACITY} --warmup -1", "--warmup"),
    Case("capacity-out-is-dir", f"{CAPACITY} --out {{dir}}", "--out"),
    Case("capacity-out-under-file", f"{CAPACITY} --out {{file}}/c.jsonl", "--out"),
    Case("capacity-out-unwritable", f"{CAPACITY} --out {{ro}}/c.jsonl", "--out"),
    Case("capacity-cap-0", f"{CAPACITY} --cap 0GB", "--cap"),
    Case("capacity-seq-without-layers", f"{CAPACITY} --search seq-len", "--layers"),
    Case("capacity-seq-step-0", f"{CAPACITY} --search seq-len --layers 1 --seq-step 0", "--seq-step"),
    Case("capacity-cap-words", f"{CAPACITY} --cap much", "--cap"),
    Case("capacity-zero-without-stage", f"{CAPACITY} --engine zero", "--zero-stage"),
    Case("capacity-zero-stage-7", f"{CAPACITY} --engine zero --zero-stage 7", "--zero-stage"),
    Case("capacity-system-unknown", f"{CAPACITY} --system megatron", "megatron"),
    Case("capacity-device-unknown", "capacity --device tpu", "--device"),
    Case("capacity-heads-not-dividing", "capacity --device cpu --hidden 30 --heads 4", "heads"),
    Case("capacity-checkpointing-unknown", f"{CAPACITY} --checkpointing some", "--checkpointing"),
    # bench sweep
    Case("sweep-out-is-dir", f"{BENCH} --out {{dir}}", "--out"),
    Case("sweep-out-under-file", f"{BENCH} --out {{file}}/s.jsonl", "--out"),
    Case("sweep-out-unwritable", f"{BENCH} --out {{ro}}/s.jsonl", "--out"),
    Case("sweep-logs-is-file", f"{BENCH} --out {{t}}/s.jsonl", "--out", setup=write("s.logs", "x")),
    Case("sweep-gpus-0", f"{BENCH} --out {{t}}/s.jsonl --gpus 0", "--gpus"),
    Case("sweep-budget-negative", f"{BENCH} --out {{t}}/s.jsonl --budget -1", "--budget"),
    Case("sweep-sizes-words", f"{BENCH.replace('--sizes 1', '--sizes big')} --out {{t}}/s.jsonl", "--sizes"),
    Case("sweep-sizes-0", f"{BENCH.replace('--sizes 1', '--sizes 0')} --out {{t}}/s.jsonl", "--sizes"),
    Case("sweep-system-unknown", f"{BENCH.replace('fitgpt', 'megatron')} --out {{t}}/s.jsonl", "megatron"),
    Case("sweep-cap-0", f"{BENCH} --out {{t}}/s.jsonl --cap 0", "--cap"),
    Case("sweep-steps-0", f"{BENCH} --out {{t}}/s.jsonl --steps 0", "--steps"),
    Case("sweep-time-limit-0", f"{BENCH} --out {{t}}/s.jsonl --time-limit 0", "--time-limit"),
    Case("sweep-checkpointing-unknown", f"{BENCH} --out {{t}}/s.jsonl --checkpointing cpu", "--checkpointing"),
    Case("sweep-device-unknown", f"{BENCH.replace('--device cpu', '--device tpu')} --out {{t}}/s.jsonl", "--device"),
    Case("sweep-no-out", BENCH, "--out"),
    # bench report
    Case("bench-report-missing", "bench report {t}/nothing.jsonl", "nothing.jsonl"),
    Case("bench-report-is-dir", "bench report {dir}", "adir"),
    Case("bench-report-empty", "bench report {empty}", "empty"),
    Case("bench-report-not-json", "bench report {text}", "text.txt"),
    Case("bench-report-blank-lines", "bench report {t}/b.jsonl", "b.jsonl", setup=write("b.jsonl", "\n\n  \n")),
    Case("bench-report-json-not-trials", "bench report {t}/x.jsonl", "x.jsonl", setup=write("x.jsonl", '{"a": 1}\n')),
    Case("bench-report-ok-without-speed", "bench report {t}/x.jsonl", "x.jsonl", setup=write("x.jsonl", json.dumps(OK_WITHOUT_SPEED) + "\n")),
    Case("bench-report-json-array", "bench report {t}/x.jsonl", "x.jsonl", setup=write("x.jsonl", "[1, 2]\n")),
    Case("bench-report-out-dir-is-file", "bench report {sweep} --out-dir {file}", "--out-dir"),
    Case("bench-report-out-dir-under-file", "bench report {sweep} --out-dir {file}/r", "--out-dir"),
    Case("bench-report-out-dir-unwritable", "bench report {sweep} --out-dir {ro}/r", "--out-dir"),
    Case("bench-report-png-is-dir", "bench report {sweep} --out-dir {t}/r", "sweep.png", setup=mkdir("r/sweep.png")),
    Case("bench-no-subcommand", "bench", "bench"),
    # report
    Case("report-missing", "report {t}/nothing", "nothing"),
    Case("report-is-file", "report {file}", "afile"),
    Case("report-no-metrics", "report {dir}", "metrics.jsonl"),
    Case("report-metrics-empty", "report {t}/r", "metrics.jsonl", setup=metrics("")),
    Case("report-no-train-records", "report {t}/r", "metrics.jsonl", setup=metrics('{"kind": "eval", "step": 1, "val_loss": 2.0}\n')),
    Case("report-metrics-garbage", "report {t}/r", "metrics.jsonl", setup=metrics("not json\n{}\n")),
    Case("report-metrics-records-lack-loss", "report {t}/r", "metrics.jsonl", setup=metrics('{"kind": "train", "step": 1}\n')),
    Case("report-metrics-is-dir", "report {t}/r", "metrics.jsonl", setup=mkdir("r/metrics.jsonl")),
    Case("report-out-is-dir", "report {run} --out {dir}", "--out"),
    Case("report-out-under-file", "report {run} --out {file}/r.png", "--out"),
    Case("report-out-unwritable", "report {run} --out {ro}/r.png", "--out"),
    Case("report-default-out-unwritable", "report {t}/run", "report.png", setup=chain(copy_run(), mkdir("run/report.png"))),
    # the top level
    Case("no-such-command", "fly", "fly"),
    # helper D (training defaults, issues 33/38): --init-std and the default rates
    Case("train-init-std-0", f"{TRAIN_SYN} --init-std 0", "--init-std"),
    Case("train-init-std-negative", f"{TRAIN_SYN} --init-std -0.02", "--init-std"),
    Case("train-min-lr-above-default-peak", f"{TRAIN_SYN} --min-lr 0.5", "--min-lr"),
    # helper B2 (issue 33: wrong words): operand files, folders given as inputs, metrics.jsonl,
    # outputs that would come out empty, a validation share the run does not need
    Case("matmul-a-empty-file", "matmul --a {t}/e.npy --b {npy}", "--a {t}/e.npy: the file is empty", setup=write("e.npy", b"")),
    Case("matmul-b-empty-file", "matmul --a {npy} --b {t}/e.npy", "--b {t}/e.npy: the file is empty", setup=write("e.npy", b"")),
    Case("matmul-a-truncated", "matmul --a {t}/c.npy --b {npy}", "--a", setup=lambda p: (Path(p["t"]) / "c.npy").write_bytes(Path(p["npy"]).read_bytes()[:-8])),
    Case("matmul-a-header-cut", "matmul --a {t}/c.npy --b {npy}", "--a", setup=lambda p: (Path(p["t"]) / "c.npy").write_bytes(Path(p["npy"]).read_bytes()[:40])),
    Case("matmul-a-no-entries", "matmul --a {t}/z.npy --b {npy}", "--a", setup=lambda p: np.save(Path(p["t"]) / "z.npy", np.zeros((0, 0), np.float32))),
    Case("matmul-a-not-npy-bytes", "matmul --a {data}.bin --b {npy}", "not a .npy file"),
    Case("matmul-a-is-dir", "matmul --a {dir} --b {npy}", "--a {dir}: is a folder"),
    Case("matmul-sizes-differ", "matmul --a {npy} --b {t}/b8.npy", "--b", setup=lambda p: np.save(Path(p["t"]) / "b8.npy", np.eye(8, dtype=np.float32))),
    Case("matmul-n-not-the-files", "matmul --a {npy} --n 8", "--n 8"),
    Case("preprocess-input-folder-named", "data preprocess --input {dir} --output-prefix {t}/o --tokenizer bytes", "--input {dir}: is a folder"),
    Case("tokenizer-train-input-folder-named", "tokenizer train --input {dir} --vocab-size 300 --output {t}/tk", "--input {dir}: is a folder"),
    Case("clean-input-folder", "data clean --input {dir} --output-prefix {t}/o --tokenizer bytes", "--input {dir}: is a folder"),
    Case("inspect-folder-named", "data inspect {dir}", "{dir}: is a folder"),
    Case("merge-input-folder", "data merge {data} {dir} --output-prefix {t}/m", "{dir}: is a folder"),
    Case("train-data-folder", f"{TRAIN} --data {{dir}} --out {{t}}/r", "--data {dir}: is a folder"),
    Case("bench-report-folder-named", "bench report {dir}", "{dir}: is a folder"),
    Case("report-metrics-one-garbage-line", "report {t}/r", "metrics.jsonl: line 1 is not valid JSON", setup=metrics("garbage\n")),
    Case("report-metrics-garbage-no-newline", "report {t}/r", "metrics.jsonl: line 1 is not valid JSON", setup=metrics("garbage")),
    Case("report-metrics-binary", "report {t}/r", "metrics.jsonl: line 1 is not valid JSON", setup=metrics("\0\0\0\0")),
    Case("report-metrics-objects-not-records", "report {t}/r", "metrics.jsonl: line 2 is not a metrics record", setup=metrics('{"kind": "eval", "step": 1, "val_loss": 2.0}\n{"a": 1}\n')),
    Case("clean-min-tokens-keeps-nothing", "data clean --input {data} --output-prefix {t}/o --tokenizer bytes --min-tokens 100000", "--min-tokens 100000"),
    Case("clean-no-documents", "data clean --input {t}/z --output-prefix {t}/o", "--input {t}/z", setup=chain(write("z.bin", b""), write("z.idx", b"MMIDIDX\0\0\1" + b"\0" * 7 + b"\x08" + b"\0" * 8 + b"\1" + b"\0" * 15))),
    Case("merge-no-documents", "data merge {t}/z {t}/z --output-prefix {t}/m", "no documents", setup=chain(write("z.bin", b""), write("z.idx", b"MMIDIDX\0\0\1" + b"\0" * 7 + b"\x08" + b"\0" * 8 + b"\1" + b"\0" * 15))),
    Case("train-split-no-valid-but-validates", f"{TRAIN} --data {{data}} --tokenizer bytes --split 100,0,0 --eval-every 5 --out {{t}}/r", "--split 100,0,0"),
    # helper R (resume, issue 33): a resume that would train nothing (into another --out or its
    # own), a preset's shape blamed on the preset, other data named at another place
    Case("train-resume-into-other-out-steps-equal", "train --resume {run} --out {t}/b --steps 2", "--steps 2"),
    Case("train-resume-into-other-out-steps-below", "train --resume {run} --out {t}/b --steps 1", "--steps 1"),
    Case("train-resume-steps-below", "train --out {t}/run --resume --steps 1", "--steps 1", setup=copy_run()),
    Case("train-resume-run-complete", "train --out {t}/run --resume", "its --steps 2", setup=copy_run()),
    Case("train-resume-preset-shape", "train --preset tiny --out {t}/run --resume --steps 3", "--preset tiny", setup=copy_run()),
    Case("train-resume-data-moved-but-other", "train --out {t}/run --resume --steps 3 --data {t}/other", "--data {t}/other", setup=chain(copy_run(), fake_pair("other", 256))),
    # helper V (issue 33: one validation of a run's settings, plan/validate.py): what train
    # refuses, plan, capacity and bench refuse in the same line; flags that would change nothing
    Case("plan-tp-not-dividing-gpus", "plan --preset gpt2-1.5b --device cuda --gpu-mem 80GB --gpus 8 --tensor-parallel 3", "--tensor-parallel 3"),
    Case("plan-ep-not-dividing-experts", "plan --preset qwen3-moe-30b-a3b --device cuda --gpu-mem 80GB --gpus 6 --expert-parallel 3", "the model's 128 experts"),
    Case("plan-tp-4-on-6-gpus", "plan --preset gpt2-1.5b --device cuda --gpu-mem 80GB --gpus 6 --tensor-parallel 4", "--tensor-parallel 4"),
    Case("plan-sp-seq-not-dividing", "plan --device cuda --gpu-mem 80GB --gpus 2 --tensor-parallel 2 --sequence-parallel --seq-len 33", "--seq-len"),
    Case("plan-split-master-fp16", "plan --device cuda --gpu-mem 80GB --master split --precision fp16", "--master split"),
    Case("plan-split-master-fp32", "plan --device cuda --gpu-mem 80GB --master split --precision fp32", "--master split changes nothing"),
    Case("plan-int8-moments-no-offload", "plan --device cuda --gpu-mem 80GB --moments int8 --offload-optimizer none", "--moments int8 changes nothing"),
    Case("plan-streams-at-stage-1", "plan --device cuda --gpu-mem 80GB --gpus 2 --offload-optimizer cpu --offload-params cpu --zero-stage 1", "--zero-stage 3"),
    Case("plan-fp16-on-cpu", "plan --device cpu --precision fp16", "--precision fp16 on a CPU"),
    Case("plan-initial-scale-0", "plan --device cuda --gpu-mem 80GB --precision fp16 --initial-scale 0", "--initial-scale 0"),
    Case("train-initial-scale-0", f"{TRAIN_SYN} --precision fp16 --initial-scale 0", "--initial-scale 0"),
    Case("train-initial-scale-nan", f"{TRAIN_SYN} --precision fp16 --initial-scale nan", "--initial-scale nan"),
    Case("train-min-scale-above-initial", f"{TRAIN_SYN} --precision fp16 --initial-scale 4 --min-scale 8", "--min-scale 8"),
    Case("train-fp16-on-cpu", f"{TRAIN_SYN} --precision fp16", "--precision fp16 on a CPU"),
    Case("train-fp16-on-cpu-deepspeed", f"{TRAIN_SYN} --deepspeed-config {{t}}/ds.json", "--precision fp16 on a CPU", setup=write("ds.json", '{"fp16": {"enabled": true}}')),
    Case("train-split-master-fp32", f"{TRAIN_SYN} --engine zero --master split --precision fp32", "--master split changes nothing"),
    Case("train-int8-moments-no-offload", f"{TRAIN_SYN} --engine zero --moments int8 --offload-optimizer none", "--moments int8 changes nothing"),
    Case("train-offload-blocks-no-tier", f"{TRAIN_SYN} --engine zero --offload-blocks 1", "--offload-blocks 1 changes nothing"),
    Case("train-offload-fraction-no-tier", f"{TRAIN_SYN} --engine zero --offload-fraction 0.5", "--offload-fraction 0.5 changes nothing"),
    Case("train-nvme-blocks-on-cpu-tier", f"{TRAIN_SYN} --engine zero --offload-optimizer cpu --nvme-blocks 1", "--nvme-blocks 1 changes nothing"),
    Case("train-nvme-path-no-disk-tier", f"{TRAIN_SYN} --nvme-path {{dir}}", "--nvme-path"),
    Case("train-no-speculative-no-offload", f"{TRAIN_SYN} --no-speculative-update", "--no-speculative-update changes nothing"),
    Case("train-initial-scale-without-fp16", f"{TRAIN_SYN} --initial-scale 1024", "--initial-scale 1024 changes nothing"),
    Case("train-streams-at-stage-1", f"{TRAIN_SYN} --engine zero --offload-optimizer cpu --offload-params cpu --zero-stage 1 --gpus 2", "--zero-stage 3"),
    Case("capacity-tp-on-one-gpu", f"{CAPACITY} --system tp2", "--tensor-parallel 2"),
    Case("sweep-tp-on-one-gpu", f"{BENCH.replace('fitgpt', 'fitgpt,tp2')} --out {{t}}/s.jsonl", "--tensor-parallel 2"),
    Case("sweep-tp-not-dividing-gpus", f"{BENCH.replace('fitgpt', 'tp2')} --out {{t}}/s.jsonl --gpus 3", "--tensor-parallel 2 does not divide the rank count"),
    # helper B1 (issue 33: interop bad inputs): damaged HF checkpoints, a file where a folder is
    # expected named as typed, empty or invalid tokenizer files (hf_bad_inputs.py makes them)
    Case("import-hf-truncated-safetensors", "import hf {t}/hf --out {t}/r", "hf/model.safetensors: tensor", setup=hf_broken("truncated")),
    Case("import-hf-header-longer-than-file", "import hf {t}/hf --out {t}/r", "hf/model.safetensors: its first 8 bytes announce", setup=hf_broken("header-too-long")),
    Case("import-hf-truncated-pytorch-bin", "import hf {t}/hf --out {t}/r", "hf/pytorch_model.bin: not a readable PyTorch checkpoint", setup=hf_broken("truncated-bin")),
    Case("import-hf-int-dtype", "import hf {t}/hf --out {t}/r", "has dtype I32", setup=hf_broken("int-dtype")),
    Case("import-hf-config-garbage", "import hf {t}/hf --out {t}/r", "hf/config.json is not valid JSON", setup=hf_broken("config-garbage")),
    Case("import-hf-config-truncated", "import hf {t}/hf --out {t}/r", "hf/config.json is not valid JSON", setup=hf_broken("config-truncated")),
    Case("import-hf-config-more-layers-than-weights", "import hf {t}/hf --out {t}/r", "n_layer=100000, but the weights hold 1 blocks", setup=hf_broken("config-more-layers")),
    Case("import-hf-missing-shard", "import hf {t}/hf --out {t}/r", "model-00002-of-00002.safetensors", setup=hf_broken("missing-shard")),
    Case("import-hf-empty-tokenizer-pair", "import hf {t}/hf --out {t}/r", "{t}/hf: its tokenizer files cannot be used", setup=hf_broken("empty-tokenizer")),
    Case("import-hf-config-file-given", "import hf {t}/hf/config.json --out {t}/r", "{t}/hf/config.json is not a weight file", setup=hf_broken("none")),
    Case("import-hf-weights-without-config", "import hf {t}/hf/model.safetensors --out {t}/r", "{t}/hf/model.safetensors: its folder", setup=hf_broken("no-config")),
    Case("import-hf-text-file-given", "import hf {file} --out {t}/r", "{file} is not a weight file"),
    # helper H2 (issue 36: Llama, Qwen2, Qwen3, Mistral in and out)
    Case("import-hf-llama-rope-yarn-no-factor", "import hf {t}/hf --out {t}/r", "rope_scaling of type 'yarn' lacks factor", setup=broken_llama({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4}})),
    Case("import-hf-llama-rope-dynamic", "import hf {t}/hf --out {t}/r", "hf/config.json: rope_scaling type 'dynamic'", setup=broken_llama({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})),
    Case("import-hf-llama-rope-parameters-misspelt", "import hf {t}/hf --out {t}/r", "rope_parameters type 'lineer'", setup=broken_llama({"rope_parameters": {"rope_type": "lineer", "factor": 2.0}})),
    Case("import-hf-llama-gelu", "import hf {t}/hf --out {t}/r", "hidden_act='gelu'", setup=broken_llama({"hidden_act": "gelu"})),
    Case("import-hf-llama-attention-bias", "import hf {t}/hf --out {t}/r", "attention_bias=True", setup=broken_llama({"attention_bias": True})),
    Case("import-hf-llama-mlp-bias", "import hf {t}/hf --out {t}/r", "mlp_bias=True", setup=broken_llama({"mlp_bias": True})),
    Case("import-hf-llama-head-dim-odd", "import hf {t}/hf --out {t}/r", "head_dim=3 is odd", setup=broken_llama({"head_dim": 3})),
    Case("import-hf-llama-kv-heads-not-dividing", "import hf {t}/hf --out {t}/r", "num_key_value_heads=3", setup=broken_llama({"num_attention_heads": 4, "num_key_value_heads": 3})),
    Case("import-hf-no-model-type", "import hf {t}/hf --out {t}/r", "hf/config.json has no model_type", setup=broken_llama({"model_type": None})),
    Case("import-hf-unknown-model-type", "import hf {t}/hf --out {t}/r", "model_type='phi3'", setup=broken_llama({"model_type": "phi3"})),
    Case("import-hf-qwen2-window-in-some-layers", "import hf {t}/hf --out {t}/r", "slides a window of 4 in 1 of 2 layers", setup=broken_llama({"model_type": "qwen2", "num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1})),
    Case("import-hf-llama-missing-shard", "import hf {t}/hf --out {t}/r", "model-00002-of-00002.safetensors", setup=broken_llama(how="missing-shard")),
    Case("import-hf-llama-tensor-without-place", "import hf {t}/hf --out {t}/r", "o_proj.bias has no place in a LlamaForCausalLM", setup=broken_llama(how="extra-bias")),
    Case("import-hf-llama-more-layers-than-weights", "import hf {t}/hf --out {t}/r", "num_hidden_layers=5, but the weights hold 1 blocks", setup=broken_llama({"num_hidden_layers": 5})),
    Case("export-hf-max-shard-size-garbage", "export --ckpt {run} --format hf --out {t}/h --max-shard-size lots", "--max-shard-size lots"),
    Case("preprocess-tokenizer-empty-pair", "data preprocess --input {jsonl} --output-prefix {t}/o --tokenizer {t}/tk", "tk/vocab.json + {t}/tk/merges.txt", setup=chain(write("tk/vocab.json", b""), write("tk/merges.txt", b""))),
    Case("preprocess-tokenizer-empty-pair-comma", "data preprocess --input {jsonl} --output-prefix {t}/o --tokenizer {t}/v.json,{t}/m.txt", "v.json + {t}/m.txt", setup=chain(write("v.json", b""), write("m.txt", b""))),
    Case("train-tokenizer-empty-pair", f"{TRAIN} --data {{data}} --split 9,1,0 --tokenizer {{t}}/tk --out {{t}}/r", "tk/vocab.json", setup=chain(write("tk/vocab.json", b""), write("tk/merges.txt", b""))),
    Case("tokenizer-encode-vocab-without-bytes", "tokenizer encode --tokenizer {t}/tk hello", "lacks 255 of the 256 byte tokens", setup=chain(write("tk/vocab.json", '{"a": 0}'), write("tk/merges.txt", b""))),
    Case("tokenizer-encode-empty-tokenizer-json", "tokenizer encode --tokenizer {t}/tk hello", "tk/tokenizer.json", setup=write("tk/tokenizer.json", b"")),
    Case("export-hf-tokenizer-empty-pair", "export --ckpt {run} --format hf --out {t}/h --tokenizer {t}/tk", "tk/vocab.json", setup=chain(write("tk/vocab.json", b""), write("tk/merges.txt", b""))),
    Case("tokenizer-encode-tokenizer-json-empty-vocab", "tokenizer encode --tokenizer {t}/tk hello", "vocabulary is empty", setup=write("tk/tokenizer.json", '{"model": {"type": "BPE", "vocab": {}, "merges": []}}')),
]
# fmt: on


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict:
    """The real inputs every case reads (never writes): made once, checked unchanged after."""
    d = tmp_path_factory.mktemp("shared")
    text = d / "text.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    jsonl = d / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(60)))
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # train's thread rule must not change this process
    try:
        fake = ["data", "fake", "--tokens", "20000", "--vocab", "256", "--doc-len", "40"]
        run_ok([*fake, "--output-prefix", str(d / "fake")])
        pre = ["data", "preprocess", "--tokenizer", "gpt2", "--workers", "1", "--quiet"]
        run_ok([*pre, "--input", str(jsonl), "--output-prefix", str(d / "g")])
        tok = ["tokenizer", "train", "--vocab-size", "300"]
        run_ok([*tok, "--input", str(text), "--output", str(d / "tok")])
        run_ok([*shlex.split(TRAIN_DATA.format(data=d / "fake")), "--out", str(d / "run")])
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old
    (d / "sweep.jsonl").write_text(json.dumps(OK_TRIAL) + "\n")
    np.save(d / "b.npy", np.eye(4, dtype=np.float32))
    return {
        "root": d,
        "run": str(d / "run"),
        "data": str(d / "fake"),
        "gdata": str(d / "g_text_document"),
        "tok": str(d / "tok"),
        "jsonl": str(jsonl),
        "text": str(text),
        "sweep": str(d / "sweep.jsonl"),
        "npy": str(d / "b.npy"),
    }


def listing(root: Path) -> dict[str, int]:
    """Every file and folder under `root` with its size (folders: -1)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1)
        for p in sorted(root.rglob("*"))
    }


def params(cases: list[Case]):
    out = []
    for c in cases:
        marks = []
        waits = set((c.owner or "").split()) & PENDING_OWNERS
        if waits:
            why = f"waits for branch {' and '.join(sorted(waits))}"
            marks.append(pytest.mark.xfail(strict=True, reason=why))
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


def test_the_table_is_large_and_ids_unique():
    assert len(CASES) >= 150
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", params(CASES))
def test_bad_input(case: Case, shared, tmp_path, monkeypatch, capfd):
    t = tmp_path / "case"
    t.mkdir()
    (t / "afile.txt").write_text("a regular file\n")
    (t / "adir").mkdir()
    (t / "empty.jsonl").write_bytes(b"")
    p = {
        **shared,
        "t": str(t),
        "file": str(t / "afile.txt"),
        "dir": str(t / "adir"),
        "empty": str(t / "empty.jsonl"),
        "ro": str(unwritable(tmp_path)),
    }
    if case.setup:
        case.setup(p)
    monkeypatch.chdir(t)  # defaults such as runs/default land in the case's folder
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("FITGPT_CACHE", str(tmp_path / "cache"))
    for k, v in case.env:
        monkeypatch.setenv(k, v.format(**p))
    before, shared_before = listing(t), listing(shared["root"])
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        main(shlex.split(case.argv.format(**p)))
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert e.value.code not in (0, None), f"exit {e.value.code}; stderr: {err!r}"
    assert e.value.code == case.code, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{err}"
    assert case.names.format(**p) in lines[0], f"the line does not name {case.names!r}: {err}"
    assert listing(t) == before, "the command left files behind"
    assert listing(shared["root"]) == shared_before, "the command changed a shared input"


# ---- the cases that are not a bad input but must still end well --------------------------------
def test_report_with_only_failed_trials_is_written_and_says_so(tmp_path, capfd):
    res = tmp_path / "s.jsonl"
    res.write_text(json.dumps(FAILED_TRIAL) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["bench", "report", str(res)])
    out = capfd.readouterr().out
    assert e.value.code == 0
    assert (tmp_path / "s.png").is_file() and (tmp_path / "s.md").is_file()
    assert "none of the 1 trials" in out
    assert "error" in (tmp_path / "s.md").read_text()


def test_plan_into_a_closed_pipe_is_quiet(tmp_path):
    """`fitgpt plan | head -3` when the reader has left before plan writes (`true` reads
    nothing): no BrokenPipeError traceback, not a word on stderr."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env["FITGPT_CACHE"] = str(tmp_path)
    cmd = f"{shlex.quote(sys.executable)} -m fitgpt plan --device cpu --preset gpt2-125m | true"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)
    assert r.stderr == "", r.stderr


def test_a_full_disk_behind_stdout_is_one_line():
    """`fitgpt presets > /dev/full`: stdout's disk is full; one line, exit 2, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "fitgpt", "presets"], stdout=full, stderr=subprocess.PIPE,
            text=True, env=env, timeout=60,
        )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "fitgpt presets: error: stdout: no space left on the disk; free some space or write to "
        "another disk"
    ]


def test_a_full_disk_names_the_output_and_its_free_space(tmp_path):
    """A write() on a full disk carries no path: the line names the command's output instead,
    with the free space of its disk and, where the writer knew it, the size it needed."""
    from fitgpt.paths import describe_os_error

    with pytest.raises(OSError) as e, open("/dev/full", "w") as f:
        f.write("x")
        f.flush()
    e.value.needed_bytes = 3_000_000  # type: ignore[attr-defined]
    line = describe_os_error(e.value, [("--out", str(tmp_path / "run"))])
    assert line is not None
    assert line.startswith(f"--out {tmp_path / 'run'}: no space left on the disk, needed 3.0 MB, ")
    assert line.endswith(" free; free some space or write to another disk")


def test_an_os_error_without_a_path_or_output_keeps_its_traceback():
    """An OSError about no path (a socket, say) is a bug, not a user's mistake."""
    from fitgpt.paths import describe_os_error

    assert describe_os_error(ConnectionResetError(104, "reset"), []) is None


def test_output_checks_create_nothing(tmp_path):
    """The checks write a probe file and remove it, and make no folder."""
    from fitgpt.paths import check_writable_dir, check_writable_file

    check_writable_file(tmp_path / "a" / "b" / "c.png", "--out")
    check_writable_dir(tmp_path / "x" / "y", "--out")
    check_writable_dir(tmp_path, "--out")
    (tmp_path / "old.json").write_text("kept")
    check_writable_file(tmp_path / "old.json", "--json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    assert (tmp_path / "old.json").read_text() == "kept"


def test_help_shows_the_defaults_the_command_uses(capsys):
    """train's model flags show the tiny preset's values, its data stdlib, its engine flags
    the planner."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "transformer blocks (default: from --preset; tiny: 4)" in text
    assert "(default: from --preset; tiny: 128)" in text  # hidden and seq-len
    assert "(default: stdlib)" in text and "(default: synthetic)" not in text
    assert "(default: the planner's choice; with --plan off: zero)" in text
    # the state formats are planned too (docs/offload.md): auto is fp32 unless the plan needs room
    assert "--master {auto,fp32,split} storage of the fp32 master weights" in text
    assert (
        "the same for the blocks whose optimizer state stays on the GPU (default: the "
        "planner's choice; with --plan off: auto)" in text
    )


def test_every_flag_of_every_command_has_help():
    import argparse

    from fitgpt.cli import build_parser

    def missing(p: argparse.ArgumentParser, name: str) -> list[str]:
        out = []
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    out += missing(sp, f"{name} {sub}")
            elif not a.help:
                out.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
        return out

    assert missing(build_parser(), "fitgpt") == []
