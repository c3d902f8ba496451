"""Bringing models in and taking them out: Hugging Face GPT-2 checkpoints, DeepSpeed configs."""
