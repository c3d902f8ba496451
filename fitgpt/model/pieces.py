"""The MLP of a block a piece of tokens at a time, for long sequences.

An MLP makes [B, T, F] intermediates (F its width: Llama 3.1 8B's SwiGLU 14,336, GPT-2's 4·H):
the gate and up projections, the activation and the product the down projection reads. At
128 k tokens of Llama 3.1 8B each is 3.75 GB in bf16; the MLP keeps four of them for backward
and its backward makes as many gradients again. The MLP is the same function on every token,
so past MLP_PIECE_ELEMS (below) `along_tokens` runs it over pieces of the sequence, each under
a non-reentrant activation checkpoint: a piece's forward keeps only its input (a view of the
norm's output, which the block holds anyway) and its backward recomputes that piece's
intermediates, so one piece's exist at a time, in the forward and the backward alike.

What it costs: one more forward of the MLP per block (2·3·H·F FLOPs a token for SwiGLU, +1/3
of the MLP's training FLOPs), with or without the engine's block checkpoint around it (inside
one, the block's recompute runs the pieces but keeps nothing of them, the piece's own
checkpoint recomputes again; both checkpoints are non-reentrant, so they nest). At Llama 3.1 8B
and 128 k tokens that is ~+6% of a checkpointed block's FLOPs (attention's T² term dominates
there: 0.35 of ~6 GFLOP a token), at the threshold ~+15% (+20% without the block checkpoint):
why the threshold sits above every ordinary micro-batch. The pieces' outputs are
concatenated: one [B, T, H] copy.

Tensor parallelism cuts F, never T, so the pieces go along T on every rank alike. Under
sequence parallelism a rank holds T/tp tokens; its column-parallel fc gathers each piece from
all ranks (tp·t tokens, in rank order) and the row-parallel proj reduce-scatters them back, so
every rank gets its own piece's tokens: one all-gather and one reduce-scatter per piece
instead of per block, the same bytes. Dropout inside the MLP draws its mask per piece
(checkpoint replays the RNG in the recompute), so with dropout the masks differ from the
unpieced run's; without dropout the results equal it to rounding.

Compiled (`--compile blocks`), dynamo traces each piece's checkpoint as its higher-order op
(no graph break; one graph per block still) and the partitioner recomputes the pieces in the
compiled backward (tests/test_long.py).

Shape legend: B batch, T tokens this rank's MLP input holds, H hidden, F MLP width (the whole
model's, cfg.ffn_width), t tokens of one piece.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# The most elements of one [B, t, F] intermediate a piece makes (B·t·F, F the model's whole
# width); also the threshold: a micro-batch under it runs the MLP whole (bit-identical to no
# pieces). 2^28 elements are 512 MiB in bf16: Llama 3.1 8B (F = 14,336) takes pieces past
# 18,724 tokens a micro-batch (at 128 k: 8 pieces; a piece's backward holds ~6·B·t·F, 3 GiB,
# where the whole MLP's held 21 GiB), GPT-2 124 M (F = 3,072) past 87,381. Under it lies every
# ordinary micro-batch (4 × 4,096 tokens of Llama 8B: 16,384), which would pay the extra MLP
# forward for memory it does not need. Smaller pieces save nothing more that matters (the
# block's other activations are ~T·(4H + attention's)) and run matmuls of fewer rows.
MLP_PIECE_ELEMS = 2**28


def mlp_piece_tokens(batch: int, tokens: int, width: int) -> int:
    """Tokens a piece covers for an MLP input of [batch, tokens, ·] and an MLP `width` wide
    (the whole model's F, also under tensor parallelism), or 0: the MLP runs whole. The model
    (along_tokens) and the planner (Family.mlp_piece_elems) both decide with it."""
    if batch * tokens * width <= MLP_PIECE_ELEMS:
        return 0
    return max(1, MLP_PIECE_ELEMS // (batch * width))


def along_tokens(mlp: Callable[[Tensor], Tensor], x_BTH: Tensor, width: int) -> Tensor:
    """mlp(x_BTH), a piece of tokens at a time past MLP_PIECE_ELEMS (the module docstring).
    Without gradients (evaluation, decoding) the pieces run without a checkpoint: nothing is
    kept either way."""
    B, T = x_BTH.shape[0], x_BTH.shape[1]
    t = mlp_piece_tokens(B, T, width)
    if not t:
        return mlp(x_BTH)
    outs = []
    for x_BtH in x_BTH.split(t, dim=1):
        if torch.is_grad_enabled():
            outs.append(checkpoint(mlp, x_BtH, use_reentrant=False))
        else:
            outs.append(mlp(x_BtH))
    return torch.cat(outs, dim=1)
