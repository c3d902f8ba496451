"""What filled the GPU when a `fitgpt train` run ran out of it: the run in this process with
torch's allocator history on, then its events replayed up to the first out-of-memory event and
the blocks alive then grouped by where they were made (the innermost fitgpt frame, and the
torch function beside it). One JSON file: the bytes alive, the request that failed, and the
30 largest groups.

Usage (device): python3 benchmarks/memory/oom_trace_gpu.py OUT.json -- <fitgpt train flags>
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch


def where(frames: list[dict]) -> str:
    """The innermost frame in fitgpt (file:line function), with the frame inside it."""
    for i, f in enumerate(frames):
        name = f.get("filename", "")
        if "/fitgpt/" in name and "/benchmarks/" not in name:
            inner = frames[i - 1] if i else {}
            tail = f"{inner.get('name', '')}" if inner else ""
            return f"{name.split('/fitgpt/')[-1]}:{f.get('line')} {f.get('name')} <- {tail}"
    return "(no fitgpt frame)"


def main() -> None:
    out = sys.argv[1]
    flags = sys.argv[sys.argv.index("--") + 1 :]
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    from fitgpt.cli import main as fitgpt_main

    try:
        fitgpt_main(["train", *flags])
    except SystemExit as e:
        print("fitgpt exited", e.code)
    snap = torch.cuda.memory._snapshot()
    live: dict[int, tuple[int, str]] = {}
    oom = None
    for trace in snap["device_traces"]:
        for ev in trace:
            a = ev["action"]
            if a == "alloc":
                live[ev["addr"]] = (ev["size"], where(ev.get("frames", [])))
            elif a == "free_completed":
                live.pop(ev["addr"], None)
            elif a == "oom":
                oom = ev
                break
        if oom:
            break
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, w in live.values():
        groups[w][0] += size
        groups[w][1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:30]
    rec = {
        "oom_seen": oom is not None,
        "asked_bytes": oom.get("size") if oom else None,
        "alive_gib": sum(s for s, _ in live.values()) / 2**30,
        "groups": [{"where": w, "gib": b / 2**30, "blocks": n} for w, (b, n) in top],
    }
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
    print(json.dumps({k: v for k, v in rec.items() if k != "groups"}))
    for g in rec["groups"][:20]:
        print(f"{g['gib']:8.2f} GiB {g['blocks']:6d}  {g['where']}")


if __name__ == "__main__":
    main()
