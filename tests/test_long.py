"""Long sequences on one device: the MLP a piece of tokens at a time (fitgpt/model/pieces.py).

The pieces against the whole MLP (loss and every gradient, fp32, Llama and GPT-2): in the
model, in an engine step with activation checkpointing, and at tensor parallelism 2 (with and
without sequence parallelism) on gloo; compiled as one graph, and by Inductor in an engine; a
16 k-token step whose MLP intermediates never exist whole and whose live tensor bytes stay
under the whole MLP's; the family's priced piece peak against the one measured. The threshold
is lowered in each test (MLP_PIECE_ELEMS, a module constant read at every call) so tiny models
take pieces. Then attention at long T (no T×T for causal attention, ALiBi's bound, Mistral's
window through FlexAttention), the loss by rows at long T, and YaRN against transformers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import CXX
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import fitgpt.model.pieces as pieces_mod
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.model import ModelConfig, build_model
from fitgpt.model.families import family_of
from fitgpt.model.pieces import mlp_piece_tokens

CPU = DistContext(0, 1, 0, torch.device("cpu"))
WHOLE = 10**15  # a threshold no test reaches: the MLP runs whole


def llama(**kw) -> ModelConfig:
    base = dict(family="llama", position="rope", bias=False, tie_embeddings=False)
    base.update(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, ffn_hidden=64, seq_len=64)
    base.update(vocab_size=96)
    return ModelConfig(**{**base, **kw})


def gpt2(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(n_layer=2, n_embd=32, n_head=4, seq_len=64, vocab_size=96), **kw})


CONFIGS = {"llama": llama, "gpt2": gpt2}


def pieces_of(tokens: int, cfg: ModelConfig, batch: int = 2) -> int:
    """The threshold that makes pieces of `tokens` tokens for a [batch, ·] micro-batch."""
    return tokens * batch * cfg.ffn_width


def batch_of(cfg: ModelConfig, rows: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=g)


def loss_and_grads(model, x):
    model.zero_grad()
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    err = (got - want).norm() / want.norm().clamp_min(1e-30)
    assert err <= rel, f"{what}: relative error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pieces_give_the_whole_mlps_loss_and_gradients(monkeypatch, family):
    cfg = CONFIGS[family]()
    model = build_model(cfg)
    model.reset_parameters(0)
    x = batch_of(cfg)
    monkeypatch.setattr(pieces_mod, "MLP_PIECE_ELEMS", WHOLE)
    want, gw = loss_and_grads(model, x)
    monkeypatch.setattr(pieces_mod, "MLP_PIECE_ELEMS", pieces_of(10, cfg))  # 7 pieces of 64
    assert mlp_piece_tokens(2, 64, cfg.ffn_width) == 10
    got, gg = loss_and_grads(model, x)
    assert_close_rel(got, want, 1e-6, "loss")
    for name in gw:
        assert_close_rel(gg[name], gw[name], 1e-6, name)


class LargestTensor(TorchDispatchMode):
    """The most elements any ATen op returns, and the peak of the bytes alive in storages the
    ops made, while the mode is on (forward, recompute and backward: CPU backward runs on the
    calling thread). A storage is alive until torch frees it (a weak reference to it), however
    many tensors, views or saved copies hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.peak = 0
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                st = t.untyped_storage()
                if st.data_ptr() not in self.live:
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_priced_piece_peak_is_the_measured_one(monkeypatch, family):
    """Family.mlp_activations' peak per token of a piece: the difference of the measured
    peaks at pieces of 128 and 256 tokens (everything else alike), within H per token."""
    cfg = CONFIGS[family](n_embd=64, ffn_hidden=256 if family == "llama" else None)
    mlp = build_model(cfg).blocks[0].mlp
    x = torch.randn(1, 1024, cfg.n_embd, requires_grad=True)
    peaks = []
    for t in (128, 256):
        monkeypatch.setattr(pieces_mod, "MLP_PIECE_ELEMS", pieces_of(t, cfg, batch=1))
        with LargestTensor() as seen:
            mlp(x).sum().backward()
        peaks.append(seen.peak)
    per_token = (peaks[1] - peaks[0]) / 128 / 4
    priced = family_of(cfg).mlp_activations(cfg)[1]
    assert abs(per_token - priced) <= cfg.n_embd, (per_token, priced)


