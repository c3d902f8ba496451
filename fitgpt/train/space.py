"""A checkpoint's size from the model's chunk layout, and whether --out's disk can hold a run's.

Nothing is allocated: the size follows from the layout (fitgpt/engine/layout.py) and how the
engine writes it (state_io): per (chunk, writing rank) one safetensors file of 4 bytes per
element per kind (fp32 `master`, and in full checkpoints `exp_avg` and `exp_avg_sq`) plus its
header, per rank an index and an RNG file, and meta.json. At 7.86 B parameters that is ~31 GB
weights-only and ~94 GB full.

Before step 1 the trainer compares the bytes its saves will add with the free space at --out.
The rename scheme holds, while a checkpoint is written, the `--keep` complete ones plus the one
being written, so the most copies on disk at once are min(existing + saves, keep + 1); those
already there are already paid for. `FITGPT_FAKE_FREE_BYTES` replaces the probe (tests).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from fitgpt.engine.chunked.placement import padded
from fitgpt.engine.layout import ChunkSpec
from fitgpt.errors import UserError

FAKE_FREE_ENV = "FITGPT_FAKE_FREE_BYTES"
CRC_MAX = 4294967295  # the widest CRC-32 written in an index entry


@dataclass(frozen=True)
class CheckpointSize:
    """Bytes of one checkpoint of a run: full (weights and Adam moments) and weights-only."""

    full: int
    weights: int

    def of(self, optimizer: bool) -> int:
        return self.full if optimizer else self.weights


def human(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def writer_ranges(numel: int, world: int, sharded: bool) -> list[tuple[int, int, int]]:
    """(rank, lo, hi) of every file written for a chunk of `numel` elements: each rank's shard
    of the padded buffer, cut to the unpadded length (as ChunkEngine._pieces), or rank 0 whole."""
    if not sharded or world == 1:
        return [(0, 0, numel)]
    s = padded(numel, world) // world
    return [(r, r * s, min((r + 1) * s, numel)) for r in range(world) if r * s < numel]


def safetensors_bytes(lo: int, hi: int, kinds: tuple[str, ...]) -> int:
    """Exact size of one state file: 8-byte length, JSON header padded to 8, the tensors."""
    k, tensors, off = hi - lo, {}, 0
    for name in sorted(kinds):
        tensors[name] = {"dtype": "F32", "shape": [k], "data_offsets": [off, off + 4 * k]}
        off += 4 * k
    head = {"__metadata__": {"hi": str(hi), "lo": str(lo)}, **tensors}
    n = len(json.dumps(head, separators=(",", ":")))
    return 8 + -(-n // 8) * 8 + off


def _index_entry_bytes(rank: int, chunk: int, lo: int, hi: int, kinds, size: int) -> int:
    entry = {
        "file": f"c{chunk:04d}-r{rank:03d}.safetensors",
        "chunk": chunk,
        "lo": lo,
        "hi": hi,
        "bytes": size,
        "header_crc": CRC_MAX,
        "crc": dict.fromkeys(kinds, CRC_MAX),
    }
    return len(json.dumps([entry], indent=1))


def rng_bytes() -> int:
    from fitgpt.train.checkpoint import rng_state

    buf = io.BytesIO()
    torch.save(rng_state(), buf)
    return len(buf.getvalue())


def checkpoint_bytes(
    layout: list[ChunkSpec], world: int, sharded: bool, optimizer: bool, meta_bytes: int
) -> int:
    """Bytes on disk of one checkpoint (an upper bound within a few bytes per file)."""
    kinds = ("master", "exp_avg", "exp_avg_sq") if optimizer else ("master",)
    total, index, files = 0, Counter(), 0
    for c in layout:
        for rank, lo, hi in writer_ranges(c.numel, world, sharded):
            size = safetensors_bytes(lo, hi, kinds)
            total += size
            index[rank] += _index_entry_bytes(rank, c.index, lo, hi, kinds, size)
            files += 1
    total += sum(index.values()) + world * rng_bytes()
    files += len(index) + world
    # meta.json: the trainer's meta, plus per file its size and (small files) a SHA-256
    return total + meta_bytes + files * 110 + 200


def checkpoint_size(
    layout: list[ChunkSpec], world: int, sharded: bool, meta_bytes: int
) -> CheckpointSize:
    return CheckpointSize(
        full=checkpoint_bytes(layout, world, sharded, True, meta_bytes),
        weights=checkpoint_bytes(layout, world, sharded, False, meta_bytes),
    )


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (or its nearest existing parent)."""
    fake = os.environ.get(FAKE_FREE_ENV)
    if fake:
        return int(fake)
    p = path.absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def saves_in_run(start: int, steps: int, save_every: int) -> int:
    """Checkpoints a run from `start` to `steps` writes: every save_every steps and the last."""
    if start >= steps:
        return 0
    periodic = steps // save_every - start // save_every if save_every else 0
    last_is_periodic = save_every and steps % save_every == 0
    return periodic + (0 if last_is_periodic else 1)


