"""The model floor: what a decoder computes and what the rest of fitgpt needs to know of it.
config.py is the one ModelConfig of every family, family.py the interface a family fills in,
decoder.py the network shape they share, families/ one folder per family (network, Family,
presets, Hugging Face name map) and the registry naming them, presets.py the presets gathered,
hf_map.py what a Hugging Face name map is. This module re-exports what the other floors use."""

from fitgpt.model.config import ModelConfig, padded_vocab
from fitgpt.model.decoder import DecoderLM, KVCache
from fitgpt.model.families import build_model, family_of, register_family
from fitgpt.model.families.gpt2.model import GPT
from fitgpt.model.families.llama.model import Llama
from fitgpt.model.family import Family, Split
from fitgpt.model.presets import PRESETS, get_preset

__all__ = [
    "GPT",
    "PRESETS",
    "DecoderLM",
    "Family",
    "KVCache",
    "Llama",
    "ModelConfig",
    "Split",
    "build_model",
    "family_of",
    "get_preset",
    "padded_vocab",
    "register_family",
]
