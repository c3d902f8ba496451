"""Qwen3: the Llama network (../llama/) with an RMSNorm over each head of q and k before the
rotation. family.py allows that one field (FAMILY), presets.py holds Qwen3 8 B and 32 B, and
hf.py maps Qwen3ForCausalLM (MAPPING), whose config.json reads as Qwen2's (../qwen2/hf.py).
"""
