"""LoRA on a built model: the adapted linear, the adapters attached, PEFT's initialisation.

An adapted linear stays the nn.Linear it was (its class is swapped for LoraLinear, so its weight
keeps its name and its place in the engine's layout) and gains `lora`, one LoraPair per HF
module it serves: Llama's fused `attn.kv` serves k_proj (its first K·D output rows) and v_proj
(the rest). Its output is the base's plus each adapter's s·B·A·drop(x) on the adapter's rows,
PEFT's sum (result + lora_B(lora_A(dropout(x))) · scaling). Shapes: x [..., in], A [r, in],
B [rows, r]; the update costs 2·r·(in + rows) FLOPs per token, against in·rows.

The k adapters of one linear are computed as one rank-k·r update, so its output rows are passed
over once: xa = x·A_allᵀ [T, k·r] (A_all the A's stacked), then out = y + s·xa·B_bdᵀ in one
addmm, whose epilogue reads the base's y and writes out, with s as its alpha (B_bd [out, k·r]
block-diagonal, zero on the rows no adapter has). That is PEFT's sum to the bit where s is a
power of two (alpha 2·r, the default: s = 2); any other s keeps PEFT's order, the product scaled
then added (4 passes over out more in the forward, 2 in the backward), as the addmm's one
rounding, though nearer the exact sum, leaves PEFT's fp32 logits by more than 1e-6
(tests/test_lora.py). A_all and B_bd are built per call from the parameters (k·r × in and out ×
k·r: no token dimension), so the gradients reach A and B and an autocast casts them once; the
backward of the addmm passes y's gradient through untouched and scales only [T, k·r] and [k·r,
out] products. A fused linear's zero blocks double the thin B product's FLOPs (k·r columns
against r), memory-bound either way. Dropout above 0 draws each adapter's own mask on x (PEFT
keeps one dropout per module), the base seeing x undropped.

Memory: A and B in fp32 (with their gradient and two Adam moments, 16 bytes per element), the
frozen base's weights as the engine holds them, no gradient and no optimizer state for them.

Shape legend: T tokens, r rank, rows the adapted output rows, out the linear's output width,
in its input width, k the linear's adapters.
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

    def down(self, x_TI: Tensor) -> Tensor:
        """A·drop(x) [T, r]: x through this adapter's own dropout mask, then A."""
        if self.dropout and self.training:  # at p = 0 x itself, no copy
            x_TI = F.dropout(x_TI, self.dropout, True)
        return F.linear(x_TI, self.A)

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
        x_TI, y_TO = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        pairs = [self.lora[name] for _, _, name in self.spans if name]
        if len(self.spans) == 1:  # one adapter over every row: its own A and B
            xa, b = pairs[0].down(x_TI), pairs[0].B
        else:  # fused parts (k and v in attn.kv): one rank-k·r update, B block-diagonal
            if pairs[0].dropout and self.training:  # each adapter's own mask: [T, k·r] joined
                xa = torch.cat([p.down(x_TI) for p in pairs], dim=-1)
            else:  # x read once for every adapter
                xa = F.linear(x_TI, torch.cat([p.A for p in pairs]))
            b = torch.block_diag(*[
                self.lora[name].B if name else pairs[0].B.new_zeros(hi - lo, 0)
                for lo, hi, name in self.spans
            ])  # fmt: skip
        s = pairs[0].scale  # attach_lora gives every adapter of a run the config's one scale
        if math.frexp(s)[0] == 0.5:  # a power of two: s·(xa·Bᵀ) rounds as PEFT's (xa·Bᵀ)·s
            return torch.addmm(y_TO, xa, b.t(), alpha=s).view(y.shape)
        # any other scale in PEFT's rounding order (one rounding more than the addmm's, which
        # is nearer the exact sum but not PEFT's to 1e-6 in fp32): 4 passes over out more
        return (y_TO + F.linear(xa, b) * s).view(y.shape)


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
