"""Chat data trained as written (issue 48, items 7-10 and 14): message content that is not text,
replies with no text, a tokenizer.json without its config's end of turn, chat data without its
loss mask, conversations longer than a training row, and lone surrogate escapes. Each case is
either trained exactly as transformers renders it, or refused in one line before anything is
written; counts are checked against ones computed here, conversation by conversation."""

from __future__ import annotations

import json

import pytest
import tokenizer_folders as tf
from cli_refusal import assert_refused, files, run_in_process

from fitgpt.data.chat import ChatEncoder, conversation, mask_prefix
from fitgpt.data.indexed import IndexedDataset
from fitgpt.data.preprocess import PreprocessConfig, preprocess
from fitgpt.data.tokenizer import load_tokenizer
from fitgpt.errors import UserError

# A template that takes OpenAI's content parts and tool calls, in the way Qwen2-VL's and Llama
# 4's do: the text parts written one after the other, each tool call named.
PARTS_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- elif message.content is defined %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{{- '<tool_call>' + call.function.name + '</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("content")
    return {
        "qwen": tf.qwen(root / "qwen"),
        "llama3": tf.llama3(root / "llama3"),
        "parts": tf.qwen(root / "parts", template=PARTS_TEMPLATE),
    }


def _parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def _joined(msgs: list[dict]) -> list[dict]:
    """`msgs` with each list of text parts written as the one string it stands for."""
    return [
        {**m, "content": "".join(p["text"] for p in m["content"])}
        if isinstance(m.get("content"), list)
        else m
        for m in msgs
    ]


PARTS = [
    {"role": "system", "content": _parts("Be brief. ", "Answer in French.")},
    {"role": "user", "content": _parts("What is the capital", "", " of France?")},
    {"role": "assistant", "content": _parts("Paris", " 🙂")},
    {"role": "user", "content": "and Spain?"},
    {"role": "assistant", "content": _parts("Madrid.")},
]


def test_content_parts_are_joined_as_the_templates_that_take_them_render_them(folders):
    """A template that reads content parts: ids equal transformers' for the parts as given.
    Templates that do not (Qwen 2.5's fails on a list, Llama 3's trims its Python repr): ids
    equal transformers' for the joined text, never the list's repr."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(folders["parts"]))
    enc = ChatEncoder(load_tokenizer(str(folders["parts"])))
    ids, mask = enc.encode(conversation({"messages": PARTS}))
    assert ids == ref.apply_chat_template(PARTS, return_dict=True)["input_ids"]
    assert enc.render(conversation({"messages": PARTS})) == ref.apply_chat_template(
        PARTS, tokenize=False
    )
    assert ref.decode([i for i, m in zip(ids, mask) if m]) == "Paris 🙂<|im_end|>Madrid.<|im_end|>"
    for name in ("qwen", "llama3"):
        ref = AutoTokenizer.from_pretrained(str(folders[name]))
        enc = ChatEncoder(load_tokenizer(str(folders[name])))
        ids, _ = enc.encode(conversation({"messages": PARTS}))
        assert ids == ref.apply_chat_template(_joined(PARTS), return_dict=True)["input_ids"]
        assert "'type'" not in ref.decode(ids)
    with pytest.raises(Exception):  # noqa: B017 (jinja's TypeError, as transformers raises it)
        AutoTokenizer.from_pretrained(str(folders["qwen"])).apply_chat_template(PARTS)


def test_tool_calls_and_tool_results_render_as_transformers_renders_them(folders):
    """OpenAI's assistant tool call (content null) and the tool's reply: the null dropped as
    transformers drops it, the ids equal its."""
    from transformers import AutoTokenizer

    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "1", "name": None},
        {"role": "assistant", "content": "It is sunny."},
    ]  # fmt: skip
    ref = AutoTokenizer.from_pretrained(str(folders["parts"]))
    ids, mask = ChatEncoder(load_tokenizer(str(folders["parts"]))).encode(
        conversation({"messages": msgs})
    )
    assert ids == ref.apply_chat_template(msgs, return_dict=True)["input_ids"]
    trained = ref.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "<tool_call>weather</tool_call><|im_end|>It is sunny.<|im_end|>"


def _preprocess_cli(capsys, folder, path, *flags):
    out = path.parent / "o"
    return run_in_process(
        capsys, "data", "preprocess", "--input", path, "--output-prefix", out, "--tokenizer",
        folder, "--chat", "--workers", "0", "--quiet", *flags,
    )  # fmt: skip


GOOD = json.dumps({"messages": [{"role": "user", "content": "a"},
                                {"role": "assistant", "content": "b"}]}) + "\n"  # fmt: skip


def _line(*messages, **extra) -> str:
    return json.dumps({"messages": list(messages), **extra}, ensure_ascii=False) + "\n"


U = {"role": "user", "content": "hi"}
NOT_TEXT = [
    ("null", _line({"role": "user", "content": None}, {"role": "assistant", "content": "x"}),
     ['message 1 ("user") "content" is null']),
    ("number", _line(U, {"role": "assistant", "content": 42}),
     ['message 2 ("assistant") "content" is a JSON number']),
    ("object", _line({"role": "user", "content": {"text": "hi"}}, {"role": "assistant", "content": "x"}),
     ['message 1 ("user") "content" is a JSON object']),
    ("boolean", _line(U, {"role": "assistant", "content": True}), ['"content" is a JSON boolean']),
    ("image part", _line({"role": "user", "content": [{"type": "text", "text": "see"}, {
        "type": "image_url", "image_url": {"url": "x.png"}}]}, {"role": "assistant", "content": "y"}),
     ['message 1 ("user") "content" part 2 is of type "image_url"']),
    ("part not text", _line(U, {"role": "assistant", "content": [{"type": "text", "text": 3}]}),
     ['"content" part 1 has a "text" that is a JSON number']),
    ("bare part", _line(U, {"role": "assistant", "content": ["just a string"]}),
     ['"content" part 1 is a JSON string, not an object']),
    ("missing", _line(U, {"role": "assistant"}), ['message 2 ("assistant") has no "content"']),
    ("misspelt", _line(U, {"role": "assistant", "contnet": "hello"}),
     ['has no "content" (other keys: contnet)']),
    ("tool", _line({"role": "tool", "content": {"temp": 20}}, U, {"role": "assistant", "content": "x"}),
     ['message 1 ("tool") "content" is a JSON object']),
    ("reasoning", _line(U, {"role": "assistant", "content": "x", "reasoning_content": ["a"]}),
     ['"reasoning_content" is a JSON array']),
    ("system number", json.dumps({"system": 7, "prompt": "a", "response": "b"}) + "\n",
     ['"system" is a JSON number, not a string']),
    ("system list", json.dumps({"system": ["be brief"], "prompt": "a", "response": "b"}) + "\n",
     ['"system" is a JSON array']),
    ("response null", json.dumps({"prompt": "a", "response": None}) + "\n",
     ['"response" is a JSON null']),
    ("uncalled tool", _line(U, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
     ['message 2 calls tools, but the chat template never reads "tool_calls"']),
    ("no messages", _line(), ['"messages" must be a non-empty list']),
]  # fmt: skip


@pytest.mark.parametrize("on_error", ["skip", "fail"])
@pytest.mark.parametrize("what, line, names", NOT_TEXT, ids=[c[0] for c in NOT_TEXT])
def test_content_that_is_not_text_is_refused_in_one_line(
    folders, tmp_path, capsys, what, line, names, on_error
):
    """Refused naming FILE:LINE and the field, under --on-error skip as under fail (a bad
    conversation is fatal whatever --on-error says), and nothing is written."""
    (tmp_path / "c.jsonl").write_text(GOOD + line + GOOD)
    before = files(tmp_path)
    code, err = _preprocess_cli(
        capsys, folders["qwen"], tmp_path / "c.jsonl", "--on-error", on_error
    )
    assert_refused(code, err, f"{tmp_path / 'c.jsonl'}:2:", *names)
    assert files(tmp_path) == before


def test_system_null_is_no_system_message():
    """A prompt/response line whose "system" is null (a column other rows fill) has no system
    message; one with a string keeps it."""
    line = {"prompt": "a", "response": "b"}
    assert conversation({**line, "system": None}) == conversation(line)
    assert conversation({**line, "system": ""})[0] == {"role": "system", "content": ""}


# ---- replies with no text (item 8) ---------------------------------------------------------
def _chat_file(path, replies):
    """One user/assistant line per reply in `replies`."""
    path.write_text("".join(_line({"role": "user", "content": f"q{i}"},
                                  {"role": "assistant", "content": r})
                            for i, r in enumerate(replies)))  # fmt: skip


def test_a_few_blank_replies_are_skipped_and_counted(folders, tmp_path, capsys):
    replies = [f"answer {i}" for i in range(20)]
    blank_at = {3: "", 11: "  \n\t", 17: [{"type": "text", "text": " "}]}
    for i, r in blank_at.items():
        replies[i] = r
    _chat_file(tmp_path / "c.jsonl", replies)
    code, err = _preprocess_cli(capsys, folders["qwen"], tmp_path / "c.jsonl")
    assert code is None or code == 0, err
    shown = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert [ln.split(": ")[1].rsplit(":", 1)[1] for ln in shown] == [str(i + 1) for i in blank_at]
    report = preprocess(PreprocessConfig(
        input=str(tmp_path / "c.jsonl"), output_prefix=str(tmp_path / "p"),
        tokenizer=str(folders["qwen"]), chat=True, workers=0, progress=False,
    ))  # fmt: skip
    assert report.documents == 20 - len(blank_at)
    assert sum(report.skipped.values()) == len(blank_at)
    assert (report.chat.replies, report.chat.blank) == (20, len(blank_at))
    assert f"20 assistant replies, {len(blank_at)} with no text" in report.summary()
    enc = ChatEncoder(load_tokenizer(str(folders["qwen"])))
    data = IndexedDataset(report.prefix)
    kept = [i for i in range(20) if i not in blank_at]
    for k, i in enumerate(kept):  # the other lines, in order, as written
        msgs = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": replies[i]}]
        assert data[k].tolist() == enc.encode(msgs)[0]


def test_a_blank_reply_under_on_error_fail_is_refused(folders, tmp_path, capsys):
    _chat_file(tmp_path / "c.jsonl", ["a", "b", "", "d"])
    before = files(tmp_path)
    code, err = _preprocess_cli(capsys, folders["qwen"], tmp_path / "c.jsonl", "--on-error", "fail")
    assert_refused(code, err, f"{tmp_path / 'c.jsonl'}:3:", "assistant reply with no text",
                   "--on-error skip")  # fmt: skip
    assert files(tmp_path) == before


def test_a_file_of_mostly_blank_replies_is_refused(folders, tmp_path, capsys):
    """More than MOST_BLANK of the replies blank: refused in one line (no page of warnings),
    nothing written; at MOST_BLANK exactly, the blank ones are skipped."""
    from fitgpt.data.preprocess import MOST_BLANK

    n = 20
    most = int(MOST_BLANK * n)
    for blank, refused in ((n, True), (most + 1, True), (most, False)):
        for p in tmp_path.glob("o_*"):
            p.unlink()
        _chat_file(tmp_path / "c.jsonl", [""] * blank + ["yes"] * (n - blank))
        before = files(tmp_path)
        code, err = _preprocess_cli(capsys, folders["llama3"], tmp_path / "c.jsonl")
        if refused:
            assert_refused(code, err, str(tmp_path / "c.jsonl"),
                           f"{blank} of {n} assistant replies have no text", "on line 1")  # fmt: skip
            assert files(tmp_path) == before
        else:
            assert code is None or code == 0, err
            assert IndexedDataset(str(tmp_path / "o_chat_document")).num_sequences == n - blank


def test_a_conversation_with_one_blank_reply_among_others_is_skipped(folders, tmp_path):
    (tmp_path / "c.jsonl").write_text(
        GOOD * 3
        + _line(
            U, {"role": "assistant", "content": "fine"}, U, {"role": "assistant", "content": ""}
        )
    )
    report = preprocess(PreprocessConfig(
        input=str(tmp_path / "c.jsonl"), output_prefix=str(tmp_path / "o"),
        tokenizer=str(folders["qwen"]), chat=True, workers=0, progress=False,
    ))  # fmt: skip
    assert (report.documents, report.chat.replies, report.chat.blank) == (3, 5, 1)


# ---- the tokenizer and the mask (item 9) ---------------------------------------------------
def test_tokenizer_json_without_the_configs_end_of_turn_is_refused(tmp_path, capsys):
    """tokenizer_config.json names <|eot_id|>, tokenizer.json lacks it: transformers would add
    it at a new id (the model has no row for it), fitgpt would spell it in pieces: refused."""
    from transformers import AutoTokenizer

    folder = tf.llama3(tmp_path / "tok")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|eot_id|>"]
    del spec["model"]["vocab"]["<|eot_id|>"]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    ref = AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    named = next(int(i) for i, t in config["added_tokens_decoder"].items() if "eot" in t["content"])
    assert ref.convert_tokens_to_ids("<|eot_id|>") != named  # not the id the model was made for
    with pytest.raises(UserError, match=r"names eos_token '<\|eot_id\|>', but .* no such token"):
        load_tokenizer(str(folder))
    _chat_file(tmp_path / "c.jsonl", ["a"])
    before = files(tmp_path)
    code, err = _preprocess_cli(capsys, folder, tmp_path / "c.jsonl")
    assert_refused(code, err, "tokenizer_config.json", "eos_token", "<|eot_id|>", "pieces")
    assert files(tmp_path) == before


def test_a_named_token_in_the_vocabulary_but_not_added_is_one_token_as_in_transformers(tmp_path):
    """tokenizer.json holds <|eot_id|> in its vocabulary but not among its added tokens:
    transformers makes it one token (its id) from the config; so does fitgpt, and the chat
    ids are transformers'."""
    from transformers import AutoTokenizer

    folder = tf.llama3(tmp_path / "tok")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|eot_id|>"]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    ref = AutoTokenizer.from_pretrained(str(folder))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    ids, _ = ChatEncoder(load_tokenizer(str(folder))).encode(msgs)
    assert ids == ref.apply_chat_template(msgs, return_dict=True)["input_ids"]
    assert ids.count(ref.convert_tokens_to_ids("<|eot_id|>")) == 2


@pytest.fixture
def chat_data(folders, tmp_path):
    _chat_file(tmp_path / "c.jsonl", [f"answer number {i}" for i in range(40)])
    cfg = PreprocessConfig(
        input=str(tmp_path / "c.jsonl"), output_prefix=str(tmp_path / "o"),
        tokenizer=str(folders["qwen"]), chat=True, workers=0, progress=False,
    )  # fmt: skip
    preprocess(cfg)
    return cfg.prefix


@pytest.mark.parametrize("lose", ["both", "idx", "record too"])
def test_chat_data_without_its_mask_is_refused(folders, chat_data, tmp_path, capsys, lose):
    from fitgpt.data.config import DataConfig, open_data

    gone = [".idx"] if lose == "idx" else [".bin", ".idx"]
    for ext in gone:
        (tmp_path / f"o_chat_document.loss_mask{ext}").unlink()
    if lose == "record too":  # copied as Megatron users copy data: .bin/.idx only
        (tmp_path / "o_chat_document.fitgpt.json").unlink()
    tokenizer = "auto" if lose != "record too" else str(folders["qwen"])
    with pytest.raises(UserError, match=r"loss mask .*loss_mask\.bin/\.idx is missing"):
        open_data(DataConfig(data=chat_data, tokenizer=tokenizer), 64, 0, seed=1)
    code, err = run_in_process(
        capsys, "data", "merge", chat_data, chat_data, "--output-prefix", tmp_path / "m"
    )
    assert_refused(code, err, chat_data, "loss mask", "every token would train as plain text")


def test_chat_data_without_its_mask_is_refused_by_train(chat_data, tmp_path, capsys):
    for ext in (".bin", ".idx"):
        (tmp_path / f"o_chat_document.loss_mask{ext}").unlink()
    before = files(tmp_path)
    code, err = run_in_process(
        capsys, "train", "--data", chat_data, "--preset", "tiny", "--seq-len", "32", "--steps",
        "1", "--eval-every", "0", "--out", tmp_path / "run",
    )  # fmt: skip
    assert_refused(code, err, chat_data, "loss mask", "copy the .loss_mask pair")
    assert files(tmp_path) == before


def test_text_data_named_chat_with_its_record_trains_as_text(folders, tmp_path):
    """--json-key chat writes a text pair named *_chat_document: its record says text."""
    from fitgpt.data.config import DataConfig, open_data
    from fitgpt.data.gpt_dataset import GPTSamples

    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"chat": f"text {i} " * 20}) + "\n"
                                              for i in range(40)))  # fmt: skip
    preprocess(PreprocessConfig(
        input=str(tmp_path / "t.jsonl"), output_prefix=str(tmp_path / "o"), json_key="chat",
        tokenizer=str(folders["qwen"]), workers=0, progress=False,
    ))  # fmt: skip
    train, _, _ = open_data(DataConfig(data=str(tmp_path / "o_chat_document")), 32, 0, seed=1)
    assert isinstance(train, GPTSamples)