def test_a_16k_token_step_never_holds_the_mlp_whole(monkeypatch):
    """16,384 tokens of a tiny Llama, one training step with the block checkpoint: no tensor
    of [T, F] or more is ever made (the whole MLP's gate and up are [T, 2F]; the logits
    [T, 128]), and the live bytes peak under the whole MLP's by at least its saved
    intermediates; the same step with the MLP whole fails both checks."""
    cfg = llama(n_layer=2, seq_len=16384, n_embd=32, n_head=2, n_kv_head=1, ffn_hidden=256)
    T, F = cfg.seq_len, cfg.ffn_width
    x = batch_of(cfg, rows=1)
    seen = {}
    for name, threshold in (("whole", WHOLE), ("pieces", pieces_of(1024, cfg, batch=1))):
        monkeypatch.setattr(pieces_mod, "MLP_PIECE_ELEMS", threshold)
        e = build_engine(
            cfg, EngineConfig(engine="ddp", checkpointing="full"), PrecisionConfig("fp32"),
            OptimConfig(), CPU,
        )  # fmt: skip
        with LargestTensor() as seen[name]:
            e.train_step([(x[:, :-1], x[:, 1:])], 1e-3)
        e.close()
    assert seen["whole"].largest >= T * 2 * F  # the check can fail
    assert seen["pieces"].largest < T * F
    saved = family_of(cfg).mlp_activations(cfg)[0] * T * 4  # the whole MLP's, in bytes
    assert seen["pieces"].peak <= seen["whole"].peak - saved, (seen["pieces"].peak, saved)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_engine_step_with_checkpointing_takes_the_pieces_alike(monkeypatch, family):
    """Two steps of the ddp engine with --checkpointing full (the block's checkpoint around
    the pieces' own): the same losses and gradient norms as the MLP whole."""
    cfg = CONFIGS[family]()
    runs = {}
    for name, threshold in (("whole", WHOLE), ("pieces", pieces_of(10, cfg, batch=4))):
        monkeypatch.setattr(pieces_mod, "MLP_PIECE_ELEMS", threshold)
        e = build_engine(
            cfg, EngineConfig(engine="ddp", checkpointing="full"), PrecisionConfig("fp32"),
            OptimConfig(grad_clip=0.5), CPU,
        )  # fmt: skip
        runs[name] = []
        for step in range(2):
            x = batch_of(cfg, rows=8, seed=step)
            st = e.train_step([(x[:4, :-1], x[:4, 1:]), (x[4:, :-1], x[4:, 1:])], 3e-3)
            runs[name].append((st.loss, st.grad_norm))
        e.close()
    for (lp, np_), (lw, nw) in zip(runs["pieces"], runs["whole"]):
        assert abs(lp - lw) <= 1e-6 * abs(lw) and abs(np_ - nw) <= 1e-6 * abs(nw)


def test_a_compiled_block_keeps_the_pieces_in_one_graph(monkeypatch):
    """dynamo traces each piece's checkpoint as its higher-order op: one graph, no break, and
    the compiled block's output and gradients equal the eager ones (aot_eager: the tracing
    and the partition into forward and backward that --compile blocks does, without
    Inductor's code generation, which takes minutes on 2 cores)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from fitgpt.engine.transforms.compile import _block_train

    torch._dynamo.reset()
    cfg = llama()
    model = build_model(cfg)
    model.reset_parameters(0)
    block, rope = model.blocks[0], model.block_aux(64, 0, "cpu")
    monkeypatch.setattr(pieces_mod, "MLP_PIECE_ELEMS", pieces_of(16, cfg))
    h = torch.randn(2, 64, cfg.n_embd, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(_block_train, backend=counter, fullgraph=True)
    got = fn(block, h, rope)
    (gh,) = torch.autograd.grad(got.square().sum(), h)
    want = _block_train(block, h, rope)
    (wh,) = torch.autograd.grad(want.square().sum(), h)
    assert counter.frame_count == 1
    ops = [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("checkpoint" in str(op) for op in ops) == 4  # 64 tokens, pieces of 16
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, wh, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(CXX is None, reason="no C++ compiler: Inductor cannot compile")
def test_compiled_blocks_at_stage_3_with_checkpointing_take_the_pieces(monkeypatch):
    """--compile blocks (Inductor) at ZeRO stage 3 with --checkpointing full and the MLP in
    pieces: every region compiled, no graph break, no recompile, and the eager losses and
    gradient norms (8-40 s on 2 cores: Inductor's caches warm or cold)."""
    monkeypatch.setattr(pieces_mod, "MLP_PIECE_ELEMS", pieces_of(16, llama()))
    x = batch_of(llama())
    runs = {}
    for scope in ("off", "blocks"):
        ecfg = EngineConfig(engine="zero", zero_stage=3, checkpointing="full", compile=scope)
        e = build_engine(llama(), ecfg, PrecisionConfig("fp32"), OptimConfig(), CPU)
        runs[scope] = [e.train_step([(x[:, :-1], x[:, 1:])], 1e-3) for _ in range(2)]
        if scope == "blocks":
            report = e.compile_report()
            assert report["eager"] == report["graph_breaks"] == report["recompiles"] == 0
        e.close()
    for got, want in zip(runs["blocks"], runs["off"]):
        assert abs(got.loss - want.loss) <= 1e-5 * want.loss
        assert abs(got.grad_norm - want.grad_norm) <= 1e-5 * want.grad_norm


def tp_worker(rank: int, world: int) -> None:
    from helpers import full_tp_grads

    from fitgpt.dist import init_distributed
    from fitgpt.parallel import parallelize

    ctx = init_distributed("cpu").with_tensor_parallel(2)
    for family in ("llama", "gpt2"):
        for sp in (False, True):
            cfg = CONFIGS[family]()
            ref = build_model(cfg)
            ref.reset_parameters(0)
            x = batch_of(cfg)
            tp = parallelize(copy.deepcopy(ref), ctx.mesh, sequence_parallel=sp)
            pieces_mod.MLP_PIECE_ELEMS = WHOLE
            want, gw = loss_and_grads(ref, x)  # one process, the MLP whole
            # pieces of 10 tokens of this rank's MLP input (32 under sequence parallelism)
            pieces_mod.MLP_PIECE_ELEMS = pieces_of(10, cfg)
            got, _ = loss_and_grads(tp, x)
            assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item()), (family, sp)
            full = full_tp_grads(tp, ctx.mesh, ref.family.split_rule, sp)
            for name, g in full.items():
                assert_close_rel(g, gw[name], 1e-5, f"{family} sp={sp} {name}")


