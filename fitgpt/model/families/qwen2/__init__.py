"""Qwen2 and Qwen2.5: the Llama network (../llama/) with biases on q, k and v. family.py allows
that one field (FAMILY), presets.py holds Qwen2.5's sizes from 0.5 B to 72 B, and hf.py maps
Qwen2ForCausalLM (MAPPING), refusing a checkpoint that slides a window in any layer.
"""
