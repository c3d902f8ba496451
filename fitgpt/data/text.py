"""Real text that every machine has: the Python standard library's own source files.

Found at run time (no download), read in sorted order so every machine with the same Python
builds the same corpus. Used by the demo and the CPU tests.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from fitgpt.data.source import splitmix64
from fitgpt.errors import UserError


def stdlib_text(max_bytes: int = 8 << 20) -> str:
    """Up to `max_bytes` of the standard library's .py files, joined by blank lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
    )
    if not files:
        raise UserError(
            f"no Python source files under {root}; pass --data PREFIX or --data synthetic"
        )
    parts, total = [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files are latin-1 test fixtures; skip them
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return "\n\n".join(parts)[:max_bytes]


class TokenWindows:
    """Samples are random windows of a token array, placed by a hash of (seed, sample index)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        if len(tokens) < seq_len + 2:
            raise UserError(
                f"the corpus has {len(tokens)} tokens, fewer than one sample of {seq_len + 1}; "
                "use a shorter --seq-len or more data"
            )
        self.tokens, self.seq_len, self.vocab_size, self.seed = tokens, seq_len, vocab_size, seed

    def get(self, idx: np.ndarray) -> np.ndarray:
        span = len(self.tokens) - self.seq_len - 1
        h = splitmix64(idx.astype(np.uint64) ^ np.uint64((self.seed * 0x2545F4914F6CDD1D) % 2**64))
        starts = (h % np.uint64(span)).astype(np.int64)
        rows = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return self.tokens[rows].astype(np.int64)


def text_splits(
    tokens: np.ndarray, seq_len: int, vocab_size: int, seed: int, valid_fraction: float = 0.05
) -> tuple[TokenWindows, TokenWindows]:
    """Train on the first 95% of the tokens and validate on the rest (disjoint text)."""
    cut = int(len(tokens) * (1 - valid_fraction))
    return (
        TokenWindows(tokens[:cut], seq_len, vocab_size, seed),
        TokenWindows(tokens[cut:], seq_len, vocab_size, seed + 1),
    )
