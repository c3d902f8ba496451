"""Tools over .bin/.idx pairs: make fake data, clean, merge, inspect.

All of them stream in chunks of about CHUNK_TOKENS tokens, so memory stays bounded whatever the
corpus size, and write through IndexedWriter (temporary names, renamed when complete). Each pair
written gets its tokenizer record (sidecar.py): fake records "no tokenizer" and its vocabulary,
clean and merge carry their inputs' record, and clean, merge and inspect refuse a tokenizer that
differs from the record. Output prefixes are checked before any work (outputs.py).
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from fitgpt.data import sidecar
from fitgpt.data.indexed import IndexedDataset, IndexedWriter, token_dtype
from fitgpt.data.outputs import check_prefix
from fitgpt.errors import UserError

CHUNK_TOKENS = 1 << 24  # 16M tokens: 32-64 MiB per chunk in flight


# ---- fake --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FakeConfig:
    output_prefix: str = field(metadata={"help": "writes OUTPUT_PREFIX.bin/.idx"})
    tokens: int = field(default=1 << 24, metadata={"help": "number of tokens (1e6, 100M, 2G work)"})
    vocab: int = field(default=50257, metadata={"help": "vocabulary size (ids 0..vocab-1)"})
    structure: Literal["markov", "uniform"] = field(
        default="markov",
        metadata={"help": "markov: learnable (each token has 4 successors); uniform: noise"},
    )
    doc_len: int = field(
        default=1024, metadata={"help": "mean document length; lengths uniform in 1..2·mean-1"}
    )
    seed: int = field(default=0, metadata={"help": "random seed"})

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise UserError(f"--tokens {self.tokens} must be at least 1")
        if not 2 <= self.vocab <= 2**31 - 1:
            raise UserError(f"--vocab {self.vocab} must be between 2 and 2^31-1")
        if self.structure not in ("markov", "uniform"):
            raise UserError(f"--structure {self.structure} is not markov or uniform")
        if self.doc_len < 1:
            raise UserError(f"--doc-len {self.doc_len} must be at least 1")
        if self.seed < 0:
            raise UserError(f"--seed {self.seed} must be 0 or more")


def fake(cfg: FakeConfig, progress: bool = False) -> IndexedDataset:
    """`cfg.tokens` synthetic tokens cut into documents."""
    from fitgpt.data.synthetic import markov_tokens, uniform_tokens  # imports torch: only here

    check_prefix(cfg.output_prefix)
    rng = np.random.default_rng([cfg.seed, 1])  # document lengths; tokens use their own streams
    with IndexedWriter(cfg.output_prefix, token_dtype(cfg.vocab)) as w, _bar(progress) as bar:
        task = bar.add_task("fake", total=cfg.tokens)
        for i, lo in enumerate(range(0, cfg.tokens, CHUNK_TOKENS)):
            n = min(CHUNK_TOKENS, cfg.tokens - lo)
            if cfg.structure == "markov":
                toks = markov_tokens(n, cfg.vocab, cfg.seed, stream=i)
            else:
                toks = uniform_tokens(n, cfg.vocab, seed=cfg.seed * 1_000_003 + i)
            w.add(toks, _doc_lengths(rng, n, cfg.doc_len))
            bar.advance(task, n)
    sidecar.write(cfg.output_prefix, None, vocab_size=cfg.vocab, made_by="fitgpt data fake")
    return IndexedDataset(cfg.output_prefix)


def _doc_lengths(rng: np.random.Generator, n: int, mean: int) -> np.ndarray:
    """Lengths uniform in [1, 2·mean-1], summing to exactly n (the last one cut short)."""
    lengths = rng.integers(1, 2 * mean, size=n // mean + 16)
    while lengths.sum() < n:
        lengths = np.concatenate([lengths, rng.integers(1, 2 * mean, size=n // mean + 16)])
    ends = np.cumsum(lengths)
    k = int(np.searchsorted(ends, n))  # the first document that reaches n
    lengths = lengths[: k + 1].copy()
    lengths[-1] -= ends[k] - n
    return lengths


# ---- clean -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CleanConfig:
    input: str = field(metadata={"help": "prefix of the .bin/.idx pair to clean"})
    output_prefix: str = field(metadata={"help": "writes OUTPUT_PREFIX.bin/.idx"})
    min_tokens: int = field(
        default=1, metadata={"help": "drop documents with fewer tokens than this"}
    )
    fix_unicode: bool = field(
        default=False,
        metadata={
            "help": "decode each document: drop it if it holds U+FFFD (bytes that were not "
            "UTF-8), re-encode it if NFC normalisation changes it"
        },
    )
    tokenizer: str = field(
        default="auto",
        metadata={
            "help": "tokenizer of the data, for --fix-unicode; auto: the one recorded with the "
            "data, else gpt2"
        },
    )

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            raise UserError(f"--min-tokens {self.min_tokens} must be 0 or more")
        if _same_prefix(self.input, self.output_prefix):
            raise UserError(f"--output-prefix {self.output_prefix} is the input; pick a new prefix")


@dataclass
class CleanReport:
    documents_in: int = 0
    documents_out: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> documents
    normalised: int = 0  # documents re-encoded after NFC normalisation

    def summary(self, prefix: str) -> str:
        why = ", ".join(f"{n:,} {r}" for r, n in sorted(self.dropped.items())) or "none"
        return "\n".join(
            [
                f"wrote {prefix}.bin/.idx",
                f"  documents  {self.documents_in:,} in, {self.documents_out:,} kept",
                f"  tokens     {self.tokens_in:,} in, {self.tokens_out:,} kept",
                f"  dropped    {why}",
                f"  normalised {self.normalised:,} documents re-encoded after NFC",
            ]
        )


def clean(cfg: CleanConfig, progress: bool = False) -> CleanReport:
    """Copy the documents of `cfg.input` that pass the filters to `cfg.output_prefix`."""
    _refuse_chat(cfg.input, "clean")
    data = IndexedDataset(cfg.input)
    check_prefix(cfg.output_prefix)
    record = sidecar.read(cfg.input)
    tok = None
    if cfg.fix_unicode:
        tok = sidecar.tokenizer_for(cfg.input, cfg.tokenizer, "cannot clean it (--fix-unicode)")
    if tok is not None and data.num_tokens and data.max_token() >= tok.vocab_size:
        raise UserError(
            f"{cfg.input} holds token ids up to {data.max_token()}, beyond the {tok.vocab_size} "
            f"of --tokenizer {cfg.tokenizer}; pass the tokenizer the data was made with"
        )
    doc_tokens = _document_tokens(data)
    report = CleanReport(documents_in=data.num_documents, tokens_in=int(doc_tokens.sum()))
    keep = doc_tokens >= cfg.min_tokens
    if not keep.any():  # refused before the writer opens: no empty pair is left behind
        if not len(keep):
            raise UserError(f"--input {cfg.input} holds no documents; there is nothing to clean")
        raise UserError(
            f"--min-tokens {cfg.min_tokens} would drop all {len(keep):,} documents of "
            f"{cfg.input} (the longest has {int(doc_tokens.max()):,} tokens); use at most that"
        )
    report.dropped[f"under {cfg.min_tokens} tokens"] = int((~keep).sum())
    with IndexedWriter(cfg.output_prefix, data.dtype) as w, _bar(progress) as bar:
        task = bar.add_task("clean", total=data.num_documents)
        for lo, hi in _document_chunks(data, doc_tokens):
            docs = np.flatnonzero(keep[lo:hi]) + lo
            if tok is None:
                _copy_documents(data, docs, w)
            else:
                for d in docs:
                    _fix_document(data, int(d), tok, w, report)
            bar.advance(task, hi - lo)
        if not w.num_documents:  # raised inside the writer, which then removes its files
            raise UserError(
                f"--fix-unicode would drop all {data.num_documents:,} documents of {cfg.input} "
                f"({report.dropped['holding U+FFFD']:,} hold U+FFFD); check --tokenizer "
                f"{cfg.tokenizer}, or clean without --fix-unicode"
            )
        report.documents_out, report.tokens_out = w.num_documents, w.num_tokens
    if record is not None:  # the tokenizer used, if any, had the recorded fingerprint
        sidecar.carry(cfg.output_prefix, record, made_by="fitgpt data clean")
    elif tok is not None:  # no record: the one every document was decoded (or re-encoded) with
        sidecar.write(cfg.output_prefix, tok, made_by="fitgpt data clean")
    report.dropped = Counter({k: v for k, v in report.dropped.items() if v})
    return report


def _fix_document(data: IndexedDataset, d: int, tok, w: IndexedWriter, report: CleanReport) -> None:
    seqs = range(int(data.doc_idx[d]), int(data.doc_idx[d + 1]))
    ids = np.concatenate([data[s] for s in seqs]) if len(seqs) else np.empty(0, data.dtype)
    text = tok.decode(ids.tolist())
    if "\ufffd" in text:
        report.dropped["holding U+FFFD"] += 1
        return
    nfc = unicodedata.normalize("NFC", text)
    if nfc == text:
        _copy_documents(data, np.array([d]), w)
        return
    new = np.asarray(tok.encode(nfc), dtype=np.int64)
    report.normalised += 1
    w.add(new, np.array([new.size]))


def _document_tokens(data: IndexedDataset) -> np.ndarray:
    """Tokens per document (int64 [D]); a document may hold several sequences."""
    cum = np.zeros(data.num_sequences + 1, dtype=np.int64)
    np.cumsum(data.lengths, out=cum[1:])
    return cum[data.doc_idx[1:]] - cum[data.doc_idx[:-1]]


def _document_chunks(data: IndexedDataset, doc_tokens: np.ndarray):
    """[lo, hi) document ranges of about CHUNK_TOKENS tokens each (at least one document)."""
    ends = np.cumsum(doc_tokens)
    lo = 0
    while lo < len(doc_tokens):
        base = ends[lo - 1] if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, base + CHUNK_TOKENS, side="right")))
        yield lo, hi
        lo = hi


def _copy_documents(data: IndexedDataset, docs: np.ndarray, w: IndexedWriter) -> None:
    """Append documents `docs` (sorted ids) with their sequence structure, in one gather."""
    if not len(docs):
        return
    first, last = data.doc_idx[docs], data.doc_idx[docs + 1]
    per_doc = last - first
    seqs = np.repeat(first - (np.cumsum(per_doc) - per_doc), per_doc) + np.arange(per_doc.sum())
    lengths = data.lengths[seqs].astype(np.int64)
    starts = data.pointers[seqs] // data.dtype.itemsize  # in tokens
    pos = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(lengths.sum())
    w.add(np.asarray(data.tokens[pos]), lengths, doc_ends=np.cumsum(per_doc))


# ---- merge -------------------------------------------------------------------------------------
def merge(inputs: list[str], output_prefix: str, force: bool = False, progress: bool = False):
    """Concatenate several .bin/.idx pairs, keeping every document boundary.

    Token dtypes must agree, or be widened within 16 bits (uint8 into uint16). Megatron picks
    uint16 for vocabularies under 65500 and int32 above, so a 16-bit input next to a 32-bit one
    means two different tokenizers: an error unless `force`. Inputs whose records name different
    tokenizers are refused the same way.
    """
    if len(inputs) < 2:
        raise UserError(f"merge needs at least two input prefixes, got {len(inputs)}")
    if any(_same_prefix(p, output_prefix) for p in inputs):
        raise UserError(f"--output-prefix {output_prefix} is also an input; pick a new prefix")
    for p in inputs:
        _refuse_chat(p, "merge")
    sets = [IndexedDataset(p) for p in inputs]
    check_prefix(output_prefix)
    record = _merged_record(inputs, force)
    for d in sets:
        if d.dtype.kind not in "iu":
            raise UserError(f"{d.prefix}.idx holds {d.dtype} values, not token ids")
    if not sum(d.num_documents for d in sets):
        raise UserError(
            f"the inputs {', '.join(inputs)} hold no documents; there is nothing to merge"
        )
    dtype = np.result_type(*(d.dtype for d in sets))
    wide = {d.dtype.itemsize > 2 for d in sets}
    if len(wide) > 1 and not force:
        kinds = ", ".join(f"{d.prefix} {d.dtype}" for d in sets)
        raise UserError(
            f"the inputs' token dtypes differ ({kinds}): Megatron writes uint16 for a vocabulary "
            "under 65500 and int32 above, so they come from different tokenizers; pass --force "
            "to merge anyway into int32"
        )
    with IndexedWriter(output_prefix, dtype) as w, _bar(progress) as bar:
        task = bar.add_task("merge", total=sum(d.num_tokens for d in sets))
        for d in sets:
            doc_tokens = _document_tokens(d)
            for lo, hi in _document_chunks(d, doc_tokens):
                _copy_documents(d, np.arange(lo, hi), w)
                bar.advance(task, int(doc_tokens[lo:hi].sum()))
    if record is not None:
        common, vocab = record
        sidecar.carry(output_prefix, common, "fitgpt data merge", vocab_size=vocab)
    return IndexedDataset(output_prefix)


def _merged_record(inputs: list[str], force: bool) -> tuple[dict, int] | None:
    """(the inputs' common tokenizer record, the largest vocabulary), or None when any input
    has no record; inputs recording different tokenizers are refused unless `force`."""
    records = [sidecar.read(p) for p in inputs]
    known = [(p, r) for p, r in zip(inputs, records) if r is not None]
    if len({r["fingerprint"] for _, r in known}) > 1:
        if not force:
            kinds = ", ".join(f"{p}: {sidecar.describe(r)}" for p, r in known)
            raise UserError(
                f"the inputs were made with different tokenizers ({kinds}); merging mixes their "
                "ids: pass --force to merge anyway (the output then records no tokenizer)"
            )
        return None
    if len(known) < len(inputs):
        return None  # a pair made elsewhere: its tokenizer is unknown, so the output's is too
    return records[0], max(r["vocab_size"] for r in records)  # type: ignore[index]


def _same_prefix(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


# ---- inspect -----------------------------------------------------------------------------------
def _refuse_chat(prefix: str, what: str) -> None:
    """clean and merge copy tokens only: chat data would lose its loss mask and then train as
    plain text, on every token."""
    from fitgpt.data.chat import is_chat_data

    if is_chat_data(prefix):  # also refuses chat data that lost its mask
        raise UserError(
            f"{prefix} is chat data (with a .loss_mask pair), which `fitgpt data {what}` cannot "
            "carry; run `fitgpt data preprocess --chat` on the JSONL files joined instead"
        )


def inspect(prefix: str, tokenizer: str = "auto", documents: int = 1, chars: int = 400) -> str:
    """A one-screen description: counts, dtype, length statistics and histogram, decoded text.

    `tokenizer` auto decodes with the tokenizer recorded with the data (gpt2 without a record,
    nothing for fake data); 'none' decodes nothing.
    """
    from fitgpt.data.gpt_dataset import max_token

    if documents < 0:
        raise UserError(f"--docs {documents} is negative; pass how many documents to decode (0+)")
    if chars < 1:
        raise UserError(f"--chars {chars} must be at least 1")
    data = IndexedDataset(prefix)
    tok, about = _inspect_tokenizer(prefix, tokenizer)
    lengths = _document_tokens(data)
    top = max_token(data)  # one pass over the .bin, then cached next to it
    lines = [
        f"{prefix}.bin/.idx: MMIDIDX version 1, {data.dtype.name} tokens",
        f"  documents  {data.num_documents:,} ({data.num_sequences:,} sequences)",
        f"  tokens     {data.num_tokens:,}, largest id {top} (a vocabulary of >= {top + 1})",
        f"  tokenizer  {about}",
    ]
    from fitgpt.data.chat import has_mask, mask_prefix

    if has_mask(prefix):
        trained = int(IndexedDataset(mask_prefix(prefix)).tokens.sum(dtype=np.int64))
        share = trained / max(data.num_tokens, 1)
        lines.append(f"  chat data  loss on {trained:,} assistant tokens ({share:.0%}), .loss_mask")
    if data.num_documents:
        lines.append(
            f"  length     min {lengths.min():,}  median {np.median(lengths):,.0f}  "
            f"mean {lengths.mean():,.1f}  max {lengths.max():,} tokens"
        )
        lines += ["  documents by length in tokens:", *_histogram(lengths)]
    if tok is None or not data.num_documents:
        return "\n".join(lines)
    if top >= tok.vocab_size:
        lines.append(f"  (not decoded: ids reach {top}, beyond {tok.name}'s {tok.vocab_size})")
        return "\n".join(lines)
    for d in range(min(documents, data.num_documents)):
        seqs = range(int(data.doc_idx[d]), int(data.doc_idx[d + 1]))
        ids = [int(t) for s in seqs for t in data[s]]
        text = tok.decode(ids)
        cut = f" ... ({len(text) - chars:,} more characters)" if len(text) > chars else ""
        lines.append(f"  document {d} ({len(ids):,} tokens, {tok.name}): {text[:chars]!r}{cut}")
    return "\n".join(lines)


def _inspect_tokenizer(prefix: str, spec: str):
    """(tokenizer to decode with or None, one line about the data's tokenizer record)."""
    record = sidecar.read(prefix)
    recorded = (
        f"{sidecar.describe(record)}, recorded in {sidecar.path(prefix).name}"
        if record is not None
        else "not recorded (a pair made outside fitgpt)"
    )
    if spec == "none" or (spec == "auto" and record is not None and record["tokenizer"] is None):
        return None, recorded
    tok = sidecar.tokenizer_for(prefix, spec, "cannot decode it")
    return tok, recorded + ("" if record is not None else f"; decoding with {tok.name}")


def _histogram(lengths: np.ndarray, width: int = 40) -> list[str]:
    """Power-of-two buckets: 0, 1, 2-3, 4-7, ...; bars scaled to the largest bucket."""
    bucket = np.where(lengths > 0, np.floor(np.log2(np.maximum(lengths, 1))).astype(int) + 1, 0)
    counts = np.bincount(bucket)
    rows = []
    for b in range(int(bucket.min()), len(counts)):  # from the first non-empty bucket
        n = counts[b]
        lo, hi = (0, 0) if b == 0 else (1 << (b - 1), (1 << b) - 1)
        bar = "#" * round(width * int(n) / int(counts.max()))
        rows.append(f"    {lo:>9,}-{hi:<9,} {n:>10,} {bar}")
    return rows


def _bar(enabled: bool):
    from rich.progress import BarColumn, TaskProgressColumn, TextColumn

    from fitgpt.data.bar import transient_bar

    # erased when the work ends: a refusal found during it (clean's --fix-unicode keeping
    # nothing) is the one line on stderr
    return transient_bar(
        enabled, TextColumn("{task.description}"), BarColumn(), TaskProgressColumn()
    )
