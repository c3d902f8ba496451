"""Synthetic tokens: uniform noise for speed runs, or a Markov chain the model can learn.

The chain gives every token `branching` possible successors (fixed by the seed), so the best
achievable loss is ln(branching) nats while noise stays at ln(V): a falling loss proves the
trainer learns. Tokens are made by many chains in parallel, one numpy step per position.
"""

from __future__ import annotations

import numpy as np

from fitgpt.data.source import splitmix64
from fitgpt.data.text import TokenWindows


def markov_tokens(
    n: int, vocab: int, seed: int = 0, branching: int = 4, chains: int = 4096, stream: int = 0
) -> np.ndarray:
    """`n` tokens from a random sparse Markov chain over `vocab` tokens (int32 when it fits).

    `stream` > 0 walks the same chain (the table depends on `seed` only) with other random
    steps, so a large corpus can be made chunk by chunk; stream 0 is the original sequence.
    """
    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab, size=(vocab, branching), dtype=np.int64)
    if stream:
        rng = np.random.default_rng([seed, stream])
    chains = max(1, min(chains, n))
    steps = -(-n // chains)
    out = np.empty((chains, steps), dtype=np.int64)
    cur = rng.integers(0, vocab, size=chains)
    for t in range(steps):
        out[:, t] = cur
        cur = table[cur, rng.integers(0, branching, size=chains)]
    dtype = np.uint16 if vocab <= 65536 else np.int32
    return out.reshape(-1)[:n].astype(dtype)


def uniform_tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return (
        np.random.default_rng(seed)
        .integers(0, vocab, size=n)
        .astype(np.uint16 if vocab <= 65536 else np.int32)
    )


class UniformSource:
    """Uniform random tokens made on demand from a hash: no memory, any speed-run size."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed

    def get(self, idx: np.ndarray) -> np.ndarray:
        pos = np.arange(self.seq_len + 1, dtype=np.uint64)
        keys = (idx.astype(np.uint64)[:, None] << np.uint64(20)) + pos[None, :]
        h = splitmix64(keys ^ np.uint64(self.seed))
        return (h % np.uint64(self.vocab_size)).astype(np.int64)


def synthetic_splits(
    seq_len: int, vocab_size: int, seed: int = 0, structure: str = "markov", tokens: int = 1 << 21
):
    """(train, valid) sources over the same chain (validation uses other windows)."""
    if structure == "uniform":
        return UniformSource(seq_len, vocab_size, seed), UniformSource(
            seq_len, vocab_size, seed + 1
        )
    stream = markov_tokens(tokens, vocab_size, seed)
    return (
        TokenWindows(stream, seq_len, vocab_size, seed),
        TokenWindows(stream, seq_len, vocab_size, seed + 7919),
    )