# ---- long conversations (item 10) ----------------------------------------------------------
S = 96  # the training --seq-len: a row is S + 1 tokens


@pytest.fixture
def long_file(folders, tmp_path):
    """40 conversations, every fifth longer than a row; one whose first row holds no reply."""
    lines = []
    for i in range(40):
        reply = "the cat sat " * (30 if i % 5 == 0 else 2) + str(i)
        lines.append(_line({"role": "user", "content": f"question {i}"},
                           {"role": "assistant", "content": reply}))  # fmt: skip
    lines.append(_line({"role": "user", "content": "a long question " * 40},
                       {"role": "assistant", "content": "short"}))  # fmt: skip
    (tmp_path / "c.jsonl").write_text("".join(lines))
    enc = ChatEncoder(load_tokenizer(str(folders["qwen"])))
    encoded = [enc.encode(conversation(json.loads(ln))) for ln in lines]
    return tmp_path / "c.jsonl", encoded


def _cfg(folders, path, **kw):
    return PreprocessConfig(
        input=str(path), output_prefix=str(path.parent / "o"), tokenizer=str(folders["qwen"]),
        chat=True, workers=0, progress=False, **kw,
    )  # fmt: skip


def test_long_conversations_are_counted_in_preprocess(folders, long_file):
    path, encoded = long_file
    long = [(ids, mask) for ids, mask in encoded if len(ids) > S + 1]
    assert len(long) >= 5
    for policy in ("drop", "split"):
        report = preprocess(_cfg(folders, path, seq_len=S, long=policy))
        c = report.chat
        assert c.long == len(long) and c.longest == max(len(ids) for ids, _ in encoded)
        assert c.past_row == sum(len(ids) - S - 1 for ids, _ in long)
        assert c.past_row_trained == sum(sum(mask[S + 1 :]) for _, mask in long)
        assert f"{len(long)} conversations longer than a row of {S + 1} tokens" in report.summary()
        assert f"--long {policy}" in report.summary()
    report = preprocess(_cfg(folders, path))  # no --seq-len: only the longest is known
    assert "not counted: the longest conversation has" in report.summary()


