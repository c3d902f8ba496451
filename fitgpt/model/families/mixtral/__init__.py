"""Mixtral: the mixture-of-experts Llama of ../qwen3_moe/ (every layer sparse, the top-k
weights always renormalised and kept in fp32) with Mistral's sliding window in every layer
where the config sets one. model.py is the network (Mixtral), family.py its Family (FAMILY),
presets.py 8x7B and 8x22B, hf.py the map to MixtralForCausalLM (MAPPING).
"""
