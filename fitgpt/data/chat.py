"""Chat and instruction data: a conversation rendered by the tokenizer's own chat template,
tokenized, with a loss mask that is 1 on the assistant's tokens and 0 elsewhere.

One JSON line is one conversation: `{"messages": [{"role": ..., "content": ...}, ...]}`, or
`{"prompt": ..., "response": ...}` (optionally with "system"), which is the conversation
system? / user / assistant. Each message's content is text: a string, or OpenAI's list of text
parts joined (`_message`); anything else is refused, never rendered as its Python repr.
The template is the folder's chat_template.jinja, else tokenizer_config.json's
"chat_template" (a string, or a list of named templates whose "default" is used), as
transformers picks it. It is rendered the way transformers' `apply_chat_template`
renders it: jinja2's sandboxed environment with trim_blocks and lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` filter that keeps non-ASCII text, the folder's
special tokens (bos_token, eos_token, ...) as variables, tools and documents None, and
add_generation_prompt False. The rendered text is tokenized without the post-processor's
BOS/EOS (the template writes BOS itself), as `apply_chat_template(tokenize=True)` does.

Where the assistant's tokens are: rendering prefixes of the conversation (`assistant_spans`).
Searching the rendered text for each reply fails wherever a template changes the text (Llama 3
trims it, others escape or reformat it) or a reply also occurs earlier; `{% generation %}`
markers (transformers' return_assistant_tokens_mask) exist in few published templates. A
template is a function of the messages so far, so rendering messages[:i] with the generation
prompt gives the text up to where reply i starts, and messages[:i+1] without it the text up to
where it ends: this works with any template whose earlier turns do not change when later ones
follow, which is checked, and it costs 2 renders per assistant message.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from fitgpt.data.indexed import LOSS_MASK_SUFFIX, paths
from fitgpt.data.tokenizer import JSONTokenizer, Tokenizer
from fitgpt.errors import UserError

ASSISTANT = "assistant"
CHAT_MADE_BY = "fitgpt data preprocess --chat"  # the record's made_by for chat data (sidecar.py)
CHAT_SUFFIX = "_chat_document"  # what `preprocess --chat` names its pair: PREFIX_chat_document
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # names templates read it under


class ChatLineError(ValueError):
    """One conversation that cannot be used; the message says what is wrong and the fix."""


# A conversation file saved as one JSON array (`json.dump(rows, f)`, pretty-printed or not), the
# likeliest first mistake: its first line is `[` or the whole array
JSON_ARRAY = (
    "a JSON array: the file looks like one array of conversations, not JSON lines; write one "
    "conversation a line (jq -c '.[]' FILE > FILE.jsonl)"
)


def template_text(tok: Tokenizer) -> str:
    """The chat template of `tok`'s folder, or a one-line refusal naming the fix."""
    if not isinstance(tok, JSONTokenizer):
        raise UserError(
            f"--chat needs a Hugging Face tokenizer folder with a chat template; {tok.name} is "
            "not one: pass --tokenizer DIR holding tokenizer.json and tokenizer_config.json"
        )
    jinja = tok.folder / "chat_template.jinja"
    if jinja.is_file():  # transformers 5 writes the template here, and prefers it
        return jinja.read_text(encoding="utf-8")
    found = tok.config.get("chat_template")
    if isinstance(found, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        if "default" not in named:
            raise UserError(
                f"{tok.folder}/tokenizer_config.json: chat templates {sorted(map(str, named))} "
                "but none named default; put the one to train with in chat_template.jinja"
            )
        found = named["default"]
    if not isinstance(found, str) or not found.strip():
        raise UserError(
            f"tokenizer {tok.name} has no chat template (no chat_template.jinja, no "
            '"chat_template" in tokenizer_config.json); use the instruct model\'s tokenizer '
            "folder or add its template there"
        )
    return found


def _environment():
    """A sandboxed jinja2 environment with what chat templates expect of transformers'."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body: the assistant spans come
        from rendering prefixes (module docstring), so the marker adds nothing here."""

        tags = frozenset({"generation"})

        def parse(self, parser) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Namespace(jinja2.utils.Namespace):
        """namespace() without underscore names: templates come from the Hub, and a stored
        `__class__` is a first step out of the sandbox."""

        def __init__(*args, **kwargs):  # self among args: namespace(self=...) stays usable
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for k in attrs:
                Namespace.check(k)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} refused")

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # jinja's own tojson escapes <, >, & and ' for HTML; templates want the JSON itself
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        namespace=Namespace,
    )
    return env


