"""Chat data: rendering equal to transformers' apply_chat_template, the loss mask on exactly the
assistant's tokens, samples packed whole with their segment ids, targets -1 exactly where the
mask is 0, and bad conversations refused in one line before anything is written."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import tokenizer_folders as tf
import torch
from cli_refusal import assert_refused, files, run_in_process

from fitgpt.data.chat import ChatEncoder, conversation, mask_prefix
from fitgpt.data.indexed import IndexedDataset
from fitgpt.data.packed import PackedSamples, best_fit
from fitgpt.data.preprocess import PreprocessConfig, preprocess
from fitgpt.data.source import BatchLoader, segment_positions
from fitgpt.data.tokenizer import load_tokenizer
from fitgpt.errors import UserError

WORDS = [
    "the", "cat", "café", "naïve", "日本語", "🙂", "Straße", "résumé", "ok", "3.14", "it's",
    "  spaced  ", "\n", "line\nbreak", "x", "Ελληνικά", "<b>", '"quoted"', "{braces}",
]  # fmt: skip


def _text(rng: random.Random, most: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, most)))


def conversations(n: int, seed: int, *, alternate: bool = False) -> list[list[dict]]:
    """n conversations: an optional system message, 1-4 user/assistant turns, unicode, runs of
    spaces and newlines (leading and trailing too, which Llama 3's template trims)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": _text(rng, 6)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": _text(rng, 10)})
            msgs.append({"role": "assistant", "content": _text(rng, 25)})
        if not alternate and rng.random() < 0.2:  # a trailing user turn: trains nothing more
            msgs.append({"role": "user", "content": _text(rng, 4)})
        out.append(msgs)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {"llama3": tf.llama3(root / "llama3"), "qwen": tf.qwen(root / "qwen"),
            "mistral": tf.mistral(root / "mistral")}  # fmt: skip


MARKED = {"llama3": tf.LLAMA3_TEMPLATE_MARKED, "qwen": tf.QWEN_TEMPLATE_MARKED}


@pytest.mark.parametrize("name", ["llama3", "qwen"])
def test_rendering_ids_and_mask_equal_transformers(folders, name):
    """50 conversations: the text equals apply_chat_template's, the ids its tokenize=True ids,
    and the mask transformers' return_assistant_tokens_mask under the {% generation %}-marked
    twin of the template (the same text, checked too)."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(folders[name]))
    enc = ChatEncoder(load_tokenizer(str(folders[name])))
    for msgs in conversations(50, seed=len(name)):
        text = ref.apply_chat_template(msgs, tokenize=False)
        assert enc.render(msgs) == text
        marked = ref.apply_chat_template(
            msgs, chat_template=MARKED[name], tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        assert ref.decode(marked["input_ids"]) == text
        ids, mask = enc.encode(msgs)
        assert (
            ids
            == marked["input_ids"]
            == ref.apply_chat_template(msgs, return_dict=True)["input_ids"]
        )
        assert mask == marked["assistant_masks"]


def test_mistral_mask_holds_each_reply_and_its_eos(folders):
    """Llama 2 / Mistral's [INST] template has no generation marker: the masked runs, found
    independently by decoding, are each reply (with its leading space) and </s>, in order."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(folders["mistral"]))
    enc = ChatEncoder(load_tokenizer(str(folders["mistral"])))
    for msgs in conversations(50, seed=3, alternate=True):
        assert enc.render(msgs) == ref.apply_chat_template(msgs, tokenize=False)
        ids, mask = enc.encode(msgs)
        assert ids == ref.apply_chat_template(msgs, return_dict=True)["input_ids"]
        runs, run = [], []
        for i, m in zip(ids, mask):
            if m:
                run.append(i)
            elif run:
                runs, run = [*runs, run], []
        runs += [run] if run else []
        replies = [m["content"] for m in msgs if m["role"] == "assistant"]
        # the decoder drops one leading space: the reply's own, since the template adds one
        assert [ref.decode(r) for r in runs] == [f"{c}</s>" for c in replies]


def test_prompt_response_lines_are_a_user_assistant_pair(folders):
    enc = ChatEncoder(load_tokenizer(str(folders["qwen"])))
    line = {"system": "Be brief.", "prompt": "Hi 🙂", "response": "Hello."}
    assert conversation(line) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello."},
    ]
    text, spans = enc.assistant_spans(conversation(line))
    assert [text[a:b] for a, b in spans] == ["Hello.<|im_end|>"]


