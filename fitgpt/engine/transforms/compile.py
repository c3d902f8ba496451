"""Regional compilation (`--compile on`): torch.compile applied to a built model, from outside.

Two kinds of region are compiled (TorchInductor, dynamo's default backend):
  blocks     each transformer block's forward in its training form (no KV cache). All blocks
             go through one compiled function taking the block as an argument: their
             parameters are graph inputs, not constants, so dynamo compiles it once and block
             2..L hit its cache. Compile time does not grow with depth.
  head       DecoderLM.head_loss: the final norm, the head and cross-entropy as one graph (the
             [B, T, V] logits and their fp32 copy become a fused transient).
One rank holding a small model whole (scope "model") compiles a third kind instead of the two:
  model      the whole training forward (embeddings, every block, head + loss) as one graph,
             run as CUDA graphs on a GPU (Inductor's mode="reduce-overhead"): one launch per
             forward and backward, where the regions pay a compiled call per block and the GPU
             waits for the host between them.
Who decides: the planner, once per candidate plan (compile_scope below, called from
plan/candidate.py; for a run given without planning, from train/setup.py), and it prices the
result; the engines build what EngineConfig.compile says (scope_of) and decide nothing.
Only the forward *function* is replaced, never the module's __call__: the engine's hooks on a
block (host-optimizer waits, stage-3 gathers and frees, streamed weights) and on its parameters
(gradient reduction) keep running eagerly around the compiled code, as they do without it.
On GPUs and past h=1024 the model's LayerNorms run ATen's kernels behind an op the compiler
keeps whole (engine/transforms/norm.py): Inductor's own loop over rows that wide.
Compile before activation checkpointing (the engines do): the checkpoint then wraps the
compiled forward, and its recompute in the backward runs the compiled forward again.

Chunk views: parameters are views into a chunk's flat buffer, whose storage a stage-3 or
streamed chunk resizes to 0 between uses. Dynamo guards a parameter's size, stride, dtype and
device, not its storage, so the swaps cause no recompile (tests/test_compile.py counts them).

Costs: the first forward of each kind compiles (and its first backward: AOTAutograd compiles
the backward lazily), tens of seconds on a GPU, more on 2 CPU cores; an evaluation (no grad,
eval mode) compiles each kind once more; decoding with a KV cache runs eagerly (its shapes
change every token). A region whose compilation fails (no C++ compiler, no triton) runs
eagerly from then on, after one warning line; an error the eager forward raises too is the
model's and propagates unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fitgpt.engine.transforms.norm import aten_norms, use_aten_norms
from fitgpt.model.family import Family

# compilation_time_metrics keys (seconds) that together are the compile: dynamo's frame compile
# (tracing, AOTAutograd and the forward's Inductor codegen) and the lazily compiled backward
TIME_KEYS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def compile_errors() -> tuple[type[Exception], ...]:
    """What a failed compilation raises: dynamo's own errors (Inductor's are wrapped in
    BackendCompilerFailed) and Inductor's C++ toolchain errors. Anything else passes through
    untouched: activation checkpointing stops a recompute early by raising through the region.
    Imported here, not at the top: torch._dynamo costs 1.5 s at every command's start."""
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    return (
        dynamo_exc.TorchDynamoException,
        inductor_exc.CppCompileError,
        inductor_exc.InvalidCxxCompiler,
        inductor_exc.OperatorIssue,
    )