class ChatEncoder:
    """Renders, tokenizes and masks conversations with one tokenizer folder's chat template."""

    def __init__(self, tok: Tokenizer) -> None:
        import jinja2

        self.source = template_text(tok)
        self.tok: JSONTokenizer = tok  # type: ignore[assignment]  (template_text checked it)
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise UserError(
                f"the chat template of {tok.name} is not valid jinja (line {e.lineno}: "
                f"{e.message}); fix the template"
            ) from None
        self._variables = dict(self.tok.special_tokens, tools=None, documents=None)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for `messages`; a template that refuses them (raise_exception,
        or a failure inside it) raises ChatLineError with its message."""
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._variables
            )
        except Exception as e:  # raise_exception's TemplateError, or any error inside the template
            raise ChatLineError(
                f"the chat template refuses this conversation ({type(e).__name__}: "
                f"{str(e)[:160]}); fix the roles or contents the template expects"
            ) from None

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the [start, end) characters of each assistant reply).

        A reply starts where the text rendered up to it with the generation prompt stops
        agreeing with the text rendered with it (the end of the prompt, as a template's
        generation prompt is the header it writes before a reply), and ends where the text
        rendered with it ends, less trailing whitespace: the end-of-turn token (<|eot_id|>,
        <|im_end|>, </s>) is the reply's, for the model to learn to stop, while the newline a
        template writes after it opens the next turn and is never generated.
        """
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != ASSISTANT:
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not full.startswith(upto):
                raise ChatLineError(
                    f"the chat template renders turns before message {i + 1} differently once "
                    "later turns follow, so the assistant's tokens cannot be located; split the "
                    "conversation into one line per assistant reply"
                )
            start = _common_prefix(before, upto)
            end = max(start, len(upto.rstrip()))
            if end > start:
                spans.append((start, end))
        return full, spans

    def blank_replies(self, messages: list[dict]) -> int:
        """How many assistant messages of a checked conversation say nothing: no text but
        whitespace, no tool call, and no reasoning this template renders (one that never reads
        it renders the reply as empty). Trained on, they teach the model to end its turn at
        once."""
        keys = ["content", *(k for k in _REASONING_KEYS if k in self.source)]
        return sum(
            m["role"] == ASSISTANT
            and not m.get("tool_calls")
            and not any(str(m.get(k) or "").strip() for k in keys)
            for m in messages
        )

    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(token ids, loss mask): 1 for each token that overlaps an assistant reply, as
        transformers marks every token holding a character of a generation block."""
        if "tool_calls" not in self.source:
            calls = [n for n, m in enumerate(messages, 1) if m.get("tool_calls")]
            if calls:  # the template would render the message as if it called nothing
                raise ChatLineError(
                    f"message {calls[0]} calls tools, but the chat template never reads "
                    '"tool_calls", so the call would be dropped from the text trained on; use '
                    "the model's tool-calling template, or write the call into the content"
                )
        text, spans = self.assistant_spans(messages)
        ids, offsets = self.tok.encode_offsets(text)
        mask = [0] * len(ids)
        k = 0  # spans and tokens both run left to right: one merge-like pass
        for t, (a, b) in enumerate(offsets):
            while k < len(spans) and spans[k][1] <= a:
                k += 1
            if k < len(spans) and a < spans[k][1] and b > spans[k][0]:
                mask[t] = 1
        if not any(mask):
            raise ChatLineError(
                "the rendered conversation holds no assistant token (the template drops the "
                "replies?); give each sample an assistant reply the template renders"
            )
        return ids, mask


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first difference: texts run to thousands of characters
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def conversation(obj: object) -> list[dict]:
    """The messages of one parsed JSON line, checked: a list of objects with a string role, at
    least one of them the assistant's, each content text (`_message`). prompt/response lines
    become user + assistant (after a system message when the line has "system")."""
    if isinstance(obj, list):  # the whole file as one array: a .json, not JSON lines
        raise ChatLineError(JSON_ARRAY)
    if not isinstance(obj, dict):
        raise ChatLineError(
            f'a JSON {json_type(obj)}, not an object; write {{"messages": [...]}} or '
            '{"prompt": ..., "response": ...}'
        )
    if "messages" in obj:
        messages = obj["messages"]
    elif "prompt" in obj and "response" in obj:
        messages = _prompt_response(obj)
    else:
        keys = ", ".join(list(obj)[:5]) or "none"
        raise ChatLineError(
            f'no "messages" (keys: {keys}); write {{"messages": [{{"role": ..., "content": '
            '...}, ...]} or {"prompt": ..., "response": ...}'
        )
    if not isinstance(messages, list) or not messages:
        raise ChatLineError('"messages" must be a non-empty list of {"role", "content"} objects')
    for n, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise ChatLineError(
                f'message {n} is not an object with a string "role"; write '
                '{"role": "user", "content": ...}'
            )
    if not any(m["role"] == ASSISTANT for m in messages):
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
        raise ChatLineError(
            f'no message has role "assistant" (roles: {roles}), so nothing is trained on; '
            "add the reply, or fix the role's spelling"
        )
    return [_with_reasoning_aliases(_message(n, m)) for n, m in enumerate(messages, 1)]


def _prompt_response(obj: dict) -> list[dict]:
    """system? / user / assistant from a prompt/response line. A "system" of null is no system
    message (a column some rows leave empty); any other non-string is refused, not dropped."""
    for key in ("prompt", "response", "system"):
        value = obj.get(key)
        if not isinstance(value, str) and (key != "system" or value is not None):
            leave = ', or leave "system" out' if key == "system" else ""
            raise ChatLineError(
                f'"{key}" is a JSON {json_type(value)}, not a string; write it as text{leave}'
            )
    messages = [{"role": "user", "content": obj["prompt"]}]
    messages.append({"role": ASSISTANT, "content": obj["response"]})
    if obj.get("system") is not None:
        messages.insert(0, {"role": "system", "content": obj["system"]})
    return messages


def _message(n: int, m: dict) -> dict:
    """Message `n` with its content as text, the way the templates read it.

    The content must be a string, or OpenAI's list of parts, whose text parts are joined with
    nothing between them: what the templates that take that form render (Qwen2-VL's, Llama 4's
    and Mistral's loop over the parts and write each text part), while the others cannot take a
    list (Qwen 2.5's concatenates the content and fails; Llama 3's trims it, which renders the
    list's Python repr). Only an assistant message that calls tools may have no content (OpenAI
    writes null there). Other keys whose value is null are dropped, as transformers'
    apply_chat_template drops them (OpenAI exports write `"tool_calls": null`)."""
    where = f'message {n} ("{m["role"]}")'
    for key in _REASONING_KEYS:
        if m.get(key) is not None and not isinstance(m[key], str):
            raise ChatLineError(
                f'{where} "{key}" is a JSON {json_type(m[key])}, not a string; write it as text'
            )
    content = m.get("content")
    if content is None:
        if m["role"] == ASSISTANT and m.get("tool_calls"):
            return {k: v for k, v in m.items() if v is not None}
        if "content" in m:
            raise ChatLineError(f'{where} "content" is null; write the message\'s text there')
        keys = ", ".join(k for k in m if k != "role") or "only role"
        raise ChatLineError(
            f'{where} has no "content" (other keys: {keys}); write its text under "content"'
        )
    if isinstance(content, list):
        content = _joined_parts(where, content)
    elif not isinstance(content, str):
        raise ChatLineError(
            f'{where} "content" is a JSON {json_type(content)}, not text; write it as a string '
            '(or a list of {"type": "text", "text": ...} parts)'
        )
    return {**{k: v for k, v in m.items() if v is not None}, "content": content}


def _joined_parts(where: str, parts: list) -> str:
    """The text of OpenAI's content parts [{"type": "text", "text": ...}, ...], joined; any
    other part (an image, audio, a file, a refusal) is refused: it has no text to train on."""
    texts = []
    for k, part in enumerate(parts, 1):
        if not isinstance(part, dict):
            what = f"is a JSON {json_type(part)}, not an object"
        elif part.get("type") != "text":
            what = f"is of type {json.dumps(part.get('type'), ensure_ascii=False)}"
        elif not isinstance(part.get("text"), str):
            what = f'has a "text" that is a JSON {json_type(part.get("text"))}'
        else:
            texts.append(part["text"])
            continue
        raise ChatLineError(
            f'{where} "content" part {k} {what}; only {{"type": "text", "text": ...}} parts '
            "train a text model: remove the others, or write the content as a string"
        )
    return "".join(texts)


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type: what the user wrote, not Python's name for it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    names = {str: "string", int: "number", float: "number", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _with_reasoning_aliases(m: dict) -> dict:
    """A reply's reasoning under every name templates read it by (transformers does the same:
    Qwen 3 reads reasoning_content, gpt-oss thinking)."""
    reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
    if reasoning is None:
        return m
    return {"thinking": reasoning, **m, "reasoning_content": reasoning}


def mask_prefix(prefix: str) -> str:
    """Where the loss mask of the pair at `prefix` lives: PREFIX.loss_mask.bin/.idx."""
    return prefix + LOSS_MASK_SUFFIX


def has_mask(prefix: str) -> bool:
    return all(p.is_file() for p in paths(mask_prefix(prefix)))


def is_chat_data(prefix: str) -> bool:
    """Whether the pair at `prefix` is chat data (its loss-mask pair beside it). Chat data whose
    mask is missing is refused: without it every token would train, the prompts and template
    markup as much as the replies. Copying only .bin/.idx (Megatron's habit) loses it; such a
    pair is known by its record (written by `preprocess --chat`) or, with no record, its name."""
    if has_mask(prefix):
        return True
    from fitgpt.data import sidecar

    record = sidecar.read(prefix)
    lost = f"its loss mask {mask_prefix(prefix)}.bin/.idx is missing"
    if record is not None and record["made_by"].startswith(CHAT_MADE_BY):
        raise UserError(
            f"{prefix} is chat data (made by `{record['made_by']}`), but {lost}: every token "
            "would train as plain text; copy the .loss_mask pair beside it, or re-run "
            "`fitgpt data preprocess --chat`"
        )
    if record is None and Path(prefix).name.endswith(CHAT_SUFFIX):
        raise UserError(
            f"{prefix} is named as `fitgpt data preprocess --chat` names chat data, but {lost} "
            "(and it has no .fitgpt.json record): every token would train as plain text; copy "
            "the .loss_mask pair and the record beside it, or rename the pair if it is text"
        )
    return False


def end_of_turn_id(tok) -> int | None:
    """The token `tok`'s chat template ends an assistant turn with (<|im_end|>, <|eot_id|>,
    </s>, <end_of_turn>): what the template writes after a reply's text, where
    assistant_spans finds the reply's end, when that is one token. None without a template, or where a turn
    ends in plain text or in nothing. A chat fine-tune learnt to stop there (its loss covers
    that token), so its export and
    `generate --chat` stop there too, whatever eos_token the folder declares."""
    reply = "Yes"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    try:
        text, spans = ChatEncoder(tok).assistant_spans(messages)
    except (UserError, ChatLineError):  # no template, or one that refuses this conversation
        return None
    if not spans:
        return None
    start, end = spans[-1]
    cut = text.rfind(reply, start, end)
    if cut < 0:  # a template that rewrites the reply's text: its end cannot be told apart
        return None
    ids = tok.encode_plain(text[cut + len(reply) : end].strip())
    return ids[0] if len(ids) == 1 else None
