"""A model family as the rest of fitgpt sees it: one interface.

Every family is a decoder laid out as embedding → N identical blocks → head (model/decoder.py,
the base class of its network). What differs between families, and what the engine, the
planner, tensor parallelism and the checkpoints need to know of it, is said here and nowhere
else:
  model             the network's class (a DecoderLM), built from a ModelConfig
  splits            which parameters tensor parallelism cuts, along which dimension (a weight cut
                    by rows is a column-parallel linear, by columns a row-parallel one, an
                    embedding's rows its vocabulary); the rest is replicated
  tp_sizes          what the tensor-parallel degree must divide (heads, MLP width, vocabulary)
  num_params, matmul_params, attention_flops, flops_per_token
                    the exact parameter count; the model FLOPs per trained token (the whole
                    model trained, or LoRA adapters on it frozen) and its two parts: the
                    parameters a token multiplies by, attention's work
  block_activations the elements per token a block saves for backward, split into those tensor
                    parallelism leaves whole (the norms) and those it cuts 1/T (inside attention
                    and the MLP): what the planner's memory model prices
  mlp_activations, mlp_piece_elems
                    what the block's MLP keeps per token when it runs whole, and what it holds
                    at once when a long micro-batch runs it a piece of tokens at a time
                    (model/pieces.py): what the planner prices past MLP_PIECE_ELEMS
  head_shared       replicated parameters applied to every head (a per-head norm's weight):
                    under tensor parallelism each rank's gradient of them covers its heads only
  check, ffn_default
                    the one-line refusal of config fields the family cannot honour (called when
                    a ModelConfig is made), and its MLP width when the config sets none
Each family fitgpt ships is a folder, model/families/<name>/: its network (model.py), this
class filled in (family.py, as FAMILY), its presets and its Hugging Face name map
(model/hf_map.py's HFMapping). The registry (model/families/__init__.py) names the folders and
loads them by name; nothing in engine/, plan/ or parallel/ names a family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fitgpt.model.pieces import mlp_piece_tokens

if TYPE_CHECKING:
    from fitgpt.model.config import ModelConfig


@dataclass(frozen=True)
class Split:
    """How tensor parallelism cuts one parameter: along `dim` (0: the output rows of a
    column-parallel linear, or an embedding's vocabulary rows; 1: the input columns of a
    row-parallel linear), each of `parts` stacked pieces on its own (a fused q/k/v weight is 3
    pieces, so every rank keeps whole heads of each)."""

    dim: int
    parts: int = 1


class Family(ABC):
    """One model family (subclass it in the family's folder as family.py's FAMILY, or register
    an instance made elsewhere with model/families' register_family)."""

    name: ClassVar[str] = ""
    model: ClassVar[type]  # the network: a DecoderLM subclass taking a ModelConfig
    # parameter-name suffix ("attn.qkv.weight", "wte.weight") -> how TP cuts it
    splits: ClassVar[dict[str, Split]] = {}
    # suffixes of replicated parameters used by every head: parallel/layers.py sums their
    # gradients over the TP group (each rank saw only its heads)
    head_shared: ClassVar[tuple[str, ...]] = ()
    # one block's forward + backward under activation checkpointing, compiled (Inductor) over
    # eager, as measured on an H100 for the family's blocks: what the planner prices for
    # --compile with checkpointing and what --compile auto weighs (engine/transforms/compile.py).
    # GPT-2's blocks run slower compiled there (1.06-1.13 at h=2560-5120,
    # results/offload_compile_h100_2026-11-24): little elementwise work to fuse, and the
    # checkpoint runs the compiled forward twice.
    compiled_checkpointed: ClassVar[float] = 1.08
    # the family's time at the matmul term over what the planner's efficiency curve prices
    # (plan/throughput.py compute_seconds): the curve was fitted on GPT-2 steps, whose
    # elementwise work around the matmuls (LayerNorm, GELU, bias adds) it therefore includes;
    # a family with more of it per matmul FLOP runs slower than the curve says. 1.0: GPT-2.
    matmul_time: ClassVar[float] = 1.0
    # the family's attention kernel time over what the planner prices for the keys it scores
    # at the probed attention rate (flash, causal, head dim 128: plan/rates.py) and the curve's
    # share of it (plan/throughput.py compute_seconds). 1.0: flash at head dim 128.
    attention_time: ClassVar[float] = 1.0
    # a mixture of experts (ModelConfig.num_experts and its fields): families without refuse them
    # (its experts module: `n` experts, `weights`, `run` over rows grouped by expert and an
    # `exchange` slot, expert-major parameters: what --expert-parallel splits,
    # fitgpt/parallel/experts.py)
    has_experts: ClassVar[bool] = False
    # the fields of model/config.py's OWN_FIELDS this family honours: ModelConfig refuses the
    # others set (gpt-oss's layer_types and clamped SwiGLU)
    own_fields: ClassVar[tuple[str, ...]] = ()
    # whether its attention takes model/packing.py's FlexAttention Packing on CUDA (windows,
    # packed rows); False: the boolean-mask Packing everywhere (gpt-oss: its sinks)
    flex_attention: ClassVar[bool] = True
    # why its attention cannot run context-parallel (parallel/context.py: each rank attends
    # over the whole sequence with 1/C of the heads), "" where it can: context_parallel_refusal
    # says it in one line
    no_context_parallel: ClassVar[str] = ""
    # a learned sink logit per head in every softmax (gpt-oss): FlexAttention through its
    # log-sum-exp on CUDA, SDPA's math kernel on a [T, 1+T] mask elsewhere (plan/memory.py
    # attention_path prices both)
    attention_sinks: ClassVar[bool] = False

    def mlp_backward_bytes(self, cfg: ModelConfig, tokens: int, w: int) -> int:
        """Bytes a block's MLP backward holds beside its saved set, for `tokens` tokens in a
        dtype of `w` bytes, where plan/memory.py's working gradients do not cover it (a mixture
        of experts: its rows are k per token). 0: they do."""
        return 0

    def layer_windows(self, cfg: ModelConfig) -> tuple[int | None, ...]:
        """Each layer's attention window (None: every key before): the config's one window in
        every layer, unless the family alternates them (gpt-oss's layer_types)."""
        return (cfg.sliding_window,) * cfg.n_layer

    def check(self, cfg: ModelConfig) -> None:
        """Raise UserError, in one line, for a field of `cfg` this family cannot honour."""
        return None

    def ffn_default(self, cfg: ModelConfig) -> int:
        """The MLP width when cfg.ffn_hidden is None."""
        return 4 * cfg.n_embd

    def split_rule(self, name: str) -> Split | None:
        """How TP cuts parameter `name` (a full name like 'blocks.3.mlp.fc.weight'), or None for
        a replicated one."""
        for suffix, rule in self.splits.items():
            if name == suffix or name.endswith("." + suffix):
                return rule
        return None

    @abstractmethod
    def tp_sizes(self, cfg: ModelConfig) -> list[tuple[int, str]]:
        """(size, what it is, as a refusal names it) for each size the TP degree must divide."""
        ...

    @abstractmethod
    def num_params(self, cfg: ModelConfig) -> int: ...

    def active_params(self, cfg: ModelConfig) -> int:
        """The parameters one token's forward multiplies by: all of them in a dense family; a
        mixture of experts counts only the k experts a token is routed to. What compute (and
        recompute) is priced by, where num_params prices the state."""
        return self.num_params(cfg)

    def matmul_params(self, cfg: ModelConfig) -> int:
        """The parameters one token's forward multiplies by, each 2 FLOPs forward and 2 for
        its input's gradient, 2 more for its own gradient where it trains: every active one
        (active_params; the norms' and biases' few counted as the convention counts them)."""
        return self.active_params(cfg)

    def attention_flops(self, cfg: ModelConfig) -> float:
        """Attention's QK^T and AV per token, forward + backward, over the full S×S square:
        12·L·h·S, the convention the peers' published figures use (a causal kernel does half;
        plan/throughput.py prices what it does)."""
        return 12.0 * cfg.n_layer * cfg.n_embd * cfg.seq_len

    def flops_per_token(self, cfg: ModelConfig, adapters: int | None = None) -> float:
        """Model FLOPs per trained token, recompute not counted. The whole model trained: 6 per
        multiplying parameter plus attention. `adapters` LoRA elements trained on the frozen
        model (fitgpt/adapters): its weights get no gradient, 4 per parameter (the forward and
        the input's gradient), and each adapter element 6 (A·x and B·(A·x) are 2 per element
        forward, the input and weight gradients of both 2 and 2: the rank-r path's whole
        work); attention is the same work either way."""
        mm, attn = self.matmul_params(cfg), self.attention_flops(cfg)
        if adapters is None:
            return 6.0 * mm + attn
        return 4.0 * mm + 6.0 * adapters + attn

    @abstractmethod
    def block_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """Elements per token one block saves for its backward: (left whole by tensor
        parallelism, cut 1/T by it). Flash attention: no S² term."""
        ...

    def mlp_activations(self, cfg: ModelConfig) -> tuple[int, int]:
        """(saved, peak), elements per token, both cut 1/T by tensor parallelism: `saved`, what
        the block's MLP keeps for backward when it runs whole (a part of block_activations'
        cut); `peak`, what one piece's backward holds at once per token of the piece when it
        runs in pieces (model/pieces.py), measured on the CPU (tests/test_long.py). (0, 0): the
        family's MLP never runs in pieces (the default)."""
        return 0, 0

    def mlp_piece_elems(
        self, cfg: ModelConfig, batch: int, seq: int, tp: int = 1, sp: bool = False
    ) -> int:
        """Elements one rank holds at once for the MLP of one block running a micro-batch of
        `batch` rows of `seq` tokens (the whole sequence) a piece of tokens at a time, at the
        peak of a piece's backward; 0 when that micro-batch runs the MLP whole (then
        block_activations prices it). The model's own decision (model/pieces.py
        mlp_piece_tokens, on this rank's tokens and the whole MLP width). When not 0, price a
        block as block_activations with mlp_activations' `saved` taken off its cut per token
        (a piece keeps only its input, a view of the norm's output, in block_activations'
        whole part), plus this many elements once: one piece of one block exists at a time,
        in the forward and the backward. Under tensor parallelism the width is cut (1/tp of a
        piece's elements per rank); under sequence parallelism a rank holds seq/tp tokens and
        each piece gathers tp times its tokens, so per rank a piece is what one process's is."""
        peak = self.mlp_activations(cfg)[1]
        local = seq // tp if sp else seq
        t = mlp_piece_tokens(batch, local, cfg.ffn_width) if peak else 0
        if not t:
            return 0
        return peak * batch * t if sp else peak * batch * t // tp