# --compile auto: compile on GPUs when the run's priced eager step time times its steps, times
# GAIN, the share of it compiling is assumed to save, pays back COMPILE_S, the compile time
# assumed: runs of about 333 s or more. Measured on an H100
# (benchmarks/results/nanogpt_compare_h100_2026-11-23): compiling saved 25% at GPT-2 124 M and
# 3.4% at 1.5 B (GAIN: the smaller), and took 8.6 s and 8.1 s cold. The whole-model graph
# (scope "model") compiles in 19-26 s but saves 29% at 124 M (nanogpt_compare3_h100_2026-11-24):
# paid back in ~90 s, well inside the rule's 333 s. ASSUMED_MFU prices a run that is not planned
# (train/setup.py: an engine config given whole), from its model FLOPs.
ASSUMED_MFU = 0.4
GAIN = 0.03
COMPILE_S = 10.0
# A checkpointed run compiles only where its family's blocks run faster compiled
# (Family.compiled_checkpointed < 1): it saves 1 - that share of its steps, and the compile
# took 28.5 s cold for Llama-3.1-8B's block and head on an H100 (the first step, 37.5 s against
# 9.0 s eager: results/llama_speed_h100_2026-11-27), so such runs compile from ~7 minutes.
COMPILE_CHECKPOINTED_S = 30.0
# a caller that names no family gets the base Family's ratio (GPT-2's)
CHECKPOINTED = Family.compiled_checkpointed

# What --compile resolves to, the only values an engine accepts: nothing compiled, the regions
# (every block's forward and the head + loss), or the whole training forward as one graph.
SCOPES = ("off", "blocks", "model")
UNPLANNED = {"auto": "off", "on": "blocks"}  # scope_of: an engine config that was never planned


def compile_pays(
    run_s: float, checkpointing: str = "off", checkpointed: float = CHECKPOINTED
) -> bool:
    """Whether compiling a GPU run of about `run_s` seconds of steps is expected to pay: when
    GAIN·run_s >= COMPILE_S without activation checkpointing. With it, the checkpoint wraps the
    compiled forward and runs it again in the backward, and whether that is faster depends on
    the family (`checkpointed`, Family.compiled_checkpointed: compiled over eager). GPT-2's
    blocks took 6-13% longer compiled at h=2560 to 5120 on an H100, and its offloaded
    (checkpointed) plans of the 6.7b and 13b presets 8% and 3% longer per step
    (results/offload_compile_h100_2026-11-24): never. Llama's save 1 - checkpointed of the
    run, against COMPILE_CHECKPOINTED_S."""
    if checkpointing == "off":
        return GAIN * run_s >= COMPILE_S
    return checkpointed < 1.0 and (1.0 - checkpointed) * run_s >= COMPILE_CHECKPOINTED_S


def auto_compile(
    device_type: str, run_s: float, checkpointing: str = "off", checkpointed: float = CHECKPOINTED
) -> bool:
    """--compile auto's on-or-off: never on CPUs (a CPU run is a test or a demo: the compile
    would take longer than it), on GPUs where compile_pays and triton (Inductor's GPU code
    generator) is installed."""
    if device_type != "cuda" or not compile_pays(run_s, checkpointing, checkpointed):
        return False
    import importlib.util

    return importlib.util.find_spec("triton") is not None


# the widest model whose steps are bound by the host's launches (measured on an H100, GPT-2
# 124 M, h=768: 108-120 ms per step with regions against 106 ms as one CUDA-graphed graph,
# benchmarks/results/ab_speed_h100_2026-11-24; at h=1600 and above a block's kernels outlast
# its launches and the regions' short compile wins)
MODEL_SCOPE_MAX_HIDDEN = 1024


def model_scope(
    device_type: str, n_embd: int, world: int, resident: bool, checkpointing: str
) -> bool:
    """Whether a run compiles its whole forward as one graph (the module docstring): on GPUs, for
    models up to MODEL_SCOPE_MAX_HIDDEN wide, when nothing needs the engine between blocks: one
    rank (no reduction to start as each block's gradient completes), every chunk resident (no
    host waits, gathers or streams before a block) and no activation checkpointing (which wraps
    each block)."""
    return (
        device_type == "cuda"
        and n_embd <= MODEL_SCOPE_MAX_HIDDEN
        and world == 1
        and resident
        and checkpointing == "off"
    )


