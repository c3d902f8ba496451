"""Which linears LoRA adapts: Hugging Face module names mapped to fitgpt's modules.

PEFT names its targets by the Hugging Face model's modules (q_proj, c_attn) and matches a name
against every module it ends (`layers.0.self_attn.q_proj` ends in `q_proj`). fitgpt's modules
differ: Llama's k and v are one linear (`attn.kv`), gate and up another (`mlp.fc`). The family's
name map (model/hf_map.py TensorMap: `part=(i, n)`, rows block i of n) says which rows of which
fitgpt weight each HF weight is, so an adapter of `k_proj` is one on the first half of the rows
of `attn.kv` (its B has that half's rows), and no second map is kept here.

The candidates are the HF weights of the blocks whose fitgpt parameter is an nn.Linear's weight,
in the map's order, which is the HF model's module order: PEFT creates its adapters in that
order, so the same seed draws the same A (lora.py). `all-linear` is every candidate (PEFT's
all-linear: every linear but the head). A mixture of experts' sparse MLP (router and experts)
is no candidate yet: transformers keeps both as plain parameters, not linears, and fitgpt does
not adapt them (PEFT 0.21's all-linear does, as target_parameters: its all-linear there is more
than fitgpt's, whose exported folder names the linears it adapted).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from fitgpt.adapters.config import ALL_LINEAR, AdapterConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, build_model
from fitgpt.model.families import hf_mapping


@dataclass(frozen=True)
class Target:
    """One adapted HF linear: its adapter is A [rank, in_features], B [out_features, rank],
    added to rows [lo, hi) of the output of fitgpt's linear `module`."""

    hf: str  # the HF module, as PEFT's keys name it: model.layers.0.self_attn.k_proj
    module: str  # fitgpt's nn.Linear: blocks.0.attn.kv
    lo: int  # its rows of the fitgpt weight [out, in]
    hi: int
    in_features: int
    conv1d: bool  # HF stores the weight [in, out] (GPT-2's Conv1D; PEFT's fan_in_fan_out)

    @property
    def name(self) -> str:
        """The HF module's own name (k_proj): the adapter's name inside fitgpt's module."""
        return self.hf.rsplit(".", 1)[-1]

    @property
    def out_features(self) -> int:
        return self.hi - self.lo


@functools.lru_cache(maxsize=32)
def _candidates(cfg: ModelConfig) -> tuple[tuple[Target, ...], tuple[str, ...]]:
    """(every adaptable HF linear of the blocks, in the HF model's order; the HF modules of a
    sparse MLP, which are not adaptable yet). Cached: building the model on the meta device
    takes ~80 ms at 80 blocks, and the LoRA planner times dozens of placements of one model."""
    mapping = hf_mapping(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    modules = dict(model.named_modules())
    sparse = set(cfg.moe_layers)
    out, experts = [], []
    for m in mapping.tensor_maps(cfg):
        layer = mapping.layer_of(m.hf)
        if layer is None or m.fitgpt is None or not m.hf.endswith(".weight"):
            continue
        hf = m.hf.removesuffix(".weight")
        module = m.fitgpt.removesuffix(".weight")
        if layer in sparse and ".mlp." in m.fitgpt:
            experts.append(hf)
            continue
        lin = modules.get(module)
        if not isinstance(lin, nn.Linear) or not m.fitgpt.endswith(".weight"):
            continue
        i, n = m.part or (0, 1)
        rows = lin.out_features // n
        out.append(Target(hf, module, i * rows, (i + 1) * rows, lin.in_features, m.transpose))
    return tuple(out), tuple(experts)


def matches(hf: str, name: str) -> bool:
    """PEFT's rule for a target name: the module's whole name, or its end after a dot."""
    return hf == name or hf.endswith("." + name)


def lora_targets(cfg: ModelConfig, adapter: AdapterConfig) -> list[Target]:
    """The linears `adapter` adapts in the model `cfg`, in PEFT's order; a name that matches no
    linear of the family is refused in one line (and one that names a mixture's experts or
    router, which fitgpt does not adapt yet)."""
    found, experts = _candidates(cfg)
    names = adapter.target_names
    if names is None:
        return list(found)
    for name in names:
        if any(matches(t.hf, name) for t in found):
            continue
        # the names are the flag's, or (--lora-from) the folder's: the line names where to fix
        given = adapter.targets_given_by + f" {name}"
        if any(matches(e, name) for e in experts):
            raise UserError(
                f"{given}: in {cfg.family} it names a mixture-of-experts MLP's "
                "experts or router, which fitgpt does not adapt yet; target the attention "
                "(q_proj,k_proj,v_proj,o_proj)"
            )
        known = ", ".join(dict.fromkeys(t.name for t in found))
        fix = (
            f"is it an adapter of another model? fitgpt adapts only the blocks' linears ({known})"
            if adapter.lora_from
            else f"use {ALL_LINEAR} or some of {known}"
        )
        raise UserError(
            f"{given}: no linear of the {cfg.family} family's blocks is named so; {fix}"
        )
    return [t for t in found if any(matches(t.hf, n) for n in names)]


@functools.lru_cache(maxsize=32)
def adapter_elements(cfg: ModelConfig, adapter: AdapterConfig) -> int:
    """A and B's elements over every target, r·(in + rows) each: what the adapters' state
    costs (plan/adapter_memory.py) and what a LoRA step's FLOPs count (RunConfig
    flops_per_token)."""
    r = adapter.lora_rank
    return sum(r * (t.in_features + t.out_features) for t in lora_targets(cfg, adapter))


@functools.lru_cache(maxsize=32)
def adapted_linears(cfg: ModelConfig, adapter: AdapterConfig) -> tuple[tuple[int, int], ...]:
    """(in_features, out_features) of each fitgpt linear `adapter` adapts, once however many
    adapters it holds (attn.kv's k_proj and v_proj), its rows all of them (an adapted linear's
    forward passes over every row, adapted or not: lora.py): the shapes the adapters' passes
    run over (plan/adapter_time.py adapter_passes)."""
    rows: dict[str, int] = {}
    for t in _candidates(cfg)[0]:  # a linear's candidates cover its rows, in parts
        rows[t.module] = max(rows.get(t.module, 0), t.hi)
    ins = {t.module: t.in_features for t in lora_targets(cfg, adapter)}
    return tuple((n, rows[m]) for m, n in ins.items())