def test_long_conversation_refused_in_preprocess(folders, long_file, capsys):
    path, encoded = long_file
    first = next(n for n, (ids, _) in enumerate(encoded, 1) if len(ids) > S + 1)
    before = files(path.parent)
    code, err = _preprocess_cli(capsys, folders["qwen"], path, "--seq-len", S, "--long", "refuse")
    assert_refused(code, err, f"{path}:{first}:", f"a conversation of {len(encoded[first - 1][0])}",
                   f"--seq-len {S}", "--long drop")  # fmt: skip
    assert files(path.parent) == before


def _epoch(src):
    """(trained target tokens, samples' first tokens) over one epoch of packed rows."""
    from fitgpt.data.source import BatchLoader

    loader = BatchLoader(src, micro_batch=src.samples_per_epoch)
    _, targets, _ = loader.next_with_segments()
    return targets.numpy()


@pytest.mark.parametrize("policy", ["drop", "split"])
def test_training_drops_or_splits_as_recorded(folders, long_file, policy):
    """The policy recorded by preprocess applies at the training --seq-len: drop trains each
    long conversation's first row only (one left out: its row holds no reply), split every
    assistant token once; describe() says so."""
    from fitgpt.data.packed import PackedSamples

    path, encoded = long_file
    cfg = _cfg(folders, path, long=policy)  # no --seq-len: decided at training
    preprocess(cfg)
    src = PackedSamples(IndexedDataset(cfg.prefix), "1", "train", S, seed=3, vocab_size=10**6)
    targets = _epoch(src)
    trained = int((targets != -1).sum())
    long = [(ids, m) for ids, m in encoded if len(ids) > S + 1]
    if policy == "drop":
        want = sum(sum(m[1 : S + 1]) for _, m in encoded)  # a row's targets: tokens 1..S
        left_out = sum(not any(m[1 : S + 1]) for ids, m in long)
        assert left_out == src.left_out == 1 and src.cut_samples == 0
        assert f"{len(long)} longer than a row, trained on their first {S + 1} tokens" in (
            src.describe()
        )
    else:
        want = sum(sum(m[1:]) for _, m in encoded)
        assert src.cut_samples == len(long)
        assert f"{len(long)} longer than a row, trained in pieces" in src.describe()
    assert trained == want
    assert src.past_row_trained == sum(sum(m[S + 1 :]) for _, m in long)