def compile_scope(
    asked: str,
    engine: str,
    device_type: str,
    n_embd: int,
    world: int,
    resident: bool,
    checkpointing: str,
    run_s: float,
    checkpointed: float = CHECKPOINTED,
) -> str:
    """--compile's one decision, one of SCOPES: what the planner prices for each candidate plan
    (plan/candidate.py) and the engine then builds. `asked`: the flag (auto, on, off, or a scope
    given outright); `resident`: no chunk of the plan is offloaded or streamed; `run_s`: the
    plan's seconds of steps, eager; `checkpointed`: the model family's compiled-over-eager
    ratio under activation checkpointing (Family.compiled_checkpointed). auto compiles where auto_compile says; on compiles; either
    takes the whole model as one graph where model_scope says, on the chunk engine (the DDP
    engine's reducer hooks need the regions' boundaries), else the regions."""
    if asked in SCOPES:
        return asked
    if asked == "auto" and not auto_compile(device_type, run_s, checkpointing, checkpointed):
        return "off"
    whole = engine == "zero" and model_scope(device_type, n_embd, world, resident, checkpointing)
    return "model" if whole else "blocks"


def compiled(ecfg) -> bool:
    """Whether a resolved EngineConfig compiles anything (either scope)."""
    return ecfg.compile in ("blocks", "model")


def scope_of(ecfg) -> str:
    """The scope an engine builds: EngineConfig.compile, which the planner resolved. An engine
    decides nothing from the model or the machine: a config built by hand and never planned
    (a library caller, a test) gets the flag's literal reading, auto as off and on as the
    regions."""
    return UNPLANNED.get(ecfg.compile, ecfg.compile)


def _model_train(
    model: nn.Module, idx_BT: Tensor, targets_BT: Tensor, segments_BT: Tensor | None
) -> Tensor:
    return type(model).forward(model, idx_BT, targets_BT, None, segments_BT)


def _block_train(block: nn.Module, x_BTH: Tensor, aux) -> Tensor:
    """A block's forward as training calls it (`aux`: DecoderLM.block_aux's, e.g. ALiBi's
    bias, rotary tables, packed samples' Packing: dynamo guards on its kind, so packed and
    plain batches are two graphs); the class's forward, not the instance attribute (which
    activation checkpointing and this module replace)."""
    return type(block).forward(block, x_BTH, None, 0, aux)


def _head_loss(model: nn.Module, x_BTH: Tensor, targets_BT: Tensor) -> Tensor:
    return type(model).head_loss(model, x_BTH, targets_BT)


def _frames() -> int:
    """Frames dynamo has compiled so far in this process (a compile or a recompile each)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def _counters() -> tuple[int, float]:
    """(graph breaks, compile seconds) so far in this process."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    breaks = sum(counters["graph_break"].values())
    seconds = sum(sum(compilation_time_metrics.get(k, ())) for k in TIME_KEYS)
    return breaks, seconds


