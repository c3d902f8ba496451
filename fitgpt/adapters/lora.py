"""LoRA on a built model: the adapted linear, the adapters attached, PEFT's initialisation.

An adapted linear stays the nn.Linear it was (its class is swapped for LoraLinear, so its weight
keeps its name and its place in the engine's layout) and gains `lora`, one LoraPair per HF
module it serves: Llama's fused `attn.kv` serves k_proj (its first K·D output rows) and v_proj
(the rest). Its forward is the base's plus each adapter's s·B·A·drop(x) on the adapter's rows,
added as PEFT adds it (result + lora_B(lora_A(dropout(x))) · scaling). Shapes: x [..., in],
A [r, in], B [rows, r]; the update costs 2·r·(in + rows) FLOPs per token, against in·rows.

Memory: A and B in fp32 (with their gradient and two Adam moments, 16 bytes per element), the
frozen base's weights as the engine holds them, no gradient and no optimizer state for them.

Shape legend: r rank, rows the adapted output rows, in the linear's input width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fitgpt.adapters.config import AdapterConfig
from fitgpt.adapters.targets import Target


class LoraPair(nn.Module):
    """One adapter: s·B·A·drop(x) for its linear's output rows [lo, hi)."""

    def __init__(self, t: Target, rank: int, scale: float, dropout: float, device) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, t.in_features, device=device))  # [r, in]
        self.B = nn.Parameter(torch.empty(t.out_features, rank, device=device))  # [rows, r]
        self.scale, self.dropout = scale, dropout

    def forward(self, x: Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        return F.linear(F.linear(x, self.A), self.B) * self.scale

    def delta(self) -> Tensor:
        """s·B·A [rows, in], in fp32: what merging adds to the weight's rows (PEFT's
        get_delta_weight, in the nn.Linear orientation; transposed for a Conv1D by the name
        map on export)."""
        return (self.B.float() @ self.A.float()) * self.scale


class LoraLinear(nn.Linear):
    """An nn.Linear with LoRA adapters on blocks of its output rows (made by attach_lora)."""

    lora: nn.ModuleDict  # the HF module's name (k_proj) -> its LoraPair
    spans: list[tuple[int, int, str | None]]  # the output rows in order: (lo, hi, adapter)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        if len(self.spans) == 1:  # one adapter over every row: PEFT's own sum
            return y + self.lora[self.spans[0][2]](x)
        # fused parts (k and v in attn.kv): each part's update, zeros where none adapts
        parts = [
            self.lora[name](x) if name else y.new_zeros(*y.shape[:-1], hi - lo)
            for lo, hi, name in self.spans
        ]
        return y + torch.cat(parts, dim=-1)


def attach_lora(model: nn.Module, targets: list[Target], adapter: AdapterConfig) -> None:
    """Freeze every parameter of `model` and give each target's linear its adapter (made on
    the linear's device, uninitialised: init_lora fills it; on the meta device, for a layout)."""
    for p in model.parameters():
        p.requires_grad_(False)
    modules = dict(model.named_modules())
    adapted: dict[str, LoraLinear] = {}
    for t in targets:
        lin = modules[t.module]
        if t.module not in adapted:
            lin.__class__ = LoraLinear  # a class swap: the weight keeps its name and storage
            lin.lora = nn.ModuleDict()
            adapted[t.module] = lin
        scale = adapter.scale
        lin.lora[t.name] = LoraPair(t, adapter.lora_rank, scale, adapter.lora_dropout,
                                    lin.weight.device)  # fmt: skip
    by_module: dict[str, list[Target]] = {}
    for t in targets:
        by_module.setdefault(t.module, []).append(t)
    for name, lin in adapted.items():
        lin.spans = _spans(by_module[name], lin.out_features)


def _spans(targets: list[Target], rows: int) -> list[tuple[int, int, str | None]]:
    """The output rows [0, rows) as runs, each an adapter's or (None) none's."""
    spans, at = [], 0
    for t in sorted(targets, key=lambda t: t.lo):
        if t.lo > at:
            spans.append((at, t.lo, None))
        spans.append((t.lo, t.hi, t.name))
        at = t.hi
    if at < rows:
        spans.append((at, rows, None))
    return spans


def adapters(model: nn.Module, targets: list[Target]) -> list[LoraPair]:
    """Each target's LoraPair in `model`, in the targets' order."""
    modules = dict(model.named_modules())
    return [modules[t.module].lora[t.name] for t in targets]


def param_names(t: Target) -> tuple[str, str]:
    """The full names of target `t`'s A and B in the model (blocks.0.attn.kv.lora.k_proj.A)."""
    return f"{t.module}.lora.{t.name}.A", f"{t.module}.lora.{t.name}.B"


@torch.no_grad()
def init_lora(model: nn.Module, targets: list[Target], seed: int) -> None:
    """PEFT's initialisation, draw for draw: A Kaiming-uniform (a = √5, bound 1/√in), B zero,
    from a CPU generator seeded with `seed`, the targets in PEFT's order. PEFT makes A and B as
    nn.Linear layers, whose own initialisation draws A's and B's shapes first; those draws are
    taken and dropped here too, so `torch.manual_seed(seed)` before PEFT's get_peft_model gives
    the same A. Every rank draws the same."""
    gen = torch.Generator().manual_seed(seed)
    for pair in adapters(model, targets):
        a, b = torch.empty(pair.A.shape), torch.empty(pair.B.shape)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # nn.Linear(in, r)'s own
        nn.init.kaiming_uniform_(b, a=math.sqrt(5), generator=gen)  # nn.Linear(r, rows)'s own
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # LoRA's A
        pair.A.copy_(a)
        pair.B.zero_()