def test_recorded_refuse_is_refused_by_training(folders, long_file):
    from fitgpt.data.config import DataConfig, open_data

    path, encoded = long_file
    cfg = _cfg(folders, path, long="refuse")  # no --seq-len: nothing long known yet
    preprocess(cfg)
    most = max(len(ids) for ids, _ in encoded)
    with pytest.raises(
        UserError, match=rf"train split are longer than a row of --seq-len {S} \+ 1.*--long refuse"
    ):
        open_data(DataConfig(data=cfg.prefix, split="1,1,0"), S, 0, seed=1)
    open_data(DataConfig(data=cfg.prefix, split="1,1,0"), most - 1, 0, seed=1)  # every one fits


def test_train_log_names_the_long_conversations(folders, long_file, tmp_path, capsys):
    path, _ = long_file
    cfg = _cfg(folders, path)
    preprocess(cfg)
    capsys.readouterr()
    from fitgpt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--data", cfg.prefix, "--preset", "tiny", "--seq-len", str(S), "--steps",
              "1", "--eval-every", "0", "--out", str(tmp_path / "run")])  # fmt: skip
    out = capsys.readouterr()
    assert e.value.code in (0, None), out.err
    line = next(ln for ln in out.out.splitlines() if ln.startswith("data:"))
    assert "longer than a row, trained on their first" in line and "--long drop" in line