def test_tensor_and_sequence_parallel_pieces_equal_one_process(gloo):
    gloo(2, tp_worker)


def test_the_planner_reads_the_pieces_from_the_family():
    """mlp_piece_elems: 0 under the threshold, one piece's peak past it; under tensor
    parallelism 1/tp of it, under sequence parallelism each rank's piece as one process's."""
    from fitgpt.model import PRESETS

    cfg = PRESETS["llama3.1-8b"]
    fam = family_of(cfg)
    F = cfg.ffn_width
    assert fam.mlp_piece_elems(cfg, 1, 4096) == 0 and fam.mlp_piece_elems(cfg, 4, 4096) == 0
    t = pieces_mod.MLP_PIECE_ELEMS // F  # 18,724 tokens
    assert fam.mlp_piece_elems(cfg, 1, 131072) == 6 * F * t
    assert fam.mlp_piece_elems(cfg, 1, 131072, tp=2) == 6 * F * t // 2
    assert fam.mlp_piece_elems(cfg, 1, 131072, tp=2, sp=True) == 6 * F * t
    assert fam.mlp_piece_elems(cfg, 1, 32768, tp=2, sp=True) == 0  # 16,384 a rank: whole


# ---- rotary scaling past the training length: YaRN -------------------------------------------
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize(
    "extra",
    [{}, {"truncate": True}, {"beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25,
                              "truncate": False}],
)  # fmt: skip
def test_yarn_tables_are_transformers_to_the_last_bit(extra):
    """cos and sin (attention factor applied) of 40 positions, past the original 16, equal to
    transformers' rotary embedding of the same config.json, bit for bit."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from fitgpt.interop.hf import model_config_from_hf
    from fitgpt.model.families.llama.model import rope_tables

    hf = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=300,
        rope_parameters={"rope_theta": 1e6, **YARN, **extra},
    )  # fmt: skip
    cfg = model_config_from_hf(hf.to_dict(), "config.json")
    assert cfg.rope_scaling.kind == "yarn"
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, 40, 16), torch.arange(40)[None])
    ours = rope_tables(cfg, 40, 0, "cpu")
    assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0])


def test_unknown_rope_scalings_are_refused_naming_them():
    from fitgpt.errors import UserError
    from fitgpt.model.config import RopeScaling

    with pytest.raises(UserError, match="rope scaling 'dynamic' is not supported"):
        RopeScaling(kind="dynamic")
    # a meta.json written before yarn existed reads back (its llama3 scaling unchanged)
    old = {"kind": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_positions": 8192}  # fmt: skip
    cfg = llama(rope_scaling=RopeScaling(**old))
    assert ModelConfig.from_dict({**cfg.to_dict(), "rope_scaling": old}) == cfg


# ---- attention at any length -------------------------------------------------------------------
def test_the_window_takes_flex_only_where_it_serves():
    """Packing.window: None on the CPU (the attention's own mask, the reference), within the
    window and with dropout; the choice is Packing.of's (model/packing.py)."""
    from fitgpt.model.packing import Packing

    cfg = llama(family="mistral", sliding_window=8)
    assert Packing.window(64, cfg, "cpu", 0.0, True) is None
    assert Packing.window(64, llama(), "cuda", 0.0, True) is None  # no window: is_causal, no mask
    assert Packing.window(8, cfg, "cuda", 0.0, True) is None  # within the window: is_causal
    assert Packing.window(64, cfg, "cuda", 0.1, True) is None  # dropout: the mask path


@pytest.mark.slow
@pytest.mark.skipif(CXX is None, reason="no C++ compiler: no CPU FlexAttention")
def test_the_windows_flex_path_equals_the_mask_path():
    """What CUDA runs for Mistral's window (one segment's BlockMask, [1, T] broadcast over a
    batch of 2) through the attention module, against its own [T, T] mask, forward only
    (FlexAttention has no CPU backward; benchmarks/memory/long_seq_gpu.py checks it on a GPU)."""
    from fitgpt.model.families.llama.model import rope_tables
    from fitgpt.model.packing import Packing, segment_positions, window_block_mask

    cfg = llama(family="mistral", sliding_window=17, seq_len=256)
    model = build_model(cfg)
    model.reset_parameters(0)
    attn = model.blocks[0].attn.eval()
    seg = torch.zeros(1, 256, dtype=torch.int64)
    pos = segment_positions(seg)
    packing = Packing(seg, pos, flex=window_block_mask(256, cfg.sliding_window, "cpu"))
    x = torch.randn(2, 256, cfg.n_embd, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = attn(x, None, 0, rope_tables(cfg, 256, 0, "cpu"))
        got = attn(x, None, 0, (rope_tables(cfg, 256, 0, "cpu", pos), packing))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_causal_attention_builds_no_square_and_alibi_refuses_past_its_bias():
    """GPT-2 with learned positions at 8,192 tokens: no tensor of T² elements (SDPA's causal
    kernel; the CPU's flash kernel as the GPU's); ALiBi, whose [N, S, S] bias is built whole,
    refused in one line where that bias passes ALIBI_BIAS_MAX_BYTES."""
    from fitgpt.errors import UserError

    cfg = gpt2(seq_len=8192, n_layer=1, n_embd=16, n_head=2)
    model = build_model(cfg)
    x = batch_of(cfg, rows=1)
    with LargestTensor() as seen:
        model(x[:, :-1], x[:, 1:]).backward()
    assert seen.largest < 8192**2 // 16
    gpt2(position="alibi", seq_len=4096)  # 0.75 GiB of bias: taken
    with pytest.raises(UserError, match=r"position='alibi' at seq_len=131072: .* seq_len <= "):
        gpt2(position="alibi", seq_len=131072)


# ---- the loss at long T ------------------------------------------------------------------------
def test_the_loss_goes_by_rows_at_long_t_and_never_makes_all_the_logits(monkeypatch):
    """At 128 k tokens of Llama 3's 128,256 tokens the loss takes pieces of 1,046 rows (a
    [1046, V] piece, 0.5 GiB fp32, where all the logits would be 62.6 GiB); at small sizes with
    PIECE_LOGITS lowered, a Llama's step over 2,048 tokens of a 1,024 vocabulary never makes a
    [T, V] tensor and gives the plain loss and gradients."""
    import fitgpt.model.loss as loss_mod

    assert loss_mod.loss_pieces(131072, 128256) == 1046
    cfg = llama(seq_len=2048, vocab_size=1000, n_layer=1)  # padded to 1,024
    T, V = cfg.seq_len, cfg.padded_vocab_size
    model = build_model(cfg)
    model.reset_parameters(0)
    x = batch_of(cfg, rows=1)
    want, gw = loss_and_grads(model, x)  # the plain loss: [T, V] logits
    monkeypatch.setattr(loss_mod, "PIECE_LOGITS", 64 * V)
    assert loss_mod.loss_pieces(T, V) == 64
    with LargestTensor() as seen:
        got, gg = loss_and_grads(model, x)
    assert seen.largest < T * V
    assert_close_rel(got, want, 1e-6, "loss")
    for name in gw:
        assert_close_rel(gg[name], gw[name], 1e-5, name)
