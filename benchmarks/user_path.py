"""Issue 10's scenario: the commands a user types, at the sizes fitgpt exists for.

Every step is a `fitgpt` command line (run as `python3 -m fitgpt`, which is what the installed
`fitgpt` script does), on data made by `fitgpt data preprocess` from real text (the Python
standard library's own source, GPT-2's tokenizer). Each step's command, exit status, wall time,
last lines of output, and the figures of its run folder (median step time after two warm-up
steps, TFLOP/s, GPU peak, the planner's prediction) go to one JSON line in $OUT/user_path.jsonl;
a table is printed last.

    python3 benchmarks/user_path.py h100 --stage a --out $OUT   # nvidia-h100-x1: ~8 B with a
                                                  #   checkpoint, the harness beside it
    python3 benchmarks/user_path.py h100 --stage b --out $OUT   # resume, generate, export
    python3 benchmarks/user_path.py x2 --out $OUT       # nvidia-h200-x2: --gpus 2 at 20 B and the
                                                       #   largest size the planner accepts
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

WORK = Path(os.environ.get("USER_PATH_WORK", "/tmp/user_path"))
DATA = WORK / "data" / "pystd_text_document"  # what preprocess names --output-prefix .../pystd
# ANCHORS' batch: micro-batch 8 x 4 accumulation steps x seq 1024 per GPU
BATCH = ["--micro-batch", "8", "--grad-accum", "4", "--eval-every", "0"]
EIGHT_B = ["--preset", "6.7b", "--layers", "38"]  # 7.86 B with GPT-2's vocabulary, tied head
# the same model in the harness's terms (tied head, GPT-2's vocabulary)
HARNESS = ["--sizes", "38", "--hidden", "4096", "--heads", "32", "--tie-embeddings"]


def fitgpt(*argv: str) -> list[str]:
    return [sys.executable, "-m", "fitgpt", *argv]


def step(
    out: Path,
    name: str,
    cmd: list[str],
    run_dir: Path | None = None,
    env=None,
    timeout_s: float | None = None,
    **extra,
) -> dict:
    """Run one command as a user would; record what it printed and what its run folder holds.
    timeout_s: stop it then (rc 124), keeping what it printed and the steps it logged, so a
    device call's time limit does not lose the record."""
    t0 = time.time()
    print(f"\n$ {' '.join(cmd[2:])}", flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, **(env or {})})  # fmt: skip
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        p = subprocess.CompletedProcess(cmd, 124, text(e.stdout), text(e.stderr))
    rec = {
        "name": name,
        "command": "fitgpt " + " ".join(cmd[3:]),
        "rc": p.returncode,
        "wall_s": round(time.time() - t0, 1),
        "stdout_tail": p.stdout[-3000:],
        "stderr_tail": p.stderr[-3000:],
        "traceback": "Traceback" in p.stderr,
        **extra,
    }
    print(p.stdout[-1500:], p.stderr[-1500:], sep="\n", flush=True)
    if run_dir is not None:
        rec.update(run_figures(run_dir, p.stdout))
    with open(out / "user_path.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def run_figures(run_dir: Path, stdout: str) -> dict:
    """Median step figures after two warm-up steps (metrics.jsonl at --log-every 1), and the plan
    line the command printed."""
    out: dict = {}
    m = re.search(r"plan: (.*?) \(predicted ([\d.]+) GiB per rank, ([\d.]+) s/step\)", stdout)
    if m:
        out.update(plan=m.group(1), predicted_gib=float(m.group(2)), predicted_s=float(m.group(3)))
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return out
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    timed = train[2:] or train
    if timed:
        ms = statistics.median(r["ms_per_step"] for r in timed)
        out.update(
            steps=[r["step"] for r in train],
            losses=[r["loss"] for r in train],
            step_s=ms / 1000,
            tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
            tflops=statistics.median(r.get("tflops", 0) for r in timed),
            peak_gib=max(r.get("peak_gib", 0) for r in train),
        )
    return out


def make_data(out: Path) -> None:
    """Real text as JSONL (one document per standard-library file), preprocessed with GPT-2."""
    if Path(f"{DATA}.bin").is_file():
        return
    DATA.parent.mkdir(parents=True, exist_ok=True)
    src = DATA.parent / "pystd.jsonl"  # one JSON line per file
    root = Path(sysconfig.get_paths()["stdlib"])
    with open(src, "w") as f:
        files = sorted(root.rglob("*.py"))
        for p in files[:700] if os.environ.get("FITGPT_REHEARSAL_FREE") else files:
            try:
                f.write(json.dumps({"text": p.read_text(encoding="utf-8")}) + "\n")
            except (UnicodeDecodeError, OSError):
                continue
    step(
        out,
        "preprocess",
        fitgpt(
            "data", "preprocess", "--input", str(src), "--json-key", "text",
            "--output-prefix", str(DATA.parent / "pystd"), "--workers", str(min(8, os.cpu_count() or 1)),
            "--append-eod",
        ),
    )  # fmt: skip


def h100(out: Path, stage: str) -> None:
    """Stage a: data, the refusal, the 8 B run with weights-only checkpoints, the harness beside
    it. Stage b: resume, generate and export from that run (trained again if this machine is
    not the one stage a ran on)."""
    make_data(out)
    runs = WORK / "runs"
    eight = runs / "8b"
    common = [*EIGHT_B, "--data", str(DATA), *BATCH, "--log-every", "1"]
    train_8b = fitgpt(
        "train", *common, "--steps", "6", "--save-optimizer", "none", "--out", str(eight)
    )  # fmt: skip
    if stage == "a":
        shutil.rmtree(runs, ignore_errors=True)
        # 1. as a new user types it: the full checkpoint (~94 GB) cannot fit the 64 GB disk
        rehearsal = os.environ.get("FITGPT_REHEARSAL_FREE")
        fake = {"FITGPT_FAKE_FREE_BYTES": "1000000"} if rehearsal else {}
        cmd = fitgpt("train", *common, "--steps", "6", "--out", str(eight))
        step(out, "8b refused", cmd, env=fake)
        # 2. with the option the refusal names: weights-only checkpoints
        step(out, "8b train", train_8b, run_dir=eight)
        # 3. the harness, same model and batch (tied head, GPT-2 vocabulary), random tokens
        sweep = out / "harness_8b.jsonl"
        cmd = fitgpt(
            "bench", "sweep", "--systems", "fitgpt", *HARNESS, "--warmup", "2", "--steps", "4",
            "--out", str(sweep),
        )  # fmt: skip
        step(out, "8b harness", cmd)
        return
    if not list(eight.glob("step_*/meta.json")):
        step(out, "8b train (again: a fresh machine)", train_8b, run_dir=eight)
    # 4. resume by the run folder alone (the optimizer restarts: weights-only checkpoint)
    cmd = fitgpt("train", "--out", str(eight), "--resume", "--steps", "10", "--no-save")
    step(out, "8b resume", cmd, run_dir=eight)
    cmd = fitgpt(
        "generate", "--ckpt", str(eight), "--prompt", "def main(", "--max-new-tokens", "40"
    )
    step(out, "8b generate", cmd)
    cmd = fitgpt(
        "export", "--ckpt", str(eight), "--format", "hf", "--dtype", "bf16",
        "--out", str(runs / "8b-hf"),
    )  # fmt: skip
    step(out, "8b export hf", cmd)
    shutil.rmtree(runs, ignore_errors=True)


# nvidia-h200-x2's RAM grows as it is used (MemTotal reads ~31 GiB at the start of 256): a user
# of such a machine states what it gives, as `fitgpt plan --cpu-mem` and `train --cpu-mem` allow
X2_RAM = ["--cpu-mem", "230GiB"]


def x2(out: Path) -> None:
    make_data(out)
    runs = WORK / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    common = ["--data", str(DATA), *BATCH, "--log-every", "1", "--no-save", "--steps", "6"]
    common += X2_RAM
    twenty = runs / "20b"
    step(
        out,
        "20b --gpus 2",
        fitgpt("train", "--gpus", "2", "--preset", "20b", *common, "--out", str(twenty)),
        run_dir=twenty,
    )
    # the largest 20b-shaped model the planner accepts on this machine
    layers = largest_layers()
    big = runs / "largest"
    step(
        out,
        f"largest --gpus 2 ({layers} layers)",
        fitgpt(
            "train", "--gpus", "2", "--preset", "20b", "--layers", str(layers), *common,
            "--out", str(big),
        ),
        run_dir=big,
        layers=layers,
    )  # fmt: skip


def largest_layers() -> int:
    """What `fitgpt plan` names as the most layers of the 20b preset's width that fit here."""
    cmd = fitgpt(
        "plan", "--preset", "20b", "--layers", "400", "--gpus", "2", "--tokenizer", "gpt2",
        "--micro-batch", "8", "--grad-accum", "4", *X2_RAM,
    )  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"what fits: (\d+) layers", p.stderr + p.stdout)
    if not m:
        raise SystemExit(f"no size found in: {p.stderr[-500:]}")
    return int(m.group(1))


