"""Qwen3-MoE: the Llama network (../llama/) with Qwen3's q/k norms and a mixture of experts as
the MLP of its sparse layers. model.py is the network (MoeLlama: the router, the experts over
sorted tokens, the load-balancing loss; mixtral's network subclasses it), family.py its Family
(FAMILY: total parameters, active FLOPs; MoeCounts, which mixtral's shares), presets.py
30B-A3B and 235B-A22B, and hf.py the map to Qwen3MoeForCausalLM (MAPPING; MoeMapping, which
mixtral's subclasses).
"""
