"""The figures of a run: a short table for people, one JSON record for machines."""

from __future__ import annotations

import json
import os

from fitgpt.matmul.memory import gb
from fitgpt.matmul.run import MatmulResult
from fitgpt.units import tflops


def table(r: MatmulResult) -> str:
    """The lines rank 0 prints at the end of a run."""
    rows = [(f"fitgpt matmul · {r.layout} · n={r.n} · {r.dtype} · {r.world} × {r.device}", "")]
    rows.append(("layout", r.shape))
    setup = "reused from the previous run" if r.setup_reused else f"{r.setup_s:.2f} s"
    rows.append(("make A, B (not timed)", setup))
    spread = " ".join(f"{t:.3f}" for t in r.times_s)
    rows.append(
        ("product", f"{r.time_s:.3f} s" + (f" (median of {spread})" if len(r.times_s) > 1 else ""))
    )
    rate = tflops(r.tflops)
    if r.ref_tflops:
        rate += (
            f" = {r.frac_of_ref:.2f} × {r.world} × {tflops(r.ref_tflops)} "
            f"(one device's torch.mm at n={r.ref_n})"
        )
    rows.append(("rate (2n³ / time)", rate))
    held = gb(r.held_bytes)
    if r.seed_bytes:
        saved = r.seed_bytes - r.held_bytes
        held += f" (seed's layout, all of B everywhere: {gb(r.seed_bytes)}; saved {gb(saved)})"
    rows.append(("held per device", held))
    if r.peak_bytes is not None:
        rows.append(("peak allocated", f"{gb(r.peak_bytes)} (torch.cuda.max_memory_allocated)"))
    if r.layout == "out-of-core":
        rows.append(("host memory (A, B)", gb(r.host_bytes or 0)))
        rows.append(
            ("host -> device", f"{gb(r.h2d_bytes or 0)} (device -> host {gb(r.d2h_bytes or 0)})")
        )
    else:
        rows.append(
            ("received per rank", f"{gb(r.comm_bytes)} (all ranks: {gb(r.comm_bytes_total)})")
        )
    v = r.verify
    word = "PASS" if v.get("passed") else "FAIL"
    rows.append(
        (
            "verify",
            f"Freivalds {v['freivalds']:.2e}, {v['samples']} entries {v['sampled']:.2e}, "
            f"tolerance {v['tolerance']:.0e}: {word} ({r.verify_s:.2f} s)",
        )
    )
    if r.out:
        rows.append(("C written to", r.out))
    width = max(len(k) for k, _ in rows[1:])
    return "\n".join([rows[0][0]] + [f"  {k:<{width}}  {val}" for k, val in rows[1:]])


def write_json(path: str, record: dict) -> None:
    """The record as one JSON object, written to a temporary name and renamed."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def append_jsonl(path: str, record: dict) -> None:
    """Append one line to a JSON-lines file; the whole file is rewritten under a temp name."""
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(old + json.dumps(record) + "\n")
    os.replace(tmp, path)
