"""Charts and tables from a sweep's JSON lines, and from a training run's metrics.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers
import matplotlib.pyplot as plt

from fitgpt import units

PEERS = ("ddp", "deepspeed", "fsdp")


def is_peer(system: str) -> bool:
    return system.startswith(PEERS)


def _save(fig, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=130, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def sweep_chart(results: list[dict], path: Path, title: str = "") -> None:
    """Samples/s and model TFLOP/s against parameters; each line ends at its capacity (★)."""
    systems = sorted({r["system"] for r in results}, key=lambda s: (is_peer(s), s))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    drawn = False
    for s in systems:
        ok = sorted(
            (r for r in results if r["system"] == s and r["status"] == "ok"),
            key=lambda r: r["params"],
        )
        if not ok:
            continue
        drawn = True
        x = [r["params"] / 1e9 for r in ok]
        style = "--" if is_peer(s) else "-"
        width = 3.0 if s == "fitgpt" else 1.5  # the planner's choice stands out from its ablations
        for ax, key in zip(axes, ("samples_per_s", "tflops")):
            y = [r.get(key, 0) for r in ok]
            (line,) = ax.plot(x, y, style, marker="o", ms=4, lw=width, label=s)
            ax.plot(x[-1], y[-1], marker="*", ms=14, color=line.get_color())
            ax.annotate(
                f"{x[-1]:.1f}B",
                (x[-1], y[-1]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
    axes[0].set_ylabel("samples/s (sequences of 1024 tokens), log scale")
    axes[1].set_ylabel("model TFLOP/s per GPU (recompute not counted)")
    for ax in axes:
        ax.set_xlabel("parameters (billions)")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    # samples/s falls ~1/N with size: a log axis keeps the large models readable; TFLOP/s is
    # linear from zero, so ratios read honestly there
    axes[0].set_yscale("log")
    axes[1].set_ylim(bottom=0)
    if drawn:
        axes[1].legend(fontsize=8, loc="best")
    else:
        for ax in axes:
            ax.text(0.5, 0.5, "no trial trained", ha="center", transform=ax.transAxes)
    dev = next((r.get("device") for r in results if r.get("device")), "")
    fig.suptitle(title or f"Throughput against model size — {dev} (★ = largest that trained)")
    _save(fig, path)


def sweep_table(results: list[dict]) -> str:
    systems = sorted({r["system"] for r in results}, key=lambda s: (is_peer(s), s))
    sizes = sorted({(r["params"], r["layers"]) for r in results})
    by = {(r["system"], r["layers"]): r for r in results}
    lines = [
        "| params | layers | " + " | ".join(systems) + " | fitgpt / best peer |",
        "|---|---|" + "---|" * len(systems) + "---|",
    ]
    for params, layers in sizes:
        cells, best_peer = [], 0.0
        for s in systems:
            r = by.get((s, layers))
            if r is None:
                cells.append("")
            elif r["status"] == "ok":
                cells.append(f"{r['tokens_per_s']:,.0f} tok/s{_rate(r, ' ({})')}")
                if is_peer(s):
                    best_peer = max(best_peer, r["tokens_per_s"])
            else:
                cells.append(r["status"])
        mine = by.get(("fitgpt", layers))
        ratio = ""
        if mine and mine["status"] == "ok" and best_peer:
            ratio = f"{mine['tokens_per_s'] / best_peer:.2f}×"
        elif mine and mine["status"] == "ok":
            tried = any(is_peer(s) and (s, layers) in by for s in systems)
            ratio = "no peer fits" if tried else "no peer run"
        lines.append(
            f"| {units.params(params)} | {layers} | " + " | ".join(cells) + f" | {ratio} |"
        )
    lines += [
        "",
        "| system | largest model trained | its throughput | GPU peak | host RAM peak | next size |",
        "|---|---|---|---|---|---|",
    ]
    for s in systems:
        ok = [r for r in results if r["system"] == s and r["status"] == "ok"]
        failed = sorted(
            (r for r in results if r["system"] == s and r["status"] != "ok"),
            key=lambda r: r["params"],
        )
        stop = (
            f"{units.params(failed[0]['params'])}: {failed[0]['status']} "
            f"({failed[0]['reason'][:90].replace('|', '/')})"
            if failed
            else "not tried"
        )
        if not ok:
            lines.append(f"| {s} | none | | | | {stop} |")
            continue
        big = max(ok, key=lambda r: r["params"])
        gpu = f"{big['gpu_peak_gib']:.1f} GiB" if "gpu_peak_gib" in big else "—"
        host = big.get("host_rss_total_gib", big.get("host_rss_peak_gib"))
        lines.append(
            f"| {s} | {units.params(big['params'])} | {_rate(big, '{}, ')}"
            f"{big['tokens_per_s']:,.0f} tok/s | {gpu} | "
            f"{'—' if host is None else f'{host:.1f} GiB'} | {stop} |"
        )
    return "\n".join(lines) + "\n"


def read_sweep(path: Path) -> list[dict]:
    """The trials of a sweep's results file, checked: a UserError naming the file when no line
    is a trial record or a record lacks what the chart and table read. A line that is not JSON
    is skipped, as the sweep itself does (a line cut short by a crash; the trial reruns)."""
    from fitgpt.bench.sweep import read_results
    from fitgpt.errors import UserError

    what = "pass the .jsonl that `fitgpt bench sweep` or `fitgpt capacity --out` wrote"
    results = [r for r in read_results(path) if isinstance(r, dict)]
    if not results:
        raise UserError(f"{path}: holds no trial record (empty, or no line is JSON); {what}")
    for i, r in enumerate(results):
        need = ["system", "status", "params", "layers"]
        need += ["tokens_per_s"] if r.get("status") == "ok" else ["reason"]
        missing = [k for k in need if k not in r]
        if missing:
            raise UserError(
                f"{path}: record {i + 1} lacks {', '.join(missing)}; not a sweep's results: {what}"
            )
    return results


def write_report(
    results_path: Path, out_dir: Path, results: list[dict] | None = None
) -> tuple[Path, Path]:
    """The chart (PNG) and table (markdown) of a sweep, each written under a temporary name."""
    if results is None:
        results = read_sweep(results_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    png, md = report_paths(results_path, out_dir)
    sweep_chart(results, png)
    tmp = md.with_name(md.name + ".tmp")
    dev = next((r.get("device") for r in results if r.get("device")), "unknown device")
    date = next((r.get("date") for r in results if r.get("date")), "")
    tmp.write_text(
        f"# {results_path.name}: {dev}, {date}\n\n![chart]({png.name})\n\n{sweep_table(results)}"
    )
    os.replace(tmp, md)
    return png, md


def report_paths(results_path: Path, out_dir: Path) -> tuple[Path, Path]:
    """Where `write_report` puts the chart and the table."""
    return out_dir / (results_path.stem + ".png"), out_dir / (results_path.stem + ".md")


def _rate(r: dict, fmt: str) -> str:
    """`fmt` holding a trial's model FLOP/s in its unit; nothing when it has none (a CPU)."""
    return fmt.format(units.tflops(r["tflops"])) if "tflops" in r else ""