def error_line(e: BaseException) -> str:
    """A compile error as one line for a warning: its type and its message's first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(e)


@dataclass
class _Kind:
    """One compiled function and what happened to it: all blocks share one, the head has one."""

    name: str
    compiled: Callable
    eager: Callable
    regions: int = 0  # modules routed through it
    compiles: int = 0  # calls during which dynamo compiled a frame
    failed: str = ""  # the first line of the error that sent it back to eager

    def __call__(self, regions: CompiledRegions, *args) -> Tensor:
        if self.failed:
            return self.eager(*args)
        frames = _frames()
        try:
            out = self.compiled(*args)
        except regions.errors as e:
            if _is_oom(e):
                raise  # memory, not the compiler: eager would not fit either
            out = self.eager(*args)  # raises the model's own error if eager fails too
            self.failed = error_line(e)
            regions.warn(
                f"{self.name} region(s) run eagerly, their compilation failed ({self.failed})"
            )
            return out
        if _frames() != frames:
            self.compiles += 1
        return out


class CompiledRegions:
    """The compiled regions of one model, and their counters (report())."""

    def __init__(self, model: nn.Module, warn: Callable[[str], None], whole: bool = False) -> None:
        self.warn = warn
        self.errors = compile_errors()
        self._start = _counters()
        self.kinds: tuple[_Kind, ...]
        self.aten_norms = 0
        self.scope = "model" if whole else "regions"
        device_type = next(model.parameters()).device.type
        if whole:
            mode = "reduce-overhead" if device_type == "cuda" else None  # CUDA graphs: GPUs only
            self.whole = _Kind("model", torch.compile(_model_train, mode=mode), _model_train)
            self.kinds = (self.whole,)
            self._wrap_model(model)
            return
        # wide rows: the LayerNorms through ATen's kernels, not Inductor's loops
        # (engine/transforms/norm.py)
        self.aten_norms = use_aten_norms(model) if aten_norms(device_type, model.cfg.n_embd) else 0
        self.blocks = _Kind("block", torch.compile(_block_train), _block_train)
        self.head = _Kind("head+loss", torch.compile(_head_loss), _head_loss)
        self.kinds = (self.blocks, self.head)
        for block in model.blocks:
            self._wrap_block(block)
        self.head.regions = 1
        # an instance attribute shadows GPT.head_loss; GPT.forward calls self.head_loss
        model.head_loss = lambda x, t: self.head(self, model, x, t)

    def _wrap_model(self, model: nn.Module) -> None:
        eager = model.forward

        def forward(idx_BT, targets_BT=None, cache=None, segments_BT=None):
            # training alone: evaluation (no grad) and decoding run eagerly rather than pay a
            # second whole-model compile and CUDA graph for a few batches
            if targets_BT is None or cache is not None or not torch.is_grad_enabled():
                return eager(idx_BT, targets_BT, cache, segments_BT)
            return self.whole(self, model, idx_BT, targets_BT, segments_BT)

        model.forward = forward
        self.whole.regions = 1

    def _wrap_block(self, block: nn.Module) -> None:
        eager = block.forward

        def forward(x, cache=None, layer=0, aux=None):
            if cache is not None:  # decoding: shapes change every token, compiling never pays
                return eager(x, cache, layer, aux)
            return self.blocks(self, block, x, aux)

        block.forward = forward
        self.blocks.regions += 1

    def report(self) -> dict:
        """Counts since this model's regions were made: `regions` compiled and running
        compiled, `eager` regions sent back by a failure, dynamo's `graph_breaks`,
        `recompiles` (compiles of a kind after its first: one per kind for evaluation's no-grad
        form; more means a guard fails), `compile_s` (seconds spent compiling) and `aten_norms`
        (LayerNorms run by ATen's kernels, engine/transforms/norm.py)."""
        breaks, seconds = (a - b for a, b in zip(_counters(), self._start))
        kinds = self.kinds
        return {
            "regions": sum(k.regions for k in kinds if not k.failed),
            "eager": sum(k.regions for k in kinds if k.failed),
            "graph_breaks": breaks,
            "recompiles": sum(max(0, k.compiles - 1) for k in kinds),
            "compile_s": seconds,
            "scope": kinds[0].name if len(kinds) == 1 else "regions",
            "aten_norms": self.aten_norms,
        }


def compile_regions(model: nn.Module, is_main: bool = True, whole: bool = False) -> CompiledRegions:
    """Compile `model`'s block forwards and its head + loss, or with `whole` (scope "model") its
    whole training forward (see the module docstring); call it before checkpoint_blocks.
    Warnings go to stderr, one line, from rank 0 only."""

    def warn(msg: str) -> None:
        if is_main:
            print(f"warning: compile: {msg}", file=sys.stderr, flush=True)

    return CompiledRegions(model, warn, whole)


def report_line(r: dict) -> str:
    """The run log's line: 'compile: N regions, G graph breaks, R recompiles, T s'."""
    eager = f", {r['eager']} eager after a failure" if r["eager"] else ""
    regions = f"{r['regions']} regions"
    if r.get("scope") == "model":
        regions = "the whole model as one graph" if r["regions"] else "0 regions"
    norms = f"; {r['aten_norms']} LayerNorms through ATen" if r.get("aten_norms") else ""
    return (
        f"compile: {regions}{eager}, {r['graph_breaks']} graph breaks, "
        f"{r['recompiles']} recompiles, {r['compile_s']:.1f} s{norms}"
    )
