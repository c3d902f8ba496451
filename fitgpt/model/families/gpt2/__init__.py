"""GPT-2, fitgpt's first family: pre-LayerNorm blocks, learned or ALiBi positions, a 4·hidden
GELU MLP and an optional LayerNorm after the embedding. model.py is the network, family.py what
the engine, planner and tensor parallelism need to know of it (FAMILY), presets.py its named
sizes from the CPU demo to 40 B, and hf.py its map to Hugging Face's GPT2LMHeadModel (MAPPING).
"""
