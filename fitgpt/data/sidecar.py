"""Which tokenizer made a .bin/.idx pair: a small JSON record next to it, PREFIX.fitgpt.json.

Every `fitgpt data` command that writes a pair (preprocess, fake, clean, merge) writes this file
after the pair, under a temporary name renamed into place. Megatron-LM's reader opens only
PREFIX.bin and PREFIX.idx, so the pair stays byte-compatible; a pair without a record (made by
Megatron) works as before, with the tokenizer the user names (gpt2 by default).

The record, one JSON object:

    format, version   "fitgpt-data-sidecar", 1
    tokenizer         the --tokenizer spec as given ("gpt2", "tok/", "v.json,m.txt"), or null
                      when the tokens come from no tokenizer (`data fake`)
    tokenizer_abs     the same spec with every part that named an existing path made absolute
    vocab_size        the tokenizer's (for fake data: --vocab)
    eod_id            the tokenizer's <|endoftext|> id, or null
    fingerprint       "VOCAB:HASH" (see `fingerprint`), or null with no tokenizer
    made_by           the command that wrote the pair
    chat              chat data only: {"long": drop|split|refuse, "seq_len": N or null}, what
                      training does with a conversation longer than a row (packed.py)
    bin_bytes, idx_bytes   sizes of the pair it describes

Resolution (`--tokenizer auto` on a prefix): `tokenizer_abs` if it loads and has the recorded
fingerprint, else `tokenizer` as given (relative to the working directory) under the same
condition, else a one-line error; gpt2 when there is no record or it names no tokenizer. A
tokenizer given explicitly must have the recorded fingerprint, or it is refused.

A record whose sizes differ from the pair's describes an older pair (rewritten by another tool):
it is refused, with the fix (delete it), rather than trusted or silently ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from fitgpt.data.indexed import SIDECAR_SUFFIX, paths
from fitgpt.data.tokenizer import Tokenizer, load_tokenizer
from fitgpt.errors import UserError

FORMAT = "fitgpt-data-sidecar"
VERSION = 1
BUILTIN_SPECS = ("gpt2", "bytes")  # names, not paths: never made absolute

# Encoded to fingerprint a tokenizer: ASCII prose and code, digits, whitespace runs, contractions,
# accented Latin, Greek, Cyrillic, Hebrew, Arabic, CJK, Hangul, emoji with a skin tone, zero-width
# and no-break spaces, and the end-of-document text. Two tokenizers that encode all of it alike
# and have the same vocabulary size are, for training purposes, the same tokenizer.
PROBE = (
    "Hello world! The quick brown fox jumps over the lazy dog. 0123456789 3.14159 -1e-9 $42\n"
    "\tdef f(x):\n        return x ** 2  # comment {}[]()<>|\\/@#%^&*~`\n"
    "It's we're they've I'm you'll she'd   three spaces\r\nURL https://example.com/a?b=c&d=e\n"
    "naïve café crème brûlée, Ünïcödé Straße; Ελληνικά, русский текст, עברית, العربية\n"
    "中文字符，日本語のテキスト、한국어 텍스트 🙂🚀👍🏽 \u200b\u00a0end<|endoftext|>next"
)

_FIELDS: dict[str, tuple[type, ...]] = {
    "tokenizer": (str, type(None)),
    "tokenizer_abs": (str, type(None)),
    "vocab_size": (int,),
    "eod_id": (int, type(None)),
    "fingerprint": (str, type(None)),
    "bin_bytes": (int,),
    "idx_bytes": (int,),
}
_TOKENIZER_FIELDS = ("tokenizer", "tokenizer_abs", "vocab_size", "eod_id", "fingerprint")


def path(prefix: str) -> Path:
    return Path(prefix + SIDECAR_SUFFIX)


def fingerprint(tok: Tokenizer) -> str:
    """'VOCAB:HASH', HASH = 16 hex digits of sha256 over the vocabulary size, <|endoftext|> id
    and the encoding of PROBE: the same for one tokenizer however it is loaded (gpt2, or its
    vocab/merges files), different for another. Costs one encode of ~400 characters."""
    ids = [int(i) for i in tok.encode(PROBE)]
    blob = json.dumps({"vocab": tok.vocab_size, "eod": tok.eod_id, "ids": ids}).encode()
    return f"{tok.vocab_size}:{hashlib.sha256(blob).hexdigest()[:16]}"


def write(
    prefix: str,
    tok: Tokenizer | None,
    *,
    vocab_size: int | None = None,
    made_by: str = "",
    extra: dict | None = None,
) -> dict:
    """Record `tok` (None: no tokenizer, with `vocab_size`) for the pair just written at `prefix`;
    `extra` adds fields (chat data's {"chat": {"long": ..., "seq_len": ...}}, packed.py).

    Called right after the pair is renamed into place: if the record cannot be written, the pair
    is removed too, so a failed command leaves no output.
    """
    if tok is None:
        if vocab_size is None:
            raise ValueError("a record without a tokenizer needs vocab_size")
        fields = dict.fromkeys(_TOKENIZER_FIELDS)
        fields["vocab_size"] = vocab_size
    else:
        fields = {
            "tokenizer": tok.name,
            "tokenizer_abs": _absolute(tok.name),
            "vocab_size": tok.vocab_size,
            "eod_id": tok.eod_id,
            "fingerprint": fingerprint(tok),
        }
    return _write(prefix, {**fields, **(extra or {})}, made_by)


def carry(prefix: str, record: dict, made_by: str, vocab_size: int | None = None) -> dict:
    """Copy `record`'s tokenizer to the pair just written at `prefix` (clean, merge)."""
    fields = {k: record[k] for k in _TOKENIZER_FIELDS}
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    return _write(prefix, fields, made_by)


def _write(prefix: str, fields: dict, made_by: str) -> dict:
    bin_path, idx_path = paths(prefix)
    out = path(prefix)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        record = {
            "format": FORMAT,
            "version": VERSION,
            **fields,
            "made_by": made_by,
            "bin_bytes": bin_path.stat().st_size,
            "idx_bytes": idx_path.stat().st_size,
        }
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, out)
    except OSError as e:
        for p in (tmp, bin_path, idx_path):
            with contextlib.suppress(OSError):
                p.unlink()
        raise UserError(
            f"{out}: cannot write ({e.strerror or e}); free space or pick another output prefix "
            "(the new pair was removed)"
        ) from e
    return record


