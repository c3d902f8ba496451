"""fitgpt: train the largest GPT a machine can hold, fast."""

__version__ = "0.1.0"
