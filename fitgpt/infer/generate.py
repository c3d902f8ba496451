"""Sampling from a trained checkpoint: KV cache, temperature, top-k, top-p.

Each new token is predicted from the last seq_len tokens at most: a prompt or an output longer
than the model's context slides the window (the KV cache is rebuilt for each token once the
window slides, since learned positions shift), and never shortens the output. Generation stops
at any of the tokenizer's stop ids (data/tokenizer.py `stop_ids`: the end-of-document token,
the declared eos_token, generation_config.json's eos_token_id list, e.g. Llama 3's <|eot_id|>
and <|end_of_text|>) unless `ignore_eos` is set.

Chat (`chat_prompt`): the prompt as one user turn of the tokenizer's chat template with its
generation prompt, rendered by the chat data's own renderer (data/chat.py ChatEncoder) and
encoded as transformers' `apply_chat_template(add_generation_prompt=True, tokenize=True)`
encodes it (the template writes BOS; no second one is added); the reply stops at the token the
template ends a reply with, as well as at the stop ids.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from fitgpt.data.tokenizer import Tokenizer, load_tokenizer, same_vocabulary
from fitgpt.engine.layout import chunk_layout
from fitgpt.engine.state_io import StateReader
from fitgpt.errors import UserError
from fitgpt.model import DecoderLM, KVCache, ModelConfig, build_model
from fitgpt.train import checkpoint as ckpt_io


@dataclass(frozen=True)
class SampleConfig:
    max_new_tokens: int = field(default=200, metadata={"help": "tokens to generate"})
    temperature: float = field(default=0.8, metadata={"help": "0 = greedy"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens (0 = all)"})
    top_p: float = field(
        default=1.0, metadata={"help": "keep the smallest set with this much probability"}
    )
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    ignore_eos: bool = field(
        default=False,
        metadata={
            "help": "keep generating past the tokenizer's stop tokens (end of document, "
            "eos, generation_config.json's eos_token_id)"
        },
    )

    def __post_init__(self) -> None:
        # a NaN passes every comparison but `==`, and an infinite temperature makes every
        # token equally likely whatever the model says: both are refused, not sampled from
        bad = [
            (self.max_new_tokens < 1, "max-new-tokens", self.max_new_tokens, "at least 1"),
            (
                not (math.isfinite(self.temperature) and self.temperature >= 0),
                "temperature",
                self.temperature,
                "a finite number >= 0 (0 = greedy)",
            ),
            (self.top_k < 0, "top-k", self.top_k, "0 (all tokens) or more"),
            (not 0 < self.top_p <= 1, "top-p", self.top_p, "in (0, 1]"),
        ]
        for wrong, flag, value, want in bad:
            if wrong:
                raise UserError(f"--{flag} {value}: must be {want}")


def checkpoint_meta(path: Path) -> tuple[Path, dict, ModelConfig]:
    """(the checkpoint folder `path` names, its meta, its model's config): what the tokenizer
    and chat checks need, read before any weight."""
    ckpt = ckpt_io.resolve_held(path)
    meta = ckpt_io.load_meta(ckpt)
    return ckpt, meta, ModelConfig.from_dict(meta["config"]["model"])


def generation_context(cfg: ModelConfig) -> int:
    """The tokens a generating model reads at most, as transformers reads the export: a rotary
    model's max_positions (a Hugging Face folder's max_position_embeddings, kept through import
    and fine-tuning) where that is more than the training run's --seq-len, a learned table's
    rows (cfg.positions: GPT-2's n_positions, also after a fine-tune at a shorter --seq-len),
    else seq_len. Fine-tuned at 4096 from a 131,072-token Llama, the reply to a long
    conversation sees it all, as transformers' does, not its last 4096."""
    if cfg.position == "learned":
        return cfg.positions
    if not cfg.max_positions:
        return cfg.seq_len
    return max(cfg.seq_len, cfg.max_positions)


def load_model(
    path: Path, device: torch.device, merged=None, seq_len: int | None = None
) -> tuple[DecoderLM, dict]:
    """The checkpoint's weights in a plain model on `device` (bf16 on GPUs, fp32 on CPUs), read
    with the trainer's checks: checksums, sizes, the layout against the model's own, CRCs. An
    adapter run's checkpoint holds no model: `merged` reads its base with the adapters merged
    in (interop/adapter_export.py, opened by the command, which may read the base's format).
    `seq_len`: the context the model is built for (generate's: generation_context), if not
    the training run's; no weight depends on it where it may differ."""
    ckpt, meta, cfg = checkpoint_meta(path)
    if seq_len is not None:
        cfg = cfg.replace(seq_len=seq_len)
    if merged is None and meta["config"].get("adapter", {}).get("lora_rank") is not None:
        raise UserError(
            f"{ckpt} holds LoRA adapters, not a model: export it with them merged in (fitgpt "
            f"export --ckpt {path} --format hf --merge --out DIR)"
        )
    with torch.device("meta"):
        model = build_model(cfg)
    layout = chunk_layout(model)  # the model's own layout: a tampered one cannot load
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to_empty(device=device).to(dtype)
    model.materialize_buffers(device)  # to_empty left them undefined (ALiBi's slopes)
    params = dict(model.named_parameters())
    with ckpt_io.pointing_back(ckpt), torch.no_grad():
        reader = merged.reader if merged is not None else StateReader(ckpt)
        if merged is None:  # a merged base's layout is checked where it is opened
            ckpt_io.check_layout(meta, layout, ckpt)
        for c in layout:
            flat = reader.read(c.index, "master", 0, c.numel)
            for s in c.slots:
                params[s.name].copy_(flat[s.offset : s.offset + s.numel].view(s.shape))
    return model.eval(), meta


def tokenizer_for(meta: dict, override: str | None, cfg: ModelConfig) -> Tokenizer:
    """The checkpoint's tokenizer, or `override` if it fits the model: never one with more
    tokens than the model's vocabulary, nor another vocabulary than the one recorded."""
    recorded = meta.get("tokenizer")
    spec = override or recorded
    if spec is None:
        raise UserError(
            "this checkpoint was trained without a tokenizer (synthetic data, or the token ids "
            f"of `fitgpt data fake`, {cfg.vocab_size:,} of them): its ids are no text to "
            "decode; pass --tokenizer only with the tokenizer that made its data"
        )
    tok = load_tokenizer(spec)
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(
            f"--tokenizer {spec}: {tok.vocab_size} tokens, but the model knows {cfg.vocab_size}; "
            f"pass the tokenizer it was trained with{f' ({recorded})' if recorded else ''}"
        )
    if override and recorded and override != recorded and not same_vocabulary(tok, recorded):
        raise UserError(
            f"--tokenizer {override} is another vocabulary than the checkpoint's ({recorded}); "
            "drop --tokenizer, or pass one with the same tokens"
        )
    return tok


def filter_logits(logits_BV: Tensor, top_k: int, top_p: float) -> Tensor:
    if top_k:
        kth = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1])).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_l, order = torch.sort(logits_BV, descending=True)
        cum = sorted_l.softmax(-1).cumsum(-1)
        drop = cum - sorted_l.softmax(-1) > top_p  # keep the token that crosses top_p
        sorted_l = sorted_l.masked_fill(drop, float("-inf"))
        logits_BV = torch.full_like(logits_BV, float("-inf")).scatter(-1, order, sorted_l)
    return logits_BV


