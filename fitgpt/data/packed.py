"""Chat samples packed whole into rows: the source of data made by `fitgpt data preprocess --chat`.

A row is seq_len + 1 tokens (inputs its first S, targets its last S), as every SampleSource's.
Conversations (one sequence each in the .bin) are placed whole, several to a row, and the rest of
a row is padding; each token carries

    keep     its loss-mask value (PREFIX.loss_mask.bin): 1 if, as a target, its loss counts
    segment  0, 1, ... for the row's samples in order; padding takes the next id

and BatchLoader turns a target into -1 (ignored by the loss) where keep is 0 or the segment
changes (the first token of a sample is never predicted from the one before it), and hands the
segment ids on so attention can be kept inside each sample.

A sample longer than a row (L > S + 1 tokens) is handled as `fitgpt data preprocess --chat
--long` chose (recorded with the data; drop when it is not):
- drop (the default, as TRL's SFTTrainer truncates to max_length keeping the start): its first
  S + 1 tokens are its one piece, the rest is not trained on; a sample whose first row holds no
  assistant token trains nothing and is left out. Every trained token sees its whole context.
- split: it is cut into pieces of S + 1 tokens overlapping by one (piece k holds tokens
  [k·S, k·S + S + 1)), so each of its tokens is still a target exactly once; each piece is its
  own segment, so a later piece trains without the text before the cut (`cut_samples`).
- refuse: the source is not built; the error names the longest and the --seq-len it needs.
The last piece is packed like any short sample. `describe` says what happened, for the log.

Packing is fixed once per (split, seq_len, seed): the pieces in a seeded random order, each put
in the open row where it leaves the least room (best fit; a new row when none fits; at most
OPEN_ROWS rows open, the fullest closed first). Each epoch then shuffles the rows under (seed,
split, epoch), so global sample j is row shuffle_e[j mod R] of epoch e = j // R, resumable from
j alone, as in gpt_dataset.GPTSamples. Building costs a Python loop over the pieces (0.43 s
for a million of 50-2,000 tokens into rows of 4,097 on the 2-core box, filling 99.4% of the
rows; on every rank, at start); the arrays are 8 bytes per piece and per row.
"""

from __future__ import annotations

import bisect

import numpy as np

from fitgpt.data.chat import mask_prefix
from fitgpt.data.indexed import IndexedDataset
from fitgpt.data.splits import SPLITS, split_ranges
from fitgpt.errors import UserError

LONG_CHOICES = ("drop", "split", "refuse")  # preprocess --long: a sample longer than a row
DEFAULT_LONG = "drop"
OPEN_ROWS = 64  # rows a piece may join: more packs tighter, each placement costs log2 of it
PACK_STREAM = 0x9ACC  # seeds the packing's random stream apart from the epochs' shuffles
EPOCHS_KEPT = 2  # a batch can straddle one epoch boundary


def best_fit(lengths: np.ndarray, capacity: int, open_rows: int = OPEN_ROWS) -> np.ndarray:
    """Row of each item of `lengths` (each <= capacity), placed in the given order: into the
    open row it fills most tightly, else a new row. Rows are numbered as they open."""
    rows = np.empty(len(lengths), np.int64)
    room: list[tuple[int, int]] = []  # (free tokens, row) of the open rows, ascending
    opened = 0
    for i, n in enumerate(lengths.tolist()):
        j = bisect.bisect_left(room, (n, -1))  # the first open row with room for n
        if j < len(room):
            free, row = room.pop(j)
        else:
            if len(room) >= open_rows:
                room.pop(0)  # the fullest: the row fewest later pieces could join
            free, row, opened = capacity, opened, opened + 1
        rows[i] = row
        if free > n:
            bisect.insort(room, (free - n, row))
    return rows