def read(prefix: str) -> dict | None:
    """The record next to `prefix`, or None when there is none (e.g. a pair made by Megatron)."""
    p = path(prefix)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(f"{p}: cannot read ({e.strerror or e}); fix its permissions") from e
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        rec = None
    if not _well_formed(rec):
        raise UserError(
            f"{p} is not a fitgpt data record (damaged?); re-create the data, or delete the "
            "record and pass --tokenizer yourself"
        )
    sizes = _pair_sizes(prefix)
    if sizes is not None and sizes != (rec["bin_bytes"], rec["idx_bytes"]):
        raise UserError(
            f"{p} describes a pair of {rec['bin_bytes']}+{rec['idx_bytes']} bytes, but "
            f"{prefix}.bin/.idx have {sizes[0]}+{sizes[1]}: the pair was rewritten by another "
            f"tool; delete {p.name} and pass --tokenizer yourself"
        )
    return rec


def _well_formed(rec: object) -> bool:
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or rec.get("version") != VERSION:
        return False
    return all(
        isinstance(rec.get(k), types) and not isinstance(rec.get(k), bool)
        for k, types in _FIELDS.items()
    )


def _pair_sizes(prefix: str) -> tuple[int, int] | None:
    try:
        return tuple(p.stat().st_size for p in paths(prefix))  # type: ignore[return-value]
    except OSError:
        return None