def pick(logits_BV: Tensor, cfg: SampleConfig, gen: torch.Generator) -> Tensor:
    logits_BV = logits_BV.float()
    if cfg.temperature == 0:
        return logits_BV.argmax(-1, keepdim=True)
    # shifted so the largest is 0 before dividing: the same distribution, but a tiny temperature
    # cannot overflow a logit to inf (inf - inf in the softmax would be NaN)
    shifted_BV = logits_BV - logits_BV.amax(-1, keepdim=True)
    probs = filter_logits(shifted_BV / cfg.temperature, cfg.top_k, cfg.top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=gen)


class _Window:
    """The model's view of the sequence: its last seq_len tokens, through a KV cache if asked.

    `logits` is the next-token distribution [B, V]. While the sequence fits the context, each
    new token is one cached step; once it does not, every step re-reads the last seq_len tokens
    (the positions of the kept tokens change, so the cache cannot be reused)."""

    def __init__(self, model: DecoderLM, idx_BT: Tensor, use_cache: bool, new: int) -> None:
        self.model, self.use_cache, self.S = model, use_cache, model.cfg.seq_len
        # the cache holds what this call can reach, not the whole context: a 131,072-token
        # Llama 3.1's is 16 GiB at 8 B, its 200-token reply's a few MiB
        self.capacity = min(self.S, idx_BT.shape[1] + new)
        self.seq_BT = idx_BT
        self.logits = self._read_window()

    def _read_window(self) -> Tensor:
        window_BT = self.seq_BT[:, -self.S :]
        if not self.use_cache:
            return self.model(window_BT)[:, -1]
        dtype = next(self.model.parameters()).dtype
        B = window_BT.shape[0]
        self.cache = KVCache(self.model.cfg, B, window_BT.device, dtype, self.capacity)
        return self.model(window_BT, cache=self.cache)[:, -1]

    def push(self, nxt_B1: Tensor) -> None:
        self.seq_BT = torch.cat([self.seq_BT, nxt_B1], dim=1)
        if self.use_cache and self.cache.length < self.S:
            self.logits = self.model(nxt_B1, cache=self.cache)[:, -1]
        else:
            self.logits = self._read_window()