def _write_chat(path, convs):
    path.write_text("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in convs))


def test_preprocess_writes_tokens_and_mask_pairs(folders, tmp_path):
    convs = conversations(40, seed=7)
    _write_chat(tmp_path / "c.jsonl", convs)
    cfg = PreprocessConfig(
        input=str(tmp_path / "c.jsonl"), output_prefix=str(tmp_path / "o"),
        tokenizer=str(folders["llama3"]), chat=True, workers=2, chunk_bytes=2000, progress=False,
    )  # fmt: skip
    report = preprocess(cfg)
    enc = ChatEncoder(load_tokenizer(str(folders["llama3"])))
    tokens, mask = IndexedDataset(cfg.prefix), IndexedDataset(mask_prefix(cfg.prefix))
    assert mask.dtype == np.uint8 and tokens.num_sequences == mask.num_sequences == 40
    for i, msgs in enumerate(convs):
        ids, m = enc.encode(msgs)
        assert tokens[i].tolist() == ids and mask[i].tolist() == m
    assert report.trained == int(np.asarray(mask.tokens).sum()) > 0
    assert "loss on" in report.summary()


def _packed_data(folder, tmp_path, convs, seq_len, long="drop"):
    _write_chat(tmp_path / "c.jsonl", convs)
    cfg = PreprocessConfig(
        input=str(tmp_path / "c.jsonl"), output_prefix=str(tmp_path / "o"), tokenizer=str(folder),
        chat=True, workers=0, progress=False, long=long,
    )  # fmt: skip
    preprocess(cfg)
    data = IndexedDataset(cfg.prefix)
    return data, PackedSamples(data, "1,0,0", "train", seq_len, seed=5, vocab_size=10**6)


def test_packing_keeps_samples_whole_with_their_segment_ids(folders, tmp_path):
    data, src = _packed_data(folders["qwen"], tmp_path, conversations(60, seed=11), seq_len=599)
    docs = [data[i].tolist() for i in range(data.num_sequences)]
    assert max(map(len, docs)) <= 600 and src.cut_samples == 0
    tokens, _, seg = src.get_packed(np.arange(src.samples_per_epoch))
    found = []
    for row_t, row_s in zip(tokens, seg):
        assert (np.diff(row_s) >= 0).all() and row_s[0] == 0  # ids 0, 1, ... in order
        n = int(row_s.max())
        pieces = [row_t[row_s == s].tolist() for s in range(n + 1)]
        filled = sum(map(len, pieces[:-1]))
        if filled + len(pieces[-1]) == 600 and pieces[-1] in docs:
            found += pieces  # a row filled exactly: no padding segment
        else:
            found += pieces[:-1]
            assert pieces[-1] == [0] * len(pieces[-1])  # padding
    assert sorted(map(tuple, found)) == sorted(map(tuple, docs))  # each sample once, whole
    assert 0.5 < src.fill <= 1.0


def test_targets_are_minus_one_exactly_where_the_mask_is_zero(folders, tmp_path):
    """Over one epoch of rows: a target counts where its token is the assistant's and in the
    input's sample; every assistant token is a target exactly once, also for samples longer
    than a row (cut in overlapping pieces, --long split)."""
    long = _text(random.Random(1), 200)
    convs = [
        *conversations(30, seed=13),
        [{"role": "user", "content": "long"}, {"role": "assistant", "content": long}],
    ]
    data, src = _packed_data(folders["llama3"], tmp_path, convs, seq_len=64, long="split")
    assert src.cut_samples >= 1
    loader = BatchLoader(src, micro_batch=src.samples_per_epoch)
    inputs, targets, segments = loader.next_with_segments()
    tokens, keep, seg = src.get_packed(loader.indices(0))
    assert (inputs.numpy() == tokens[:, :-1]).all() and (segments.numpy() == seg[:, :-1]).all()
    counted = (keep[:, 1:] == 1) & (seg[:, 1:] == seg[:, :-1])
    assert ((targets.numpy() != -1) == counted).all()
    assert (targets.numpy()[counted] == tokens[:, 1:][counted]).all()
    mask = IndexedDataset(mask_prefix(data.prefix))
    assert int(counted.sum()) == int(np.asarray(mask.tokens).sum())  # each assistant token once
    pos = segment_positions(segments)
    for row_s, row_p in zip(segments.tolist(), pos.tolist()):
        assert row_p == [row_s[:t].count(row_s[t]) for t in range(len(row_s))]
    x, y, seg = BatchLoader(src, 2).next()  # what the trainer reads: the same targets
    assert (y.numpy() == targets.numpy()[:2]).all() and x.shape == (2, 64)
    assert torch.equal(seg, segments[:2])  # packed data: the segments travel with the batch


def test_best_fit_packs_tighter_than_one_per_row():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, 2000)
    rows = best_fit(lengths, 256)
    room = 256 - np.bincount(rows, weights=lengths)
    assert (room >= 0).all() and rows.max() + 1 < 0.5 * len(lengths)
    assert lengths.sum() / ((rows.max() + 1) * 256) > 0.9  # mostly full rows