def describe(record: dict) -> str:
    """'tok/ (4,000 tokens)' or 'no tokenizer (fake data, 500 tokens)'."""
    if record["tokenizer"] is None:
        return f"no tokenizer ({record['made_by'] or 'fake data'}, {record['vocab_size']:,} ids)"
    return f"{record['tokenizer']} ({record['vocab_size']:,} tokens)"


def recorded_tokenizer(prefix: str) -> Tokenizer | None:
    """The tokenizer the record names, loaded and verified by fingerprint; None without one."""
    rec = read(prefix)
    if rec is None or rec["tokenizer"] is None:
        return None
    tried = []
    for spec in dict.fromkeys((rec["tokenizer_abs"], rec["tokenizer"])):
        try:
            tok = load_tokenizer(spec)
        except UserError as e:
            tried.append(f"{spec}: {e}")
            continue
        if fingerprint(tok) == rec["fingerprint"]:
            return tok
        tried.append(f"{spec} is now another tokenizer ({tok.vocab_size:,} tokens)")
    raise UserError(
        f"{prefix}: made with tokenizer {describe(rec)}, which cannot be loaded as it was "
        f"({'; '.join(tried)}); pass --tokenizer with that tokenizer's files"
    )


def check(prefix: str, tok: Tokenizer, what: str) -> None:
    """Refuse `tok` for the data at `prefix` if its record names another tokenizer.

    `what` says what was being done, e.g. "cannot train on it".
    """
    rec = read(prefix)
    if rec is None or rec["fingerprint"] is None or fingerprint(tok) == rec["fingerprint"]:
        return
    raise UserError(
        f"{prefix}: {what} with tokenizer {tok.name} ({tok.vocab_size:,} tokens): the data was "
        f"made with {describe(rec)}, recorded in {path(prefix).name}; leave --tokenizer at auto "
        f"to use the recorded one (or pass --tokenizer {rec['tokenizer_abs']})"
    )


def tokenizer_for(prefix: str, spec: str, what: str) -> Tokenizer:
    """The tokenizer for data at `prefix`: `spec`, checked against the record; or for 'auto'
    the recorded one, else gpt2 (a pair without a record, or fake data)."""
    if spec == "auto":
        return recorded_tokenizer(prefix) or load_tokenizer("gpt2")
    tok = load_tokenizer(spec)
    check(prefix, tok, what)
    return tok


def _absolute(spec: str) -> str:
    """`spec` with each comma-separated part that names an existing path made absolute."""
    if spec in BUILTIN_SPECS:
        return spec
    parts = spec.split(",")
    return ",".join(str(Path(p).resolve()) if p and Path(p).exists() else p for p in parts)


class RecordedVocabulary:
    """The vocabulary of a pair made without a tokenizer (`fitgpt data fake`): the size recorded
    with the data and no text. It sizes a model's embedding as a tokenizer's vocabulary would
    (fitgpt/data/config.py `data_tokenizer`); asked for text, it refuses in one line, so such
    ids are never shown as some other tokenizer's text."""

    name = "none"  # the spec of token-id data without a tokenizer
    eod_id = None
    stop_ids = ()

    def __init__(self, prefix: str, vocab_size: int) -> None:
        self.prefix, self.vocab_size = prefix, vocab_size

    def _refuse(self) -> UserError:
        return UserError(
            f"{self.prefix}: made without a tokenizer ({self.vocab_size:,} token ids, "
            f"{path(self.prefix).name}); its ids are not text, so nothing can encode or decode them"
        )

    def encode(self, text: str) -> list[int]:
        raise self._refuse()

    def decode(self, ids: list[int]) -> str:
        raise self._refuse()


def recorded_vocabulary(prefix: str) -> RecordedVocabulary | None:
    """The vocabulary of a pair whose record says it was made without a tokenizer; None for a
    pair with a tokenizer, or without a record."""
    rec = read(prefix)
    if rec is None or rec["tokenizer"] is not None:
        return None
    return RecordedVocabulary(prefix, rec["vocab_size"])