def _warn(message: str) -> None:
    warnings.warn(message, ContextWarning, stacklevel=4)  # past torch.no_grad's wrapper


class ContextWarning(UserWarning):
    """The prompt and output outgrow the model's context: the model sees only their end."""


def context_note(model: DecoderLM, prompt_len: int, cfg: SampleConfig) -> str | None:
    """The line saying that the model will not see the whole prompt and output (its context is
    the training run's --seq-len), or None when they fit."""
    S = model.cfg.seq_len
    if prompt_len + cfg.max_new_tokens <= S:
        return None
    cut = f"the first {prompt_len - S} prompt tokens are not seen; " if prompt_len > S else ""
    return (
        f"prompt ({prompt_len} tokens) and output exceed the model's context of {S} tokens; "
        f"{cut}each new token sees the last {S}"
    )


@torch.no_grad()
def generate(
    model: DecoderLM,
    idx_BT: Tensor,
    cfg: SampleConfig,
    use_cache: bool = True,
    stop_ids: tuple[int, ...] = (),
    vocab_size: int | None = None,
    note: Callable[[str], None] = _warn,
) -> Tensor:
    """Prompt plus up to max_new_tokens new tokens, [B, T + n].

    n is max_new_tokens unless every row has produced one of `stop_ids` (kept, as the row's
    last token; rows that ended first are padded with the id they stopped at), and
    `cfg.ignore_eos` is off. Ids at or above `vocab_size` (a tokenizer smaller than the model's
    vocabulary) are never sampled. Past the model's context only the last seq_len tokens are
    read: `note` gets `context_note`'s line first (default: a ContextWarning), so a long prompt
    is never cut without a word."""
    told = context_note(model, idx_BT.shape[1], cfg)
    if told:
        note(told)
    gen = torch.Generator(device=idx_BT.device).manual_seed(cfg.seed)
    stops = None
    if stop_ids and not cfg.ignore_eos:
        stops = torch.tensor(sorted(set(stop_ids)), device=idx_BT.device)
    window = _Window(model, idx_BT, use_cache, cfg.max_new_tokens)
    B = idx_BT.shape[0]
    done_B = torch.zeros(B, dtype=torch.bool, device=idx_BT.device)
    last_B1 = torch.zeros(B, 1, dtype=idx_BT.dtype, device=idx_BT.device)
    out = [idx_BT]
    for i in range(cfg.max_new_tokens):
        logits_BV = window.logits
        if vocab_size is not None and vocab_size < logits_BV.shape[-1]:
            logits_BV = logits_BV.clone()
            logits_BV[:, vocab_size:] = float("-inf")
        nxt = pick(logits_BV, cfg, gen)
        if stops is not None:
            nxt = torch.where(done_B[:, None], last_B1, nxt)  # an ended row repeats its stop id
            done_B |= torch.isin(nxt[:, 0], stops)
            last_B1 = nxt
        out.append(nxt)
        if stops is not None and bool(done_B.all()):  # host sync per token: cheap next to a step
            break
        if i + 1 < cfg.max_new_tokens:
            window.push(nxt)
    return torch.cat(out, dim=1)


def strip_stop(ids: list[int], stop_ids: tuple[int, ...], cfg: SampleConfig) -> list[int]:
    """One row's ids without the stop id that ended it (and the padding after it): the stop
    ends the text and is not printed."""
    if cfg.ignore_eos:
        return ids
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[:i]
    return ids


def chat_prompt(tok: Tokenizer, prompt: str) -> tuple[list[int], tuple[int, ...]]:
    """(`prompt` as one user turn of `tok`'s chat template with the generation prompt, as ids;
    the ids the reply stops at).

    The ids are transformers' `apply_chat_template([user], add_generation_prompt=True,
    tokenize=True)`: the text the chat data is rendered with (data/chat.py ChatEncoder), encoded
    without the post-processor's BOS, since the template writes its own. The stops are the
    tokenizer's `stop_ids` and the template's end of turn (data/chat.py end_of_turn_id, which the
    export names too), which a base tokenizer's eos_token (<|end_of_text|>) is not. A tokenizer without a chat template, or a
    template that refuses the turn, is refused in one line."""
    from fitgpt.data.chat import ChatEncoder, ChatLineError, end_of_turn_id

    enc = ChatEncoder(tok)  # refuses a tokenizer without a template, naming the fix
    try:
        text = enc.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    except ChatLineError as e:
        raise UserError(f"--chat with tokenizer {tok.name}: {e}") from None
    turn = end_of_turn_id(enc.tok)
    stops = {*tok.stop_ids} if turn is None else {*tok.stop_ids, turn}
    return enc.tok.encode_plain(text), tuple(sorted(stops))
