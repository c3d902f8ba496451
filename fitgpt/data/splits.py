"""The train/valid/test split of a document collection, Megatron-LM's arithmetic, and the index
cache beside the data: shared by fitgpt's sample order (gpt_dataset.py) and Megatron's
(megatron_order.py), which both build on them."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from fitgpt.errors import UserError

SPLITS = ("train", "valid", "test")


def parse_split(split: str) -> tuple[float, float, float]:
    """'969,30,1' (or '969/30/1'; missing trailing weights are 0) -> three weights."""
    try:
        w = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        w = []
    if not 1 <= len(w) <= 3 or not all(math.isfinite(x) and x >= 0 for x in w) or sum(w) <= 0:
        raise UserError(
            f"--split {split!r} must be 1 to 3 non-negative weights for train,valid,test with a "
            "positive sum, e.g. 969,30,1"
        )
    return (*w, *[0.0] * (3 - len(w)))  # type: ignore[return-value]


def split_ranges(split: str, num_docs: int) -> dict[str, tuple[int, int]]:
    """Document range [lo, hi) of each split; raises if a weighted split gets no document.

    Megatron-LM's arithmetic, float for float (megatron/core/datasets: `normalize` in utils.py,
    `convert_split_vector_to_split_matrix` in blended_megatron_dataset_config.py, and
    `BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`): the weights are divided by
    their numpy sum, the bookends are running Python float sums of those fractions (the last one
    is not forced to 1.0), and each bookend b becomes round(b * D): Python's round, half to
    even, so 90,10,0 over 25 documents gives train [0, 22), not [0, 23).
    """
    w = parse_split(split)
    fractions = (np.array(w, dtype=np.float64) / np.sum(w)).tolist()
    bookends = [0.0]
    for f in fractions:
        bookends.append(bookends[-1] + f)
    bounds = [round(b * float(num_docs)) for b in bookends]  # Python floats: half to even
    ranges = {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLITS)}
    empty = [n for n, wi in zip(SPLITS, w) if wi > 0 and ranges[n][0] == ranges[n][1]]
    if empty:
        counts = ", ".join(f"{n} {hi - lo}" for n, (lo, hi) in ranges.items())
        raise UserError(
            f"--split {split} over {num_docs} documents gives {counts} documents, so "
            f"{' and '.join(empty)} would be empty; {_suggest(w, num_docs)}"
        )
    return ranges


def _suggest(w: tuple[float, float, float], num_docs: int) -> str:
    wanted = [i for i, x in enumerate(w) if x > 0]
    if num_docs == 0:
        return "the data holds no documents; check the preprocessing summary for what was dropped"
    if num_docs < len(wanted):
        return (
            f"add documents, or give weight 0 to the splits you can do without "
            f"(e.g. --split {','.join('1' if i < num_docs else '0' for i in range(3))})"
        )
    counts = [max(1, round(num_docs * x / sum(w))) if x > 0 else 0 for x in w]
    while sum(counts) > num_docs:
        counts[int(np.argmax(counts))] -= 1
    counts[wanted[0]] += num_docs - sum(counts)
    return f"use e.g. --split {','.join(map(str, counts))}, or give an unwanted split weight 0"


def cache_dir(prefix: str) -> Path:
    """Where the indexes built over PREFIX.bin/.idx are cached (beside the data)."""
    return Path(prefix + ".index-cache")


def save_atomic(path: Path, a: np.ndarray) -> None:
    """np.save to a temporary name, then rename: a reader never sees half an index."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.save(f, a)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