def test_long_and_seq_len_need_chat(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(UserError, match="--seq-len and --long are for conversations"):
        PreprocessConfig(input=str(tmp_path / "t.jsonl"), output_prefix="o", seq_len=8)
    with pytest.raises(UserError, match="--long"):
        PreprocessConfig(input=str(tmp_path / "t.jsonl"), output_prefix="o", long="split")


# ---- lone surrogates (item 14) -------------------------------------------------------------
def test_a_lone_surrogate_is_one_replacement_and_counted(folders, tmp_path, capsys):
    """\\ud800 in a conversation or a text document: one U+FFFD (not three), and the line
    counted as repaired; under --on-bad-utf8 fail, refused."""
    line = '{"messages": [{"role": "user", "content": "a\\ud800b"}, ' \
           '{"role": "assistant", "content": "x\\udc80"}]}\n'  # fmt: skip
    (tmp_path / "c.jsonl").write_text(GOOD + line)
    report = preprocess(_cfg(folders, tmp_path / "c.jsonl"))
    assert report.replaced_utf8 == 1
    enc = ChatEncoder(load_tokenizer(str(folders["qwen"])))
    fixed = [{"role": "user", "content": "a\ufffdb"}, {"role": "assistant", "content": "x\ufffd"}]
    assert IndexedDataset(report.prefix)[1].tolist() == enc.encode(fixed)[0]
    mask = IndexedDataset(mask_prefix(report.prefix))[1].tolist()
    assert mask == enc.encode(fixed)[1]

    (tmp_path / "t.jsonl").write_text('{"text": "ok"}\n{"text": "a\\ud800b \\udfff"}\n')
    tok = load_tokenizer(str(folders["qwen"]))
    text = preprocess(PreprocessConfig(
        input=str(tmp_path / "t.jsonl"), output_prefix=str(tmp_path / "t"),
        tokenizer=str(folders["qwen"]), workers=0, progress=False,
    ))  # fmt: skip
    assert text.replaced_utf8 == 1
    assert tok.decode(IndexedDataset(text.prefix)[1].tolist()) == "a\ufffdb \ufffd"

    code, err = _preprocess_cli(capsys, folders["qwen"], tmp_path / "c.jsonl", "--on-bad-utf8",
                                "fail")  # fmt: skip
    assert_refused(code, err, f"{tmp_path / 'c.jsonl'}:2:", "lone surrogate",
                   "--on-bad-utf8 replace")  # fmt: skip
