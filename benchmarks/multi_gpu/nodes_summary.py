"""Summarise nodes_x4.sh's stages from their logs: each plan's predicted step, the measured
steps (after the first, which warms up), how far apart, and hierarchical's speed-up over flat
against the planner's. Prints a few lines and writes OUT/summary.json.

Usage: python3 benchmarks/multi_gpu/nodes_summary.py OUT
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

PLAN = re.compile(r"^plan: (.*) \(predicted ([\d.]+) GiB per rank, ([\d.]+) s/step\)")
STEP = re.compile(r"^step +(\d+) \| loss ([\d.]+) .*\| (\d+) ms/step \| ([\d,]+) tok/s")
LINK = re.compile(r"between nodes: .*: ([\d.]+) Gb/s per GPU")


def stage(path: Path) -> dict | None:
    if not path.is_file():
        return None
    out: dict = {"steps": []}
    for line in path.read_text().splitlines():
        if m := PLAN.match(line):
            out.update(plan=m[1], predicted_gib=float(m[2]), predicted_step_s=float(m[3]))
        elif m := STEP.match(line):
            out["steps"].append(
                {"step": int(m[1]), "loss": float(m[2]), "step_s": int(m[3]) / 1e3,
                 "tokens_per_s": float(m[4].replace(",", ""))}
            )  # fmt: skip
        elif "rror" in line:
            out.setdefault("errors", []).append(line[:300])
    timed = [s["step_s"] for s in out["steps"][1:]]
    if timed:
        out["measured_step_s"] = statistics.median(timed)
        if "predicted_step_s" in out:
            out["off_plan"] = out["measured_step_s"] / out["predicted_step_s"] - 1
    return out


def main(folder: str) -> None:
    root = Path(folder)
    summary: dict = {}
    probe = root / "probe_node0.txt"
    if probe.is_file():
        text = probe.read_text()
        if m := LINK.search(text):
            summary["probe_inter_node_gbit"] = float(m[1])
        if m := re.search(r"over 2 ranks of one node: ([\d.]+) GB/s", text):
            summary["probe_intra_node_gbps"] = float(m[1])
    for name in ("node", "flat"):
        s = stage(root / f"{name}_node0.txt")
        if s is not None:
            summary[name] = s
            if "measured_step_s" in s:
                print(
                    f"{name}: measured {s['measured_step_s']:.2f} s/step, planned "
                    f"{s.get('predicted_step_s', float('nan')):.2f} "
                    f"({100 * s.get('off_plan', float('nan')):+.1f}%): {s.get('plan', '?')}"
                )
            else:
                print(f"{name}: no timed step; {s.get('errors', ['no error line'])[:2]}")
    n, f = summary.get("node", {}), summary.get("flat", {})
    if "measured_step_s" in n and "measured_step_s" in f:
        summary["speedup_measured"] = f["measured_step_s"] / n["measured_step_s"]
        summary["speedup_planned"] = f["predicted_step_s"] / n["predicted_step_s"]
        summary["speedup_off"] = summary["speedup_measured"] / summary["speedup_planned"] - 1
        print(
            f"hierarchical over flat: {summary['speedup_measured']:.2f}x measured, "
            f"{summary['speedup_planned']:.2f}x planned ({100 * summary['speedup_off']:+.1f}%)"
        )
    (root / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