def copies_to_add(existing: int, saves: int, keep: int) -> int:
    """Checkpoint copies the run adds to --out's disk at its fullest: min(existing + saves,
    keep + 1) at once (keep complete, one being written), less the `existing` already there.
    At least one while there is a save: an old run with more than keep has no room to spare."""
    if saves == 0:
        return 0
    return max(min(existing + saves, keep + 1) - existing, 1)


def _options(
    size: CheckpointSize, free: int, optimizer: bool, existing: int, saves: int, keep: int
) -> list[str]:
    """The smallest changes of --save-optimizer, --save-every and --keep that fit, fewest first."""
    found = []
    for opt in (optimizer, False) if optimizer else (False,):
        for n_saves in (saves, 1) if saves > 1 else (saves,):
            k = next(
                (
                    k
                    for k in range(keep, 0, -1)
                    if copies_to_add(existing, n_saves, k) * size.of(opt) <= free
                ),
                None,
            )
            if k is None:
                continue
            flags = (
                [f"--save-optimizer none ({human(size.weights)} each)"] if opt != optimizer else []
            )
            flags += ["--save-every 0 (one save, at the end)"] if n_saves != saves else []
            flags += [f"--keep {k}"] if k != keep else []
            if flags:
                found.append(" + ".join(flags))
    return sorted(found, key=lambda f: f.count("--"))[:3]


def check_room(
    out: Path, size: CheckpointSize, optimizer: bool, existing: int, saves: int, keep: int
) -> None:
    """Refuse in one line a run whose checkpoints cannot fit on --out's disk, with the options."""
    copies = copies_to_add(existing, saves, keep)
    one = size.of(optimizer)
    need, free = copies * one, free_bytes(out)
    if need <= free:
        return
    what = "fp32 weights and both Adam moments" if optimizer else "fp32 weights only"
    options = _options(size, free, optimizer, existing, saves, keep)
    options += ["--no-save", "an --out on a larger disk"]
    raise UserError(
        f"--out {out}: one checkpoint of this run is {human(one)} ({what}); with --keep {keep}, "
        f"{existing} already there and {saves} to write, it needs {human(need)} more and the disk "
        f"has {human(free)} free; use {', '.join(options[:-1])} or {options[-1]}"
    )


def explain_failure(out: Path, size: CheckpointSize, optimizer: bool):
    """The sentence a failed save adds after its cause: the bytes needed and free, and, for a
    full disk, the options."""
    from fitgpt.train.checkpoint import is_disk_full

    def explain(cause: str, error) -> str:
        text = f"it needs {human(size.of(optimizer))} and {out} has {human(free_bytes(out))} free"
        if is_disk_full(error):
            alt = f"--save-optimizer none ({human(size.weights)}), " if optimizer else ""
            text += f" (options: {alt}a smaller --keep, --no-save or another --out)"
        return text + "; "

    return explain
