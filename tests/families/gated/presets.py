"""The gated family's one config: 2 layers 32 wide, no biases, a vocabulary of 96."""

from __future__ import annotations

from families.gated.family import FAMILY
from fitgpt.model import ModelConfig

TINY = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=32, vocab_size=96, bias=False,
                   family=FAMILY.name)  # fmt: skip