class PackedSamples:
    """Rows of packed chat samples from one split: any index >= 0, no end."""

    def __init__(
        self,
        data: IndexedDataset,
        split: str,
        name: str,
        seq_len: int,
        seed: int,
        vocab_size: int,
        long: str | None = None,
    ) -> None:
        """`long`: drop, split or refuse (module docstring); None: the data's record's."""
        if name not in SPLITS:
            raise UserError(f"split name {name!r} is not one of {', '.join(SPLITS)}")
        if seq_len < 1:
            raise UserError(f"seq_len {seq_len} must be at least 1")
        self.mask = open_mask(data)
        self.lo, self.hi = split_ranges(split, data.num_sequences)[name]
        if self.lo == self.hi:
            raise UserError(f"--split {split} gives the {name} split weight 0; give it a weight")
        self.data, self.name, self.seq_len, self.seed = data, name, seq_len, seed
        self.vocab_size = vocab_size
        self.num_documents = self.hi - self.lo
        self.long = recorded_long(data.prefix) if long is None else long
        if self.long not in LONG_CHOICES:
            raise UserError(f"--long {self.long!r} is not one of {', '.join(LONG_CHOICES)}")
        starts, lengths, self.cut_samples = self._pieces()
        if not len(lengths) and self.left_out:
            raise UserError(
                f"every conversation of the {name} split of {data.prefix} is longer than a row "
                f"of --seq-len {seq_len} + 1 tokens with no assistant token in its first row "
                "(--long drop leaves those out); train with a longer --seq-len"
            )
        if not len(lengths):
            raise UserError(
                f"the {name} split of {data.prefix} holds no tokens; give it more weight in --split"
            )
        order = np.random.default_rng([PACK_STREAM, seed, SPLITS.index(name)]).permutation(
            len(lengths)
        )
        row_of = best_fit(lengths[order], seq_len + 1)
        by_row = order[np.argsort(row_of, kind="stable")]  # pieces row by row, in placement order
        self.piece_start, self.piece_len = starts[by_row], lengths[by_row]
        self.samples_per_epoch = int(row_of.max()) + 1
        self.row_ptr = np.zeros(self.samples_per_epoch + 1, dtype=np.int64)
        np.cumsum(np.bincount(row_of, minlength=self.samples_per_epoch), out=self.row_ptr[1:])
        self.num_tokens = int(lengths.sum())
        # the share of row tokens that are samples, not padding (1.0: no padding)
        self.fill = self.num_tokens / (self.samples_per_epoch * (seq_len + 1))
        self._epochs: dict[int, np.ndarray] = {}

    def _pieces(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(first .bin token, length) of every piece of the split's samples (module docstring),
        and how many samples were cut. Empty samples give no piece. Sets the counts of samples
        longer than a row; reads the mask of those samples only."""
        S = self.seq_len
        lengths = self.data.lengths[self.lo : self.hi].astype(np.int64)
        first = self.data.pointers[self.lo : self.hi] // self.data.dtype.itemsize
        long = np.flatnonzero(lengths > S + 1)
        self.long_samples, self.left_out = len(long), 0
        if len(long) and self.long == "refuse":
            most = int(lengths[long].max())
            raise UserError(
                f"{self.data.prefix}: {len(long):,} conversations of the {self.name} split are "
                f"longer than a row of --seq-len {S} + 1 tokens (the longest has {most:,}), and "
                f"the data was made with --long refuse; train with --seq-len {most - 1} or "
                "more, or preprocess it again with --long drop or split"
            )
        # tokens after each long sample's first row, and the assistant's among them: not trained
        # (drop) or trained without the text before the cut (split)
        self.past_row = int((lengths[long] - (S + 1)).sum())
        mask = self.mask.tokens
        self.past_row_trained = sum(
            int(mask[a + S + 1 : a + n].sum(dtype=np.int64))
            for a, n in zip(first[long].tolist(), lengths[long].tolist())
        )
        if self.long == "drop":
            lengths[long] = S + 1
            # targets are a row's tokens 1..S: with no assistant token there it trains nothing
            empty = [i for i in long.tolist() if not mask[first[i] + 1 : first[i] + S + 1].any()]
            lengths[empty] = 0
            self.left_out = len(empty)
        count = np.where(lengths > 0, np.maximum(1, -(-(lengths - 1) // S)), 0)
        doc = np.repeat(np.arange(len(lengths)), count)
        k = np.arange(len(doc)) - np.repeat(np.cumsum(count) - count, count)  # piece within doc
        start = first[doc] + k * S
        length = np.minimum(S + 1, lengths[doc] - k * S)
        return start, length, int((count > 1).sum())

    def describe(self) -> str:
        """One line for the run's log: the packing, and what became of the samples longer than
        a row (`fitgpt train` prints the training split's)."""
        row = self.seq_len + 1
        head = (
            f"data: {self.num_documents:,} conversations ({self.name} split of "
            f"{self.data.prefix}) packed into {self.samples_per_epoch:,} rows of {row:,} tokens, "
            f"{self.fill:.0%} full"
        )
        if not self.long_samples:
            return f"{head}; none longer than a row"
        if self.long == "split":
            return (
                f"{head}; {self.long_samples:,} longer than a row, trained in pieces (--long "
                f"split): {self.past_row_trained:,} assistant tokens after a cut train without "
                "the text before it"
            )
        gone = (
            f"; {self.left_out:,} with no assistant token in their first row left out"
            if self.left_out
            else ""
        )
        return (
            f"{head}; {self.long_samples:,} longer than a row, trained on their first {row:,} "
            f"tokens (--long drop): {self.past_row:,} tokens after it not trained on, "
            f"{self.past_row_trained:,} of them the assistant's{gone}"
        )

    def _shuffle(self, e: int) -> np.ndarray:
        if e not in self._epochs:
            if len(self._epochs) >= EPOCHS_KEPT:
                self._epochs.pop(next(iter(self._epochs)))
            rng = np.random.default_rng([self.seed, SPLITS.index(self.name), e])
            self._epochs[e] = rng.permutation(self.samples_per_epoch)
        return self._epochs[e]

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """The packed row of each global sample index (int64 [n], values >= 0)."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if idx.size and idx.min() < 0:
            raise ValueError(f"sample indices must be >= 0, got {int(idx.min())}")
        epoch, k = np.divmod(idx, self.samples_per_epoch)
        return np.array([self._shuffle(int(e))[i] for e, i in zip(epoch, k)], dtype=np.int64)

    def get_packed(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Samples `idx` as (tokens int64, keep uint8, segment int32), each [n, seq_len + 1];
        padding is token 0 with keep 0. A Python loop over the rows' pieces: a micro-batch holds
        tens of them, microseconds each."""
        rows = self.rows(idx)
        width = self.seq_len + 1
        tokens = np.zeros((len(rows), width), dtype=np.int64)
        keep = np.zeros((len(rows), width), dtype=np.uint8)
        segment = np.zeros((len(rows), width), dtype=np.int32)
        for i, r in enumerate(rows.tolist()):
            a, b = int(self.row_ptr[r]), int(self.row_ptr[r + 1])
            pos = 0
            for s, (first, n) in enumerate(
                zip(self.piece_start[a:b].tolist(), self.piece_len[a:b].tolist())
            ):
                tokens[i, pos : pos + n] = self.data.tokens[first : first + n]
                keep[i, pos : pos + n] = self.mask.tokens[first : first + n]
                segment[i, pos : pos + n] = s
                pos += n
            segment[i, pos:] = b - a  # padding: a segment of its own
        return tokens, keep, segment

    def get(self, idx: np.ndarray) -> np.ndarray:
        """The tokens of samples `idx`, int64 [n, seq_len + 1] (SampleSource)."""
        return self.get_packed(idx)[0]


def recorded_long(prefix: str) -> str:
    """What `preprocess --chat --long` recorded for the data at `prefix`; the default for data
    recorded without it (made before it existed, or by another tool)."""
    from fitgpt.data import sidecar

    chat = (sidecar.read(prefix) or {}).get("chat")
    return chat.get("long", DEFAULT_LONG) if isinstance(chat, dict) else DEFAULT_LONG


def open_mask(data: IndexedDataset) -> IndexedDataset:
    """The loss-mask pair of `data`, checked to describe the same sequences with 0/1 bytes."""
    prefix = mask_prefix(data.prefix)
    mask = IndexedDataset(prefix)
    redo = "re-run `fitgpt data preprocess --chat` to write both"
    if mask.dtype != np.uint8:
        raise UserError(f"{prefix}.idx holds {mask.dtype} values, not a uint8 loss mask; {redo}")
    if not np.array_equal(mask.lengths, data.lengths) or not np.array_equal(
        mask.doc_idx, data.doc_idx
    ):
        raise UserError(
            f"{prefix}.idx describes other sequences than {data.prefix}.idx (a mask left from "
            f"older data?); {redo}, or delete the .loss_mask pair to train on every token"
        )
    return mask
