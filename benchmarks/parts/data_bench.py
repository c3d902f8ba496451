"""Data pipeline benchmark: preprocessing throughput and per-batch loader overhead (CPU only).

    .venv/bin/python benchmarks/parts/data_bench.py [--corpus-mb 60] [--workdir /tmp/fitgpt-data-bench]

1. Makes a JSON-lines corpus of at least --corpus-mb MB from source and text files already on this
   machine (the Python standard library, installed packages, /usr/share/doc), one file per
   document, in sorted order; nothing is downloaded. It lives in --workdir, outside git.
2. Preprocesses it with the GPT-2 tokenizer at 1 and 2 worker processes (tokens/s, MB/s) and
   checks that both outputs are byte-identical.
3. Times BatchLoader.next() (8 x 1024 tokens, GPTSamples underneath) over many batches on that
   corpus and on a 200M-token fake corpus: median and p99 per batch (target: under 1 ms).

Writes benchmarks/results/data_cpu_<date>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from fitgpt.data.gpt_dataset import open_megatron_splits
from fitgpt.data.preprocess import PreprocessConfig, preprocess
from fitgpt.data.source import BatchLoader
from fitgpt.data.tools import FakeConfig, fake

ROOT = Path(__file__).resolve().parents[2]

DATE = "2026-11-22"


def make_corpus(path: Path, min_bytes: int) -> dict:
    """One document per text file found locally, until `min_bytes` of JSON lines are written."""
    if path.is_file() and path.stat().st_size >= min_bytes:
        return json.loads(path.with_suffix(".json").read_text())
    roots = [
        Path(sysconfig.get_paths()["stdlib"]),
        Path(sysconfig.get_paths()["purelib"]),
        Path("/usr/share/doc"),
    ]
    suffixes = {".py", ".txt", ".rst", ".md", ".html", ".c", ".h"}
    tmp = path.with_name(path.name + ".tmp")
    written, docs, sources = 0, 0, []
    with open(tmp, "w", encoding="utf-8") as out:
        for root in roots:
            if not root.is_dir() or written >= min_bytes:
                continue
            sources.append(str(root))
            for f in sorted(root.rglob("*")):
                if f.suffix not in suffixes or not f.is_file() or f.stat().st_size > 4 << 20:
                    continue
                try:
                    text = f.read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                line = json.dumps({"text": text, "path": str(f)}) + "\n"
                out.write(line)
                written += len(line.encode())
                docs += 1
                if written >= min_bytes:
                    break
    os.replace(tmp, path)
    meta = {"bytes": path.stat().st_size, "documents": docs, "sources": sources}
    path.with_suffix(".json").write_text(json.dumps(meta))
    return meta


def bench_preprocess(corpus: Path, workdir: Path, workers: int) -> dict:
    load = [round(x, 2) for x in os.getloadavg()]
    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cfg = PreprocessConfig(
        input=str(corpus),
        output_prefix=str(workdir / f"bench_w{workers}"),
        workers=workers,
        append_eod=True,
        progress=sys.stderr.isatty(),
    )
    r = preprocess(cfg)
    print(r.summary(), file=sys.stderr)
    after = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, usage))
    return {
        "workers": workers,
        "load_average_before": load,
        "cpu_seconds": round(cpu, 1),  # main + workers: ~workers x wall when each gets a core
        "seconds": round(r.seconds, 2),
        "documents": r.documents,
        "tokens": r.tokens,
        "input_mb": round(r.bytes_in / 1e6, 1),
        "tokens_per_s": round(r.tokens_per_s),
        "mb_per_s": round(r.mb_per_s, 3),
        "prefix": r.prefix,
    }


def bench_loader(prefix: str, batches: int, seq_len: int = 1024, micro_batch: int = 8) -> dict:
    t0 = time.perf_counter()
    train, _ = open_megatron_splits(prefix, "969,30,1", seq_len, seed=0, vocab_size=50257)
    loader = BatchLoader(train, micro_batch)
    loader.next()  # builds epoch 0's index
    open_s = time.perf_counter() - t0
    for _ in range(50):
        loader.next()
    times = np.empty(batches)
    for i in range(batches):
        t = time.perf_counter()
        x, y, _ = loader.next()
        times[i] = time.perf_counter() - t
    assert x.shape == (micro_batch, seq_len) and y.shape == (micro_batch, seq_len)
    return {
        "prefix": prefix,
        "tokens": int(train.data.num_tokens),
        "documents": int(train.data.num_documents),
        "train_samples_per_epoch": int(train.samples_per_epoch),
        "batch": f"{micro_batch}x{seq_len}",
        "batches_timed": batches,
        "epochs_crossed": int(loader.position * micro_batch // train.samples_per_epoch),
        "open_and_first_batch_ms": round(open_s * 1e3, 1),
        "median_ms": round(float(np.median(times)) * 1e3, 4),
        "p99_ms": round(float(np.percentile(times, 99)) * 1e3, 4),
        "mean_ms": round(float(times.mean()) * 1e3, 4),
    }


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import tokenizers
    import torch

    return {
        "description": "2-core CPU box (the project's CI/dev machine), no GPU",
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "tokenizers": tokenizers.__version__,
    }


def markdown(res: dict) -> str:
    m = res["machine"]
    rows = [
        f"# Data pipeline on the CPU box, {res['date']}",
        "",
        f"{m['description']}: nproc {m['nproc']}, {m['cpu']}; Python {m['python']}, "
        f"torch {m['torch']}, numpy {m['numpy']}, tokenizers {m['tokenizers']}; "
        f"load average at start {m['load_average_at_start']}.",
        "",
        f"## Preprocessing (GPT-2 BPE, --append-eod), corpus {res['corpus']['bytes'] / 1e6:.1f} MB "
        f"of local source/text files, {res['corpus']['documents']:,} documents",
        "",
        "Best of the interleaved runs, then every run:",
        "",
        "| workers | seconds | tokens | tokens/s | MB/s | CPU s | load before |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    best = [*res["preprocess"], None, *res["preprocess_runs"]]  # None: the separator row
    for p in best:
        rows.append(
            "| *every run:* | | | | | | |"
            if p is None
            else f"| {p['workers']} | {p['seconds']:.1f} | {p['tokens']:,} | "
            f"{p['tokens_per_s']:,} | {p['mb_per_s']:.2f} | {p['cpu_seconds']:.0f} | "
            f"{p['load_average_before'][0]} |"
        )
    rows += [
        "",
        f"Outputs of 1 and 2 workers byte-identical: {res['outputs_identical']}.",
        "",
        "## Loader overhead per batch (BatchLoader.next, 8 x 1024 tokens, target < 1 ms)",
        "",
        "| corpus | tokens | documents | batches | median ms | p99 ms | open + first batch ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, lo in res["loader"].items():
        rows.append(
            f"| {name} | {lo['tokens']:,} | {lo['documents']:,} | {lo['batches_timed']:,} | "
            f"{lo['median_ms']:.3f} | {lo['p99_ms']:.3f} | {lo['open_and_first_batch_ms']:.0f} |"
        )
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus-mb", type=float, default=60, help="corpus size (at least 50)")
    ap.add_argument("--workdir", default="/tmp/fitgpt-data-bench", help="corpus and outputs")
    ap.add_argument("--batches", type=int, default=3000, help="loader batches to time")
    ap.add_argument("--repeats", type=int, default=2, help="preprocessing runs per worker count")
    ap.add_argument("--fake-tokens", type=int, default=200_000_000, help="fake corpus size")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": DATE, "machine": machine()}
    corpus = work / "corpus.jsonl"
    res["corpus"] = make_corpus(corpus, int(args.corpus_mb * 1e6))
    # Interleaved repeats: the box is shared, so a busy spell hits both worker counts alike.
    runs = [bench_preprocess(corpus, work, w) for _ in range(args.repeats) for w in (1, 2)]
    res["preprocess_runs"] = runs
    res["preprocess"] = [
        max((r for r in runs if r["workers"] == w), key=lambda r: r["tokens_per_s"]) for w in (1, 2)
    ]
    one, two = ([Path(p["prefix"] + e).read_bytes() for e in (".bin", ".idx")] for p in runs[:2])
    res["outputs_identical"] = one == two
    fake_prefix = str(work / "fake200m")
    fake(FakeConfig(output_prefix=fake_prefix, tokens=args.fake_tokens, vocab=50257, doc_len=512))
    res["loader"] = {
        "local text (GPT-2)": bench_loader(res["preprocess"][0]["prefix"], args.batches),
        "fake markov, 512-token docs": bench_loader(fake_prefix, args.batches),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"data_cpu_{DATE}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