def test_open_data_reads_chat_data_packed(folders, tmp_path):
    from fitgpt.data.config import DataConfig, open_data

    data, _ = _packed_data(folders["qwen"], tmp_path, conversations(80, seed=2), seq_len=64)
    train, valid, tok = open_data(DataConfig(data=data.prefix), 64, 0, seed=1)
    assert isinstance(train, PackedSamples) and isinstance(valid, PackedSamples)
    assert tok.name == str(folders["qwen"])  # the recorded tokenizer
    with pytest.raises(UserError, match=r"--sample-order megatron: .* chat data"):
        open_data(DataConfig(data=data.prefix, sample_order="megatron"), 64, 0, seed=1)


def test_text_preprocess_over_chat_data_removes_its_mask(folders, tmp_path):
    _packed_data(folders["qwen"], tmp_path, conversations(5, seed=2), seq_len=64)
    (tmp_path / "t.jsonl").write_text('{"text": "plain"}\n')
    cfg = PreprocessConfig(
        input=str(tmp_path / "t.jsonl"), output_prefix=str(tmp_path / "o"), json_key="chat",
        tokenizer=str(folders["qwen"]), workers=0, progress=False,
    )  # fmt: skip
    with pytest.raises(UserError, match="no key 'chat'"):
        preprocess(cfg)  # nothing written: the chat pair and its mask stay
    assert (tmp_path / "o_chat_document.loss_mask.bin").is_file()
    (tmp_path / "t.jsonl").write_text('{"chat": "plain"}\n')
    preprocess(cfg)  # the same prefix, now text: the old mask must not pair with it
    assert not (tmp_path / "o_chat_document.loss_mask.bin").exists()


BAD = [
    ("not json", "{oops\n", "c.jsonl:2: malformed JSON"),
    ("no messages", '{"text": "hi"}\n', 'c.jsonl:2: no "messages" (keys: text)'),
    ("no assistant", '{"messages": [{"role": "user", "content": "x"}]}\n', "no message has role"),
    ("role refused", '{"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", '
     '"content": "y"}]}\n', "c.jsonl:2: the chat template refuses this conversation (TemplateError: "
     "unknown role bot)"),
    ("no role", '{"messages": [{"content": "x"}]}\n', 'message 1 is not an object with a string "role"'),
]  # fmt: skip


@pytest.mark.parametrize("what, line, names", BAD, ids=[b[0] for b in BAD])
def test_bad_conversation_is_one_line_and_writes_nothing(
    folders, tmp_path, capsys, what, line, names
):
    good = json.dumps({"prompt": "a", "response": "b"}) + "\n"
    (tmp_path / "c.jsonl").write_text(good + line + good)
    before = files(tmp_path)
    code, err = run_in_process(
        capsys, "data", "preprocess", "--input", tmp_path / "c.jsonl", "--output-prefix",
        tmp_path / "o", "--tokenizer", folders["qwen"], "--chat", "--workers", "0", "--quiet",
    )  # fmt: skip
    assert_refused(code, err, names)
    assert files(tmp_path) == before


@pytest.mark.parametrize(
    "tokenizer, names", [("gpt2", "not one"), ("none-template", "no chat template")]
)
def test_tokenizer_without_a_chat_template_is_refused(folders, tmp_path, capsys, tokenizer, names):
    if tokenizer == "none-template":
        tokenizer = tf.qwen(tmp_path / "base", template=None)
    (tmp_path / "c.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    before = files(tmp_path)
    code, err = run_in_process(
        capsys, "data", "preprocess", "--input", tmp_path / "c.jsonl", "--output-prefix",
        tmp_path / "o", "--tokenizer", tokenizer, "--chat", "--quiet",
    )  # fmt: skip
    assert_refused(code, err, names, "--chat" if tokenizer == "gpt2" else "chat_template")
    assert files(tmp_path) == before


def test_template_rendering_earlier_turns_differently_is_refused(folders):
    """A template that drops earlier replies' text (as reasoning templates do) cannot have its
    assistant tokens located by prefixes: refused with the fix, not masked wrongly."""
    tok = load_tokenizer(str(folders["qwen"]))
    tok.config = {**tok.config, "chat_template": (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[old]"
        "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    )}  # fmt: skip
    enc = ChatEncoder(tok)
    msgs = [{"role": r, "content": c} for r, c in zip(["user", "assistant"] * 2, "abcd")]
    with pytest.raises(ValueError, match="split the conversation into one line per assistant"):
        enc.encode(msgs)


def test_inspect_counts_the_trained_tokens_and_merge_refuses_chat_data(folders, tmp_path):
    from fitgpt.data.tools import inspect, merge

    data, _ = _packed_data(folders["qwen"], tmp_path, conversations(5, seed=2), seq_len=64)
    trained = int(np.asarray(IndexedDataset(mask_prefix(data.prefix)).tokens).sum())
    assert f"loss on {trained:,} assistant tokens" in inspect(data.prefix)
    with pytest.raises(UserError, match=r"is chat data .* cannot carry"):
        merge([data.prefix, data.prefix], str(tmp_path / "m"))
