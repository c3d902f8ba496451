"""JSON lines → tokenized .bin/.idx, the Megatron way, in constant memory.

The main process reads the input (plain or gzip) as a stream of ~1 MiB chunks cut at line ends
and hands them to worker processes, which parse JSON, tokenize and return token arrays. Results
are taken back in input order, so the output bytes never depend on the worker count, and at most
two chunks per worker are in flight, so memory stays constant whatever the input size.

Per line: blank lines are ignored; malformed JSON, a line that is not an object, a missing key or
a non-string value is skipped and counted (or fatal with --on-error fail); non-UTF-8 bytes are
replaced by U+FFFD and counted (or the line skipped, or fatal, by --on-bad-utf8); a document with
no tokens is kept and counted, as Megatron's tools/preprocess_data.py keeps it: a document of no
sequence (its document-index entry repeats the one before), with no <|endoftext|> even under
--append-eod, so the .idx is byte-identical to Megatron's. JSON that is valid but beyond the parser (nesting too deep,
an integer of more than 4,300 digits) counts as malformed. A damaged gzip stream ends the input at
the last whole line read: skipped and reported (or fatal) like a bad line. Every problem is
reported as FILE:LINE.

With --chat, each line is a conversation (`{"messages": [...]}` or `{"prompt": ..., "response":
...}`) rendered by the tokenizer folder's chat template and tokenized (fitgpt/data/chat.py); a
second pair, PREFIX.loss_mask.bin/.idx, holds a uint8 0/1 per token, 1 on the assistant's
tokens, with the same sequences as the tokens' pair. Every bad conversation is fatal, whatever
--on-error says, in one line naming FILE:LINE and the fix: a conversation silently dropped
from an instruction set is a change to the fine-tune nobody asked for. A conversation with an
assistant reply of no text is a bad line by --on-error (skipped and counted, or fatal), and a
file where most replies have none is refused. With --seq-len, conversations longer than a row
of training are counted (or refused, --long refuse); what training does with them (--long, kept
in the record) is packed.py's.

Failures leave nothing behind: an input giving no tokens is an error (no empty pair), the
output location is checked before any work, and a failed write (full disk) removes every
temporary (IndexedWriter). Worker processes die with the main process, even when it is killed
with SIGKILL (Linux: PR_SET_PDEATHSIG; elsewhere a watchdog thread).
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import time
import zlib
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np

from fitgpt.data import sidecar
from fitgpt.data.bar import transient_bar
from fitgpt.data.chat import (
    ASSISTANT,
    CHAT_MADE_BY,
    CHAT_SUFFIX,
    JSON_ARRAY,
    ChatEncoder,
    ChatLineError,
    conversation,
    mask_prefix,
)
from fitgpt.data.indexed import LOSS_MASK_SUFFIX, IndexedWriter, paths, token_dtype
from fitgpt.data.outputs import check_prefix
from fitgpt.data.packed import DEFAULT_LONG, LONG_CHOICES
from fitgpt.data.tokenizer import load_tokenizer
from fitgpt.errors import UserError
from fitgpt.procs import die_with_parent

MAX_SHOWN = 10  # problems printed as they happen; the rest are only counted
# A chat file where more than this share of the assistant replies has no text is refused, not
# trained with those lines skipped: the replies were lost (written under another key, a failed
# generation run), and what would remain is a fine-tune on a fraction of what the user thinks
# the file holds. Below it, the lines with an empty reply are few enough to skip and count.
MOST_BLANK = 0.5
WORKERS_PER_CORE = 4  # more only adds memory (two chunks in flight per worker)
# Other compressions, by their first bytes: named in the error instead of read as garbage.
OTHER_MAGIC = {
    b"BZh": "bzip2",
    b"\xfd7zXZ": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"PK\x03\x04": "zip",
}


@dataclass(frozen=True)
class PreprocessConfig:
    input: str = field(metadata={"help": "JSON-lines file, optionally gzip-compressed"})
    output_prefix: str = field(
        metadata={"help": "writes OUTPUT_PREFIX_{json_key}_document.bin/.idx (Megatron naming)"}
    )
    json_key: str = field(default="text", metadata={"help": "the key holding each document"})
    tokenizer: str = field(
        default="gpt2", metadata={"help": "gpt2, bytes, VOCAB.json,MERGES.txt, or a DIR"}
    )
    workers: int = field(
        default=1,
        metadata={"help": "tokenizing processes; 0 tokenizes in this process (tiny inputs)"},
    )
    append_eod: bool = field(
        default=False,
        metadata={
            "help": "end every document with the tokenizer's end-of-document token "
            "(<|endoftext|>, Llama 3's <|end_of_text|>, else its eos_token)"
        },
    )
    chat: bool = field(
        default=False,
        metadata={
            "help": 'lines are conversations ({"messages": [...]} or {"prompt", "response"}): '
            "render them with the tokenizer folder's chat template, loss on the assistant's "
            "tokens only (PREFIX.loss_mask.bin/.idx); writes OUTPUT_PREFIX_chat_document"
        },
    )
    seq_len: int | None = field(
        default=None,
        metadata={
            "help": "--chat: the --seq-len you will train at; conversations longer than a row "
            "(seq_len + 1 tokens) are counted, and refused with --long refuse"
        },
    )
    long: Literal["drop", "split", "refuse"] = field(
        default=DEFAULT_LONG,
        metadata={
            "help": "--chat: a conversation longer than a training row: drop (train its first "
            "row, drop the rest, as TRL's SFTTrainer truncates), split (train every piece, the "
            "later ones without the text before the cut), or refuse; recorded with the data"
        },
    )
    on_error: Literal["skip", "fail"] = field(
        default="skip",
        metadata={
            "help": "malformed JSON, missing key, non-string value (--chat: an empty assistant "
            "reply): skip the line, or stop"
        },
    )
    on_bad_utf8: Literal["replace", "skip", "fail"] = field(
        default="replace",
        metadata={"help": "non-UTF-8 bytes: replace by U+FFFD, skip the line, or stop"},
    )
    chunk_bytes: int = field(default=1 << 20, metadata={"help": "bytes per worker task"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar on stderr"})

    def __post_init__(self) -> None:
        if not Path(self.input).is_file():
            raise UserError(f"--input {self.input} does not exist; pass a .jsonl or .jsonl.gz file")
        if self.workers < 0:
            raise UserError(f"--workers {self.workers} is negative; use 1 or more (0 = inline)")
        most = WORKERS_PER_CORE * (os.cpu_count() or 1)
        if self.workers > most:
            raise UserError(
                f"--workers {self.workers} is more than {WORKERS_PER_CORE} per core ({most} "
                f"here); use at most the number of cores, {os.cpu_count()}"
            )
        if self.on_error not in ("skip", "fail"):
            raise UserError(f"--on-error {self.on_error} is not skip or fail")
        if self.on_bad_utf8 not in ("replace", "skip", "fail"):
            raise UserError(f"--on-bad-utf8 {self.on_bad_utf8} is not replace, skip or fail")
        if self.chunk_bytes < 1:
            raise UserError(f"chunk_bytes {self.chunk_bytes} must be positive")
        if not self.json_key:
            raise UserError("--json-key is empty; name the key that holds each document's text")
        if self.long not in LONG_CHOICES:
            raise UserError(f"--long {self.long} is not one of {', '.join(LONG_CHOICES)}")
        if self.seq_len is not None and self.seq_len < 1:
            raise UserError(f"--seq-len {self.seq_len} must be at least 1 (the training one)")
        if not self.chat and (self.seq_len is not None or self.long != DEFAULT_LONG):
            raise UserError(
                "--seq-len and --long are for conversations longer than a training row: pass "
                "--chat, or drop them (text documents are cut into samples at any length)"
            )
        if self.chat and self.append_eod:
            raise UserError(
                "--append-eod is for text documents; with --chat the template ends each turn "
                "itself: drop --append-eod"
            )

    @property
    def prefix(self) -> str:
        return self.output_prefix + (CHAT_SUFFIX if self.chat else f"_{self.json_key}_document")


@dataclass
class PreprocessReport:
    prefix: str
    dtype: str
    documents: int = 0
    tokens: int = 0
    lines: int = 0
    bytes_in: int = 0  # uncompressed input bytes
    seconds: float = 0.0
    skipped: Counter = field(default_factory=Counter)  # reason -> lines skipped
    empty: int = 0  # documents with no tokens, kept (of `documents`) as Megatron keeps them
    trained: int | None = None  # --chat: tokens the loss counts (the assistant's); else None
    replaced_utf8: int = 0  # lines kept with U+FFFD in place of bad bytes or lone surrogates
    chat: ChatCounts | None = None  # --chat: replies and long conversations
    shown: list[str] = field(default_factory=list)  # the first problems, as FILE:LINE: message
    printed: int = 0  # of `shown`, printed as warnings so far

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_in / 1e6 / max(self.seconds, 1e-9)

    def summary(self) -> str:
        per_doc = self.tokens / max(self.documents, 1)
        rows = [
            f"wrote {self.prefix}.bin/.idx ({self.dtype} tokens)",
            f"  documents  {self.documents:,}   tokens {self.tokens:,} ({per_doc:,.0f} per document)",
            f"  input      {self.bytes_in / 1e6:,.1f} MB, {self.lines:,} lines in "
            f"{self.seconds:,.1f} s: {self.mb_per_s:,.2f} MB/s, {self.tokens_per_s:,.0f} tokens/s",
            f"  empty      {self.empty:,} documents with no tokens (kept, as Megatron does)",
            "  skipped    "
            + (", ".join(f"{n:,} {why}" for why, n in sorted(self.skipped.items())) or "0 lines"),
            f"  repaired   {self.replaced_utf8:,} lines with non-UTF-8 bytes or lone "
            "surrogates (replaced by U+FFFD)",
        ]
        if self.trained is not None:
            share = self.trained / max(self.tokens, 1)
            rows[0] += f" and {self.prefix}{LOSS_MASK_SUFFIX}.bin/.idx (loss mask)"
            rows.insert(2, f"  loss on    {self.trained:,} assistant tokens ({share:.0%})")
        if self.chat is not None:
            rows[3:3] = self.chat.rows()
        return "\n".join(rows)


@dataclass
class ChatCounts:
    """--chat: the assistant replies read and the conversations longer than a training row."""

    seq_len: int | None = None  # --seq-len: a row is seq_len + 1 tokens; None: not counted
    long_policy: str = DEFAULT_LONG
    replies: int = 0  # assistant replies of the conversations read (skipped lines too)
    blank: int = 0  # of them, with no text but whitespace (their lines skipped)
    long: int = 0  # conversations longer than a row (kept)
    past_row: int = 0  # their tokens after the first row
    past_row_trained: int = 0  # of those, the assistant's
    longest: int = 0  # tokens of the longest conversation kept
    first_blank: int = 0  # the line of the first reply with no text; 0: none

    def add(self, other: ChatCounts) -> None:
        for name in ("replies", "blank", "long", "past_row", "past_row_trained"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.longest = max(self.longest, other.longest)
        self.first_blank = self.first_blank or other.first_blank  # chunks come in input order

    def rows(self) -> list[str]:
        replies = f"  replies    {self.replies:,} assistant replies, {self.blank:,} with no text"
        replies += " (their lines skipped)" if self.blank else ""
        if self.seq_len is None:
            return [
                replies,
                f"  long       not counted: the longest conversation has {self.longest:,} "
                "tokens; pass --seq-len (the training one) to count those longer than a row",
            ]
        row = f"a row of {self.seq_len + 1:,} tokens (--seq-len {self.seq_len})"
        if not self.long:
            return [
                replies,
                f"  long       none longer than {row}; the longest has {self.longest:,}",
            ]
        what = {
            "drop": f"trained on their first row only (--long drop), the {self.past_row:,} "
            f"tokens after it dropped, {self.past_row_trained:,} of them the assistant's",
            "split": f"trained in pieces (--long split), {self.past_row_trained:,} assistant "
            "tokens after a cut without the text before it",
        }[self.long_policy]
        return [replies, f"  long       {self.long:,} conversations longer than {row}: {what}"]


def preprocess(cfg: PreprocessConfig) -> PreprocessReport:
    """Tokenize `cfg.input` into `cfg.prefix`.bin/.idx (+ the tokenizer record, sidecar.py);
    the outputs appear only when complete, and only if they hold at least one token."""
    check_prefix(cfg.output_prefix)  # as typed: `adir/` would write `adir/_text_document`
    check_prefix(cfg.prefix)
    tok = load_tokenizer(cfg.tokenizer)
    if cfg.append_eod and tok.eod_id is None:
        raise UserError(
            f"--append-eod needs a tokenizer with an end-of-document token (<|endoftext|>, "
            f"<|end_of_text|> or an eos_token); {cfg.tokenizer} has none"
        )
    if cfg.chat:
        ChatEncoder(tok)  # no template, or one that does not compile: refused before any input
    dtype = token_dtype(tok.vocab_size)
    state = _State(
        cfg.tokenizer,
        cfg.json_key,
        cfg.append_eod,
        cfg.on_error,
        cfg.on_bad_utf8,
        dtype.str,
        parent_pid=os.getpid(),
        chat=cfg.chat,
        seq_len=cfg.seq_len,
        long=cfg.long,
    )
    report = PreprocessReport(prefix=cfg.prefix, dtype=dtype.name, trained=0 if cfg.chat else None)
    if cfg.chat:
        report.chat = ChatCounts(seq_len=cfg.seq_len, long_policy=cfg.long)
    damage: list[tuple[int, str]] = []  # (first unread line, error) of a damaged gzip stream
    start = time.perf_counter()
    with (
        _open_input(cfg.input) as (stream, raw),
        _mask_writer(cfg) as masks,  # listed first: finishes after the tokens' pair
        IndexedWriter(cfg.prefix, dtype) as writer,
        _progress_bar(cfg.progress, os.path.getsize(cfg.input)) as (bar, task),
        contextlib.closing(
            _encoded(_chunks(stream, cfg.chunk_bytes, damage), cfg.workers, state)
        ) as out,
    ):
        for chunk in out:
            _take(chunk, writer, masks, report, cfg)
            if not cfg.chat:  # chat: once the whole file is known (_mostly_blank)
                _warn(report, bar)
            report.seconds = time.perf_counter() - start
            docs, toks, mbps = report.documents, report.tokens, report.mb_per_s
            bar.update(task, completed=raw.tell(), docs=docs, tokens=toks, mbps=mbps)
        for line, err in damage:
            _damaged(cfg, report, line, err)
        if report.chat is not None and report.chat.blank > MOST_BLANK * report.chat.replies:
            raise _mostly_blank(cfg, report)  # inside `with`: the writers remove their temporaries
        _warn(report, bar)
        if report.tokens == 0:  # raised inside `with`: the writer removes its temporaries
            raise _no_documents(cfg, report)
    report.seconds = time.perf_counter() - start
    if cfg.chat:  # the policy on long conversations travels with the data to training
        extra = {"chat": {"long": cfg.long, "seq_len": cfg.seq_len}}
        sidecar.write(cfg.prefix, tok, made_by=CHAT_MADE_BY, extra=extra)
    else:
        sidecar.write(cfg.prefix, tok, made_by="fitgpt data preprocess")
    return report


def _mostly_blank(cfg: PreprocessConfig, report: PreprocessReport) -> UserError:
    c = report.chat
    return UserError(
        f"{cfg.input}: {c.blank:,} of {c.replies:,} assistant replies have no text (the first "
        f"on line {c.first_blank}), more than {MOST_BLANK:.0%}: the replies look lost (empty "
        "in the export, or a generation that failed); fix the file; nothing written"
    )


@contextlib.contextmanager
def _mask_writer(cfg: PreprocessConfig) -> Iterator[IndexedWriter | None]:
    """The loss-mask pair of a --chat run (None otherwise), finished after the tokens' pair
    (whose finish removes any older mask); if it cannot be finished, the tokens' pair is
    removed too: without its mask it would train as plain text."""
    if not cfg.chat:
        yield None
        return
    masks = IndexedWriter(mask_prefix(cfg.prefix), np.uint8)
    try:
        yield masks
    except BaseException:
        masks.abort()
        raise
    try:
        masks.finish()
    except BaseException:
        masks.abort()
        for p in paths(cfg.prefix):
            p.unlink(missing_ok=True)
        raise


def _damaged(cfg: PreprocessConfig, report: PreprocessReport, line: int, err: str) -> None:
    where = f"{cfg.input}:{line}: the gzip stream is damaged here ({err})"
    if cfg.on_error == "fail":
        raise UserError(
            f"{where}; repair the file, or pass --on-error skip to keep the lines before"
        )
    why, msg = "damaged gzip stream (rest of file)", where + "; the rest is skipped"
    _problem(cfg, report, line, why, msg, "refuse" if cfg.chat else "skip")


def _no_documents(cfg: PreprocessConfig, report: PreprocessReport) -> UserError:
    """One line: why the input gave nothing, with the first problem (a wrong --json-key shows
    the keys the lines do have)."""
    if not report.lines and not report.skipped:
        return UserError(f"{cfg.input}: the input holds no lines; nothing written")
    why = [f"{n:,} {r}" for r, n in sorted(report.skipped.items())]
    if report.empty:
        why.append(f"{report.empty:,} empty documents")
    first = f"; line {report.shown[0][len(cfg.input) + 1 :]}" if report.shown else ""
    what = "no tokens" if report.documents else "no documents"  # only empty ones: no tokens
    return UserError(
        f"{cfg.input}: {what} in {report.lines:,} lines ({', '.join(why) or 'all blank'})"
        f"{first}; nothing written"
    )


def _problem(
    cfg: PreprocessConfig, report: PreprocessReport, line: int, why: str, msg: str, policy: str
) -> None:
    """Count (and keep the first MAX_SHOWN of) one skipped line, or stop: under policy 'fail'
    naming the flag that would skip it, under 'refuse' (a bad conversation, whatever the flags
    say) with the fix its message carries."""
    where = msg if msg.startswith(f"{cfg.input}:") else f"{cfg.input}:{line}: {msg}"
    if policy == "refuse":
        raise UserError(where)
    if policy == "fail":
        fix = "--on-bad-utf8 replace" if why == "invalid UTF-8" else "--on-error skip"
        raise UserError(f"{where}; fix the line or pass {fix}")
    report.skipped[why] += 1
    if len(report.shown) < MAX_SHOWN:
        report.shown.append(where)


def _warn(report: PreprocessReport, bar) -> None:
    """Print the problems kept since the last call, once there is a token: an input that gives
    none ends in one error line (naming the first problem) instead of a page of warnings."""
    if report.tokens:
        for where in report.shown[report.printed :]:
            bar.console.print(f"warning: {where}", markup=False, highlight=False, soft_wrap=True)
        report.printed = len(report.shown)


def _take(
    chunk: _Chunk,
    writer: IndexedWriter,
    masks: IndexedWriter | None,
    report: PreprocessReport,
    cfg: PreprocessConfig,
) -> None:
    """Account for one encoded chunk (in input order) and append its documents."""
    for line, why, message, policy in chunk.problems:
        _problem(cfg, report, line, why, message, policy)
    writer.add(chunk.tokens, chunk.lengths, chunk.doc_ends)
    if masks is not None:
        masks.add(chunk.mask, chunk.lengths, chunk.doc_ends)
        report.trained += int(chunk.mask.sum(dtype=np.int64))
    report.documents += len(chunk.doc_ends)
    report.tokens += int(chunk.tokens.size)
    report.lines += chunk.lines
    report.bytes_in += chunk.nbytes
    report.empty += chunk.empty
    report.replaced_utf8 += chunk.replaced
    if chunk.chat is not None:
        report.chat.add(chunk.chat)


@contextlib.contextmanager
def _open_input(path: str) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """(stream of uncompressed bytes, the raw file, whose position drives the progress bar)."""
    with open(path, "rb") as raw:
        head = raw.read(6)
        raw.seek(0)
        gz = head[:2] == b"\x1f\x8b"
        other = next((name for magic, name in OTHER_MAGIC.items() if head.startswith(magic)), None)
        if other:
            raise UserError(f"{path} is {other}-compressed; only gzip is read: decompress it first")
        if not gz and path.endswith(".gz"):
            raise UserError(
                f"{path} is named .gz but is not gzip (it starts with {head!r}); rename or "
                "recompress it"
            )
        if not gz:
            yield raw, raw
            return
        with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            yield stream, raw  # type: ignore[misc]


# what Notepad, Excel and PowerShell put first in a UTF-8 file; json.loads refuses it, so the
# first line of such a file was "malformed JSON" (Python's utf-8-sig codec drops it too)
UTF8_BOM = b"\xef\xbb\xbf"


def _chunks(
    stream: BinaryIO, size: int, damage: list[tuple[int, str]]
) -> Iterator[tuple[bytes, int]]:
    """(~size bytes ending at a line end, number of its first line).

    A stream that fails to read (a damaged or truncated gzip: zlib.error, EOFError,
    BadGzipFile) ends here, after the whole lines read so far; (first unread line, error) goes
    to `damage` for the caller to skip or fail on, in input order, after the last chunk.
    """
    line, block = 1, bytearray()
    try:
        while True:
            # In pieces of 16 KiB: a read that fails (damaged gzip) loses only its own piece.
            block = bytearray()
            while len(block) < size and (piece := stream.read(min(size - len(block), 1 << 14))):
                block += piece
            if not block:
                return
            if not block.endswith(b"\n"):
                block += stream.readline()
            if line == 1 and block.startswith(UTF8_BOM):  # Windows editors' mark, not text
                del block[: len(UTF8_BOM)]
            yield bytes(block), line
            line += block.count(b"\n")
    except (OSError, EOFError, zlib.error) as e:
        whole = bytes(block[: block.rfind(b"\n") + 1])  # the whole lines read before the damage
        if whole:
            yield whole, line
            line += whole.count(b"\n")
        damage.append((line, f"{type(e).__name__}: {e}"))


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int):
    from rich.progress import (
        BarColumn,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("preprocess"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[docs]:,} docs  {task.fields[tokens]:,} tokens"),
        TextColumn("{task.fields[mbps]:.2f} MB/s"),
        TimeRemainingColumn(),
    )
    # erased when it ends, so a failure leaves only its one error line (the summary printed on
    # success says what the bar said)
    with transient_bar(enabled, *columns) as bar:
        yield bar, bar.add_task("preprocess", total=total, docs=0, tokens=0, mbps=0.0)


def _encoded(chunks: Iterator[tuple[bytes, int]], workers: int, state: _State) -> Iterator[_Chunk]:
    """Encoded chunks in input order; at most 2 per worker in flight (constant memory)."""
    if workers == 0:
        _init(state)
        for chunk in chunks:
            yield _encode(*chunk)
        return
    # spawn, not fork: the parent may hold threads (rich, torch, tokenizers' pool). An executor,
    # not mp.Pool: a worker that dies (killed, out of memory) fails the run instead of hanging it.
    pool = ProcessPoolExecutor(
        workers, mp_context=mp.get_context("spawn"), initializer=_init, initargs=(state,)
    )
    try:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.submit(_encode, *chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool as e:
        raise UserError(f"a tokenizing worker died ({e}); retry with fewer --workers") from e
    except BaseException:  # Ctrl-C, a fatal line, or the consumer closing us: stop at once
        for p in list((getattr(pool, "_processes", None) or {}).values()):
            p.terminate()  # rather than wait up to a chunk's tokenizing time per worker
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ---- the worker side: everything below runs in the tokenizing processes ----


@dataclass(frozen=True)
class _State:
    tokenizer: str
    json_key: str
    append_eod: bool
    on_error: str
    on_bad_utf8: str
    dtype: str
    parent_pid: int = 0  # the main process: workers exit when it is gone
    chat: bool = False
    seq_len: int | None = None  # --chat: a training row is seq_len + 1 tokens
    long: str = DEFAULT_LONG


@dataclass
class _Chunk:
    tokens: np.ndarray  # flat, output dtype
    lengths: np.ndarray  # int32 [sequences]: one per document that has tokens
    doc_ends: np.ndarray  # int64 [documents]: sequences of this chunk up to each document's end
    problems: list[tuple[int, str, str, str]]  # (line, reason, message, skip|fail|refuse)
    lines: int
    nbytes: int
    empty: int
    replaced: int
    mask: np.ndarray | None = None  # --chat: uint8, flat like tokens: 1 on the assistant's tokens
    chat: ChatCounts | None = None  # --chat


_WORKER: dict = {}


def _init(state: _State) -> None:
    if mp.parent_process() is not None:
        die_with_parent(state.parent_pid)  # even a SIGKILLed main process leaves no worker
        # One thread per worker: the worker count is the number of cores used.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        # Ctrl-C is the main process's to handle: it stops the pool and removes the temporaries.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    tok = load_tokenizer(state.tokenizer)
    _WORKER.update(state=state, tok=tok, chat=ChatEncoder(tok) if state.chat else None)


def _encode(block: bytes, first_line: int) -> _Chunk:
    if _WORKER["chat"] is not None:
        return _encode_chat(block, first_line)
    state: _State = _WORKER["state"]
    tok = _WORKER["tok"]
    texts, problems, replaced = [], [], 0
    raw_lines = block.split(b"\n")
    if raw_lines and not raw_lines[-1]:
        raw_lines.pop()  # the piece after the final newline
    for n, raw in enumerate(raw_lines, first_line):
        if not raw.strip():
            continue
        text, problem, fixed = _document(raw, state)
        replaced += fixed
        if problem is not None:
            why, msg, fatal = problem
            problems.append((n, why, msg, "fail" if fatal else "skip"))
        else:
            texts.append(text)
    ids = tok.encode_batch(texts) if hasattr(tok, "encode_batch") else map(tok.encode, texts)
    kept, ends, empty = [], [], 0
    for doc in ids:
        if doc:
            kept.append([*doc, tok.eod_id] if state.append_eod else doc)
        else:  # Megatron's rule: a document of no sequence, and no <|endoftext|> for it either
            empty += 1  # counted, not reported line by line: empty documents are common
        ends.append(len(kept))
    lengths = np.fromiter(map(len, kept), np.int32, count=len(kept))
    doc_ends = np.asarray(ends, dtype=np.int64)
    flat = itertools.chain.from_iterable(kept)
    tokens = np.fromiter(flat, np.dtype(state.dtype), count=int(lengths.sum()))
    return _Chunk(tokens, lengths, doc_ends, problems, len(raw_lines), len(block), empty, replaced)


def _encode_chat(block: bytes, first_line: int) -> _Chunk:
    """--chat: each non-blank line one conversation, as tokens and their loss mask; the first
    bad line ends the chunk as a fatal problem (the main process stops there). A line with an
    assistant reply of no text is a bad line by --on-error; one longer than a row of --seq-len
    is counted, or fatal under --long refuse."""
    state: _State = _WORKER["state"]
    chat: ChatEncoder = _WORKER["chat"]
    ids, masks, problems, replaced = [], [], [], 0
    counts = ChatCounts(seq_len=state.seq_len, long_policy=state.long)
    raw_lines = block.split(b"\n")
    if raw_lines and not raw_lines[-1]:
        raw_lines.pop()
    for n, raw in enumerate(raw_lines, first_line):
        if not raw.strip():
            continue
        obj, problem, fixed = _json_line(raw, state)
        try:
            if problem is not None and raw.lstrip().startswith(b"["):  # a pretty-printed array
                raise ChatLineError(JSON_ARRAY)
            if problem is not None:
                raise ChatLineError(f"{problem[1]}; each line must be one JSON conversation")
            obj, lone = _without_surrogates(obj)
            if lone and state.on_bad_utf8 != "replace":
                raise ChatLineError(
                    "a lone surrogate (\\ud800-\\udfff) escape in a string; fix the line or "
                    "pass --on-bad-utf8 replace"
                )
            fixed = max(fixed, int(lone > 0))
            messages = conversation(obj)
            blank = chat.blank_replies(messages)
            counts.replies += sum(m["role"] == ASSISTANT for m in messages)
            counts.blank += blank
            counts.first_blank = counts.first_blank or (n if blank else 0)
            if not blank:
                doc, mask = chat.encode(messages)
        except ChatLineError as e:
            problems.append((n, "bad conversation", str(e), "refuse"))
            break
        replaced += fixed
        if blank:
            msg = f"{blank} assistant repl{'ies' if blank > 1 else 'y'} with no text"
            problems.append((n, "empty assistant reply", msg, _skip_or_fail(state)))
            continue
        if state.seq_len is not None and len(doc) > state.seq_len + 1:
            row = state.seq_len + 1
            if state.long == "refuse":
                problems.append((n, "long conversation", _too_long(len(doc), row), "refuse"))
                break
            counts.long += 1
            counts.past_row += len(doc) - row
            counts.past_row_trained += sum(mask[row:])
        counts.longest = max(counts.longest, len(doc))
        ids.append(doc)
        masks.append(mask)
    lengths = np.fromiter(map(len, ids), np.int32, count=len(ids))
    total = int(lengths.sum())
    tokens = np.fromiter(itertools.chain.from_iterable(ids), np.dtype(state.dtype), count=total)
    mask = np.fromiter(itertools.chain.from_iterable(masks), np.uint8, count=total)
    doc_ends = np.arange(1, len(ids) + 1, dtype=np.int64)
    return _Chunk(
        tokens, lengths, doc_ends, problems, len(raw_lines), len(block), 0, replaced, mask, counts
    )


def _skip_or_fail(state: _State) -> str:
    return "fail" if state.on_error == "fail" else "skip"


def _too_long(tokens: int, row: int) -> str:
    return (
        f"a conversation of {tokens:,} tokens, longer than a training row of {row:,} (--seq-len "
        f"{row - 1}); pass a longer --seq-len, or --long drop (train its first row) or --long "
        "split (train it in pieces), or shorten it"
    )


# One lone surrogate (a \ud800-\udfff escape not paired by JSON's parser) in a parsed string.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _repaired(text: str) -> tuple[str, int]:
    """`text` with each lone surrogate replaced by one U+FFFD (one code point, one replacement:
    as JavaScript's TextEncoder and Rust's from_utf16_lossy do), and how many there were. The
    tokenizer cannot encode them; encoding them as UTF-8 first would give three U+FFFD each."""
    if text.isascii():
        return text, 0
    return _LONE_SURROGATE.subn("\ufffd", text)


def _without_surrogates(obj: object) -> tuple[object, int]:
    """`obj` with lone surrogates in its strings replaced (`_repaired`), and how many there were.
    Conversations are small: one walk over the parsed line."""
    if isinstance(obj, str):
        return _repaired(obj)
    if isinstance(obj, list):
        pairs = [_without_surrogates(v) for v in obj]
        return [v for v, _ in pairs], sum(n for _, n in pairs)
    if isinstance(obj, dict):
        pairs = {k: _without_surrogates(v) for k, v in obj.items()}
        return {k: v for k, (v, _) in pairs.items()}, sum(n for _, n in pairs.values())
    return obj, 0


def _json_line(raw: bytes, state: _State) -> tuple[object, tuple[str, str, bool] | None, int]:
    """(parsed JSON, problem or None, 1 if bad bytes were replaced) for one non-blank line."""
    fatal, err = state.on_bad_utf8 == "fail", state.on_error == "fail"
    fixed = 0
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = f"invalid UTF-8 byte 0x{raw[e.start]:02x} at byte {e.start}"
        if state.on_bad_utf8 != "replace":
            return None, ("invalid UTF-8", bad, fatal), 0
        line, fixed = raw.decode("utf-8", errors="replace"), 1
    try:
        return json.loads(line), None, fixed
    except json.JSONDecodeError as e:
        return None, ("malformed JSON", f"malformed JSON ({e.msg} at column {e.colno})", err), fixed
    except RecursionError:  # valid JSON nested deeper than the parser's recursion limit
        return None, ("malformed JSON", "JSON nested too deeply to parse", err), fixed
    except ValueError as e:  # valid JSON the parser refuses: an integer over 4,300 digits
        why = str(e).split(";")[0]
        return None, ("malformed JSON", f"JSON the parser refuses ({why})", err), fixed


def _document(raw: bytes, state: _State) -> tuple[str, tuple[str, str, bool] | None, int]:
    """(text, problem or None, 1 if bad bytes were replaced) for one non-blank line."""
    fatal, err = state.on_bad_utf8 == "fail", state.on_error == "fail"
    obj, problem, fixed = _json_line(raw, state)
    if problem is not None:
        return "", problem, fixed
    if not isinstance(obj, dict):
        kind = type(obj).__name__
        return "", ("not a JSON object", f"a JSON {kind}, not an object", err), fixed
    if state.json_key not in obj:
        keys = ", ".join(list(obj)[:5]) or "none"
        fix = "pass --chat (conversations)" if "messages" in obj else "pass --json-key"
        msg = f"no key {state.json_key!r} (keys: {keys}); {fix}"
        return "", (f"missing key {state.json_key!r}", msg, err), fixed
    text = obj[state.json_key]
    if not isinstance(text, str):
        msg = f"{state.json_key!r} is a JSON {type(text).__name__}, not a string"
        return "", ("not a string", msg, err), fixed
    text, lone = _repaired(text)
    if lone:  # a lone surrogate written as a \\ud800 escape
        if state.on_bad_utf8 != "replace":
            return "", ("invalid UTF-8", "a lone surrogate (\\ud800-\\udfff) escape", fatal), 0
        fixed = 1
    return text, None, fixed
