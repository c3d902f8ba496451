"""Mistral: the Llama network (../llama/) with a sliding window in every layer, applied only to
sequences longer than it. family.py allows that one field (FAMILY), presets.py holds Mistral
7 B v0.3, and hf.py maps MistralForCausalLM (MAPPING).
"""
