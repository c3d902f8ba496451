"""`--tokenizer none`: pre-tokenized .bin/.idx data bounded by the model's --vocab-size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_config, train

from fitgpt.data.config import DataConfig, open_data
from fitgpt.data.indexed import IndexedWriter
from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.infer.generate import tokenizer_for
from fitgpt.model import ModelConfig
from fitgpt.train import checkpoint as ckpt_io


def _corpus(path: Path, top: int) -> str:
    """40 documents of a 4-successor Markov chain over ids < top, with id top - 1 present:
    int32 tokens, as Megatron writes for a vocabulary past 65500."""
    rng = np.random.default_rng(0)
    n = 40 * 100
    ids = np.empty(n, dtype=np.int64)
    ids[0] = 7
    for i in range(1, n):
        ids[i] = (ids[i - 1] * 31 + rng.integers(4)) % top
    ids[-1] = top - 1
    with IndexedWriter(str(path), np.int32) as w:
        w.add(ids, np.full(40, 100))
    return str(path)


def test_open_data_with_tokenizer_none_uses_the_models_vocabulary(tmp_path):
    prefix = _corpus(tmp_path / "c", top=60000)
    cfg = DataConfig(data=prefix, tokenizer="none", split="9,1")
    train_src, valid_src, tok = open_data(cfg, seq_len=16, vocab_size=60000, seed=0)
    assert tok is None and train_src.vocab_size == valid_src.vocab_size == 60000
    assert int(train_src.get(np.arange(64)).max()) < 60000
    with pytest.raises(UserError, match="holds token id 59999 but --vocab-size is 50257; pass "):
        open_data(cfg, seq_len=16, vocab_size=50257, seed=0)
    with pytest.raises(UserError, match="stdlib is text and needs a tokenizer"):
        DataConfig(data="stdlib", tokenizer="none")


def test_train_on_pretokenized_data_with_tokenizer_none(tmp_path):
    prefix = _corpus(tmp_path / "c", top=60000)
    run = run_config(
        tmp_path / "run", data=prefix, tokenizer="none", split="9,1", vocab_size=60000, steps=3
    )
    out = train(run, DistContext(0, 1, 0, torch.device("cpu")))
    assert len(out["losses"]) == 3 and all(np.isfinite(out["losses"]))
    assert abs(out["losses"][0] - np.log(60000)) < 1.0  # untrained: about ln V over 60000 ids
    meta = ckpt_io.load_meta(ckpt_io.resolve(tmp_path / "run"))
    assert meta["tokenizer"] is None and meta["config"]["model"]["vocab_size"] == 60000
    with pytest.raises(UserError, match="trained without a tokenizer"):
        model = ModelConfig.from_dict(meta["config"]["model"])
        tokenizer_for(meta, None, model)  # `fitgpt generate` asks for --tokenizer