def read_metrics(path: Path) -> list[dict]:
    """The records of a run's metrics.jsonl (one JSON object per line, each with a "kind").

    A UserError naming the file and the line when a line is not JSON or not such a record, and
    when the file holds no training record (a run that ended before its first log line). Only a
    last line cut short by a crash mid-write is skipped: `MetricsLog.write` ends every record
    with a newline, so such a line is the one the file does not end with, after a good record.
    """
    from fitgpt.errors import UserError

    text = path.read_text(errors="replace")
    numbered = [(i + 1, x) for i, x in enumerate(text.splitlines()) if x.strip()]
    fix = "pass the metrics.jsonl a `fitgpt train` run wrote"
    rows = []
    for k, (number, line) in enumerate(numbered):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if k == len(numbered) - 1 and rows and not text.endswith("\n"):
                continue  # cut short by a crash mid-write
            raise UserError(
                f"{path}: line {number} is not valid JSON ({line[:40]!r}): not a JSON-lines "
                f"metrics file; {fix}"
            ) from None
        if not isinstance(rec, dict) or "kind" not in rec:
            raise UserError(
                f'{path}: line {number} is not a metrics record (a JSON object with a "kind"); '
                + fix
            )
        rows.append(rec)
    train = [r for r in rows if r.get("kind") == "train"]
    if not train:
        raise UserError(
            f"{path}: no training records (the run logged no step yet); chart it once it has "
            "passed --log-every steps"
        )
    need = ("step", "loss", "tokens_per_s")
    bad = next((r for r in train if any(k not in r for k in need)), None)
    if bad is not None:
        raise UserError(f"{path}: a training record lacks {'/'.join(need)}; not a metrics file")
    return rows


def run_chart(run_dir: Path, out: Path | None = None, rows: list[dict] | None = None) -> Path:
    """Loss, throughput and memory over steps from a training run's metrics.jsonl."""
    if rows is None:
        rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval" and "val_loss" in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        axes[0].plot(
            [r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation"
        )
    axes[0].set_ylabel("loss")
    axes[0].legend()
    axes[1].plot([r["step"] for r in train], [r["tokens_per_s"] for r in train])
    axes[1].set_ylabel("tokens/s")
    mem = [r for r in train if "peak_gib" in r]
    if mem:
        axes[2].plot([r["step"] for r in mem], [r["peak_gib"] for r in mem])
        axes[2].set_ylabel("peak GPU memory (GiB)")
    else:
        axes[2].text(
            0.5, 0.5, "no GPU memory figures (CPU run)", ha="center", transform=axes[2].transAxes
        )
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    path = out or run_dir / "report.png"
    _save(fig, path)
    return path
