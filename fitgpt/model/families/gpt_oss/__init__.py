"""gpt-oss (OpenAI's open-weight mixture of experts): the mixture-of-experts Llama of
../qwen3_moe/ with attention sinks, sliding and full layers alternating, biases on the
attention, router and experts, and a clamped SwiGLU. model.py is the network (GptOss),
family.py its Family (FAMILY), presets.py 20b and 120b, hf.py the map to GptOssForCausalLM
(MAPPING), reading the published folders' MXFP4 experts (interop/mxfp4.py).
"""
