"""Llama 3, and the network it shares with qwen2, qwen3 and mistral: RMSNorm, rotary positions
(with linear, Llama 3's or YaRN's scaling), grouped-query attention and a SwiGLU MLP, no biases.
model.py is that network, family.py LlamaFamily (FAMILY; the three other folders subclass it),
presets.py Llama 3.1/3.2's shapes and the CPU demo `tiny-llama`, and hf.py the map to Hugging
Face's LlamaForCausalLM (MAPPING), which the other three subclass. Nothing here imports them.
"""
