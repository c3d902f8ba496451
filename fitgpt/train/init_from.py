"""`fitgpt train --init-from SRC`: a new run that starts from another model's weights.

SRC is a fitgpt run or checkpoint, or a Hugging Face checkpoint (a folder with config.json, or
its weight file). The architecture is SRC's; the data, schedule, placement and world size are
this command's; the optimizer, step count and data position start fresh. A source in another
format carries a WeightSource (engine/state_io.py; supplied by the layer that recognised it:
interop/init_source.py for Hugging Face) that the engines load like a weights-only checkpoint,
each rank reading its own ranges where the source lies: no copy on disk, so any engine, stage,
placement, TP degree and world size can train it. This module never imports the formats it is
handed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fitgpt.data.config import vocab_for
from fitgpt.engine.state_io import WeightSource
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.train import checkpoint as ckpt_io

# model fields a fine-tune may set differently from its source (no weight depends on them)
FREE = ("dropout", "router_aux_loss_coef")


def free_fields(cfg: ModelConfig) -> tuple[str, ...]:
    """FREE, and the context length where no weight depends on it: rotary or ALiBi positions
    (no position table), or a learned table whose rows max_positions holds (table_pinned), so
    a fine-tune picks its own --seq-len, a GPT-2's up to its table's rows."""
    if cfg.position == "learned" and cfg.max_positions is None:
        return FREE
    return (*FREE, "seq_len")


def table_pinned(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with a learned position table's rows held in max_positions (a fitgpt run trained
    from scratch leaves it unset: the table has seq_len rows), so a fine-tune's shorter
    --seq-len keeps the weights' shape, as transformers trains GPT-2 at any length up to its
    n_positions with the whole table. Anything else as it is."""
    if cfg.position != "learned" or cfg.max_positions is not None:
        return cfg
    return dataclasses.replace(cfg, max_positions=cfg.seq_len)


@dataclass(frozen=True)
class InitSource:
    path: Path
    model: ModelConfig
    # a source in another format (a Hugging Face folder), read in place by every rank; None for
    # a fitgpt checkpoint, which is loaded through its meta.json and state files
    weights: WeightSource | None = None
    # the tokenizer the source was trained with (a spec, as meta.json records it), None when
    # unknown: the data must be made with it
    tokenizer: str | None = None


def fitgpt_source(path: Path) -> InitSource | None:
    """The fitgpt run or checkpoint at `path` with its architecture, read without loading any
    weights; None when `path` holds neither."""
    if (path / "meta.json").is_file() or ckpt_io.step_dirs(path):
        ckpt = ckpt_io.resolve(path)
        meta = ckpt_io.load_meta(ckpt)
        if meta["config"].get("adapter", {}).get("lora_rank") is not None:
            raise UserError(
                f"--init-from {path}: its checkpoints hold LoRA adapters, not a model; start "
                f"from their base, --lora-from a PEFT export of them (fitgpt export --ckpt {path}"
                " --format peft), or merge them first (--format hf --merge)"
            )
        model = table_pinned(ModelConfig.from_dict(meta["config"]["model"]))
        return InitSource(ckpt, model, tokenizer=meta.get("tokenizer"))
    return None


def check_same_architecture(meta: dict, model_cfg: ModelConfig, ckpt: Path) -> None:
    """Refuse, in one line naming the fields, a checkpoint (a resume's or an --init-from
    source's) whose model differs from `model_cfg` in more than the FREE fields."""
    saved, model_cfg = (
        table_pinned(ModelConfig.from_dict(meta["config"]["model"])),
        table_pinned(model_cfg),
    )
    free = {k: getattr(model_cfg, k) for k in free_fields(saved)}  # not in the weights' shape
    if dataclasses.replace(saved, **free) != model_cfg:
        diff = {
            k: (v, getattr(model_cfg, k))
            for k, v in saved.to_dict().items()
            if getattr(model_cfg, k) != v and k not in free_fields(saved)
        }
        raise UserError(
            f"{ckpt} holds another architecture (saved vs asked: {diff}); "
            "resume with the same --preset/--layers/--hidden/--heads/--seq-len"
        )


def check_context(source: InitSource, seq_len: int) -> None:
    """Refuse a --seq-len past the positions the source was made for (its config.json's
    max_position_embeddings, kept in max_positions): rotary positions have no table, so such a
    run trains, but on positions the weights never saw, and its export would still claim the
    shorter context. Extending a context is a choice made in the source's config (a larger
    max_position_embeddings, or a rope scaling), not by a flag's typo. A YaRN or linear
    scaling stretches the positions by its factor: Qwen2.5's long-context recipe adds YaRN
    (factor 4 over 32,768) and leaves max_position_embeddings at 32,768, as transformers reads
    it, so the context is the stretched one; Llama 3's scaling is already in its 131,072."""
    m = source.model
    limit = m.max_positions
    if limit is not None and m.rope_scaling is not None and m.rope_scaling.kind != "llama3":
        r = m.rope_scaling
        base = r.original_max_positions if r.kind == "yarn" else limit
        limit = max(limit, int(r.factor * base))
    if source.model.position == "learned" and seq_len > source.model.positions:
        raise UserError(
            f"--seq-len {seq_len} is past --init-from {source.path}'s learned position table "
            f"of {source.model.positions:,} rows (n_positions); pass --seq-len "
            f"{source.model.positions} or less"
        )
    if limit is not None and seq_len > limit:
        raise UserError(
            f"--seq-len {seq_len} is past --init-from {source.path}'s context of {limit:,} "
            f"tokens (max_position_embeddings); pass --seq-len {limit} or less, or extend the "
            "context in its config.json first (max_position_embeddings and rope scaling)"
        )


def model_from_source(source: InitSource, asked: dict, data) -> ModelConfig:
    """The run's model: the source's architecture, with the fields a fine-tune may change from
    `asked` (the model flags given); any other difference is refused in one line. So is data
    the source cannot train on: ids at or past its embedding rows (data/config.py vocab_for:
    the rows are the source's, more than its tokenizer's ids in released Qwen models), or made
    with a tokenizer other than the source's (data/config.py check_data_tokenizer)."""
    from fitgpt.data.config import check_data_tokenizer, data_tokenizer

    model = source.model
    for name, value in asked.items():
        if name == "seq_len":
            check_context(source, value)
        if name in free_fields(source.model):
            model = dataclasses.replace(model, **{name: value})
        elif getattr(model, name) != value:
            raise UserError(
                f"--init-from {source.path}: its model has {name}={getattr(model, name)!r}, this "
                f"command asks {value!r}; drop the flag (the architecture is the source's)"
            )
    tok = data_tokenizer(data)
    vocab_for(model, tok, keep_rows=True, whose=f"--init-from {source.path}")
    check_data_tokenizer(tok, source.tokenizer, data, f"--init-from {source.path}")
    return model


def load_source(source: InitSource, engine, model_cfg: ModelConfig, ctx) -> None:
    """The source's weights into `engine`, the optimizer fresh: a fitgpt checkpoint through its
    meta.json (architecture and layout checked), a WeightSource read in place (checked by its
    own preflight: interop/init_source.py). An adapter run's engine takes them as its frozen
    base (Engine.frozen)."""
    target = engine.frozen or engine
    if source.weights is not None:
        target.load_state(source.weights, {}, optimizer=False)
        return
    meta = ckpt_io.load_meta(source.path)
    check_same_architecture(meta, model_cfg, source.path)
    ckpt_io.load_state(source.path, meta, target, ctx, weights_only=True)
