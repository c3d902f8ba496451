"""Plot and tabulate the loss curves of runs that differ in one setting.

Reads OUT/metrics_<variant>.jsonl (a `fitgpt train` run's metrics file, one per variant) and
writes OUT/<name>.png (training loss against step) and OUT/<name>.md (a table: mean training loss
over the last 50 steps, validation losses, median tokens/s).

Usage: python benchmarks/history/loss_curves.py OUT NAME LABEL VARIANT [VARIANT ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(out: Path, name: str, label: str, variants: list[str]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    lines = [
        f"| {label} | train loss, last 50 steps (mean) | validation losses | tokens/s (median) |",
        "|---|---|---|---|",
    ]
    for v in variants:
        recs = [json.loads(x) for x in (out / f"metrics_{v}.jsonl").read_text().splitlines() if x]
        train = [r for r in recs if r.get("kind") == "train"]
        evals = [r for r in recs if r.get("kind") == "eval"]
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label=v, lw=1)
        tail = [r["loss"] for r in train if r["step"] > train[-1]["step"] - 50]
        tps = sorted(r["tokens_per_s"] for r in train)
        val = " / ".join(f"{r['val_loss']:.4f}" for r in evals)
        lines.append(f"| {v} | {sum(tail) / len(tail):.4f} | {val} | {tps[len(tps) // 2]:,.0f} |")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_ylim(top=3.5)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:])
