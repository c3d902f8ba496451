"""A second model family, for the tests only (issue 21): it differs from GPT-2 where the engine,
the planner and tensor parallelism would notice if they assumed GPT-2: RMSNorm without biases,
no position table, a gated MLP of three linears (two column-parallel, one row-parallel) 3·h wide,
and an untied head. model.py is its network, family.py its Family (registered on import, as a
plugin's would be: nothing in fitgpt names it), presets.py its one tiny config. It has no
Hugging Face name map.
"""
