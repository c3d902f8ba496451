from fitgpt.model.config import PRESETS, ModelConfig, get_preset, padded_vocab
from fitgpt.model.decoder import DecoderLM, KVCache
from fitgpt.model.family import Family, Split, build_model, family_of, register_family
from fitgpt.model.gpt import GPT
from fitgpt.model.llama import Llama

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