def table(out: Path) -> None:
    rows = [json.loads(x) for x in (out / "user_path.jsonl").read_text().splitlines()]
    print("\n| step | rc | wall s | step s | predicted s | TFLOP/s | peak GiB | predicted GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['rc']} | {r['wall_s']} | {r.get('step_s', '')} | "
            f"{r.get('predicted_s', '')} | {r.get('tflops', '')} | {r.get('peak_gib', '')} | "
            f"{r.get('predicted_gib', '')} |"
        )


def rehearse() -> None:
    """--small: the same steps on a CPU at toy sizes, to check the script before a device call
    (the free-space probe is told the disk holds 1 MB, so the first train is refused)."""
    global BATCH, EIGHT_B, HARNESS
    BATCH = ["--micro-batch", "2", "--grad-accum", "2", "--eval-every", "0", "--device", "cpu"]
    EIGHT_B = ["--preset", "gpt2-125m", "--layers", "2", "--hidden", "64", "--heads", "4"]
    EIGHT_B += ["--seq-len", "64"]
    HARNESS = ["--sizes", "2", "--hidden", "64", "--heads", "4", "--seq-len", "64"]
    HARNESS += ["--tie-embeddings", "--micro-batch", "2", "--grad-accum", "2", "--device", "cpu"]
    os.environ["FITGPT_REHEARSAL_FREE"] = "1"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("machine", choices=["h100", "x2"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="rehearse on a CPU at toy sizes")
    ap.add_argument("--stage", choices=["a", "b"], default="a", help="h100: the call's part")
    a = ap.parse_args()
    if a.small:
        rehearse()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.machine == "h100":
        h100(out, a.stage)
    else:
        x2(out)
    table(out)


if __name__ == "__main__":
    main()
