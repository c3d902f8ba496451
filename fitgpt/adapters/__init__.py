"""Adapters: small trained matrices added to a frozen model, applied to a built model from
outside it (as fitgpt/parallel cuts one). The model files hold only models; what an adapter is,
which layers it adapts and how it is written and read live here.

LoRA (Hu et al., 2021), as Hugging Face PEFT defines it: a targeted linear y = x·Wᵀ becomes
y = x·Wᵀ + s·B·A·x, with A [r, in] and B [out, r] trained and W frozen; s = alpha/r (rsLoRA:
alpha/√r). A starts Kaiming-uniform, B at zero, so the first forward is the base's.

  config.py    AdapterConfig: the --lora-* flags, checked in __post_init__
  targets.py   which linears are adapted: Hugging Face module names (q_proj, c_attn, ...)
               mapped to fitgpt's modules through the family's name map (model/hf_map.py)
  lora.py      the adapted linear, attaching adapters to a built model, PEFT's initialisation
  merge.py     W + s·B·A: the merged weights, read like any checkpoint's
  peft.py      PEFT's adapter folder (adapter_config.json, adapter_model.safetensors) written
               and read

The engine (engine/ddp.py) attaches them and trains only them, its base held in
--base-format (engine/formats/frozen_base.py: fp32, bf16, int8, NF4 through bitsandbytes) and
streamed by engine/chunked/frozen.py as the planner places it (plan/adapter.py); a checkpoint holds the
adapters and their optimizer, and names the base by its --init-from source (docs/adapters.md).
"""

from fitgpt.adapters.config import AdapterConfig
from fitgpt.adapters.targets import Target, lora_targets

__all__ = ["AdapterConfig", "Target", "lora_targets"]
