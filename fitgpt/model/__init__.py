from fitgpt.model.config import PRESETS, ModelConfig, get_preset, padded_vocab
from fitgpt.model.gpt import GPT, KVCache

__all__ = ["GPT", "PRESETS", "KVCache", "ModelConfig", "get_preset", "padded_vocab"]
