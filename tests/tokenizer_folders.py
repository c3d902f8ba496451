"""Hugging Face tokenizer folders built locally, in the forms Llama 3, Qwen 2.5 and Llama 2 /
Mistral publish (no network): tokenizer.json trained by the `tokenizers` library on a little text,
tokenizer_config.json with the special tokens, their added_tokens_decoder and a chat template.

The chat templates are written here in the shape those models publish them; each has a
`{% generation %}`-marked twin that renders the same text, so transformers'
`return_assistant_tokens_mask` gives a reference loss mask to check fitgpt's against.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! It's 3.14 o'clock, isn't it?",
    "naïve café crème brûlée, Straße; русский текст, 中文字符，日本語 🙂",
    "def f(x):\n    return x ** 2  # comment\n\n\tindented",
    "You are a helpful assistant. What is the capital of France? Paris is.",
    "system user assistant tool answer question reply thanks please",
] * 20

# Llama 3's pre-tokenizer split (its published regex), and Qwen 2's (digits one by one).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
LLAMA3_TEMPLATE_MARKED = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}\n"
    "    {%- else %}\n"
    "        {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
# Qwen 2.5's: a default system message when the conversation has none.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role != 'system' %}\n"
    "        {{- raise_exception('unknown role ' + message.role) }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
QWEN_TEMPLATE_MARKED = QWEN_TEMPLATE.replace(
    "    {%- if (message.role == 'user')",
    "    {%- if message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}\n"
    "    {%- elif (message.role == 'user')",
)
# Mistral / Llama 2's [INST] form: roles must alternate, a system message joins the first turn.
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)


def _config(folder: Path, tok, cls: str, special: dict, template: str | None, **extra) -> None:
    """tokenizer_config.json as transformers writes it: the special tokens by name, every added
    token in added_tokens_decoder, the class, and the chat template."""
    added = {
        str(tok.token_to_id(t.content)): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t.special,
        }
        for t in tok.get_added_tokens_decoder().values()
    }
    cfg = {"added_tokens_decoder": added, "tokenizer_class": cls, **special, **extra}
    if template is not None:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False))
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=1))


def _byte_level(split: str, nfc: bool, vocab: int, special: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def llama3(folder: Path, *, big: bool = False, template: str | None = LLAMA3_TEMPLATE) -> Path:
    """Llama 3's shape: byte-level BPE, BOS added by a TemplateProcessing post-processor,
    <|end_of_text|> ends documents and <|eot_id|> turns. `big` puts the special tokens past id
    65,535 (as Llama 3's 128,000+ are), so the vocabulary needs int32 token files."""
    from tokenizers import AddedToken, processors

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
    specials += ["<|end_header_id|>", "<|eot_id|>"]
    tok = _byte_level(LLAMA3_SPLIT, False, 600, [] if big else specials)
    if big:  # reserved tokens up to 70,000, then the named ones (Llama 3 reserves 256 of them)
        reserved = [f"<|reserved_special_token_{i}|>" for i in range(70_000 - tok.get_vocab_size())]
        tok.add_special_tokens([AddedToken(t, special=True) for t in reserved + specials])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    _config(folder, tok, "PreTrainedTokenizerFast", special, template)
    return folder


def qwen(folder: Path, *, template: str | None = QWEN_TEMPLATE) -> Path:
    """Qwen 2.5's shape: byte-level BPE after NFC, no BOS, <|endoftext|> ends documents and
    <|im_end|> turns (the instruct model's eos_token)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = _byte_level(QWEN_SPLIT, True, 600, specials)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    _config(folder, tok, "Qwen2Tokenizer", special, template, errors="replace")
    return folder


def mistral(folder: Path, *, template: str | None = MISTRAL_TEMPLATE) -> Path:
    """Llama 2 / Mistral's shape: a SentencePiece-style BPE (a "▁" for each space and one in
    front, unknown characters as <0xNN> bytes), <s> added by the post-processor as
    add_bos_token says, </s> ending documents and turns."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # SentencePiece's layout: <unk> <s> </s>, the 256 byte tokens, then the learnt pieces; the
    # byte tokens are vocabulary entries (not added tokens), so "<0x41>" in text stays text.
    learnt = json.loads(tok.to_str())["model"]
    names = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    names += sorted(learnt["vocab"], key=learnt["vocab"].get)
    vocab = {t: i for i, t in enumerate(dict.fromkeys(names))}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learnt["merges"]]
    tok.model = models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    _config(
        folder, tok, "LlamaTokenizer", special, template, add_bos_token=True, add_eos_token=False,
        legacy=False,
    )  # fmt: skip
    return folder


def llama2(folder: Path, *, legacy: bool = False, template: str | None = None) -> Path:
    """Llama 2's own shape (and Mistral 7B v0.1's), older than `mistral`'s: the same
    SentencePiece-derived BPE (byte fallback, <unk> <s> </s> then the 256 byte tokens), but
    spaces made "▁" by the normalizer (Prepend "▁", then Replace " " by "▁") and no
    pre-tokenizer, <s> added by a TemplateProcessing post-processor, and tokenizer_config.json
    as Llama 2 ships it (LlamaTokenizer, add_bos_token, the `legacy` flag)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    folder.mkdir(parents=True, exist_ok=True)
    mistral(folder, template=template)  # its vocabulary, merges, specials and post-processor
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    assert isinstance(tok.model, models.BPE)
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    _config(
        folder, tok, "LlamaTokenizer", special, template, add_bos_token=True, add_eos_token=False,
        legacy=legacy, clean_up_tokenization_spaces=False, pad_token=None,
        sp_model_kwargs={}, padding_side="right",
    )  # fmt: skip
    return folder


def llama2_legacy(folder: Path) -> Path:
    """llama2 with `"legacy": true` (Mistral 7B v0.1's tokenizer_config.json says so)."""
    return llama2(folder, legacy=True)
