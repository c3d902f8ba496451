"""Packed samples kept apart (model/packing.py) and the step's token-weighted loss
(engine/base.py loss_weights): a packed row's samples give the logits and gradients they give
alone, for the Llama families (Mistral's window inside each sample) and GPT-2 (learnt positions
and ALiBi); a step over micro-batches of different counts equals the one big batch; empty
micro-batches and steps stay finite; two gloo ranks with ZeRO and tensor parallelism train as
one process; and `fitgpt data preprocess --chat` then `fitgpt train` runs end to end."""

from __future__ import annotations

import json
import math
import random

import pytest
import tokenizer_folders as tf
import torch
from cli_refusal import run_in_process
from helpers import CXX, TWO_RANK_ENGINES, close

from fitgpt.data.source import Batch
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.model import ModelConfig, build_model

CPU = DistContext(0, 1, 0, torch.device("cpu"))
S = 32
LLAMA = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, seq_len=S, vocab_size=96, bias=False,
             position="rope", ffn_hidden=96, tie_embeddings=False)  # fmt: skip
MODELS = {
    "qwen3": ModelConfig(**LLAMA, family="qwen3", qk_norm=True),  # GQA, q/k norms
    "mistral": ModelConfig(**LLAMA, family="mistral", sliding_window=5),  # window < samples
    "gpt2": ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=S, vocab_size=96),
    "gpt2_alibi": ModelConfig(
        n_layer=2, n_embd=32, n_head=4, seq_len=S, vocab_size=96, position="alibi"
    ),
}


def packed_batch(rows: int, seed: int, vocab: int = 96, masked: float = 0.3) -> Batch:
    """`rows` packed rows as BatchLoader makes them: samples of 3-12 tokens, the rest padding
    (its own segment); a target is -1 at each sample's last token (the next is another's), on
    padding and on a share `masked` of the others (a chat's non-assistant tokens)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, S + 1), generator=g)
    seg = torch.zeros(rows, S + 1, dtype=torch.int64)
    keep = torch.rand(rows, S + 1, generator=g) >= masked
    for r in range(rows):
        pos, s = 0, 0
        while pos < S + 1:
            n = min(rng.randint(3, 12), S + 1 - pos)
            seg[r, pos : pos + n] = s
            pos, s = pos + n, s + 1
        last = int(seg[r].max())
        if rng.random() < 0.5 and last > 0:  # a padded row: its last segment is padding
            keep[r, seg[r] == last] = False
            tokens[r, seg[r] == last] = 0
    targets = tokens[:, 1:].clone()
    targets[~(keep[:, 1:] & (seg[:, 1:] == seg[:, :-1]))] = -1
    return Batch(tokens[:, :-1].contiguous(), targets, seg[:, :-1].contiguous())


def alone(b: Batch) -> list[tuple[int, int, Batch]]:
    """Each sample of a packed batch as a row of its own, padded (targets -1), no segments:
    (row, first position in the packed row, the one-row batch)."""
    out = []
    for r in range(b.inputs.shape[0]):
        for s in b.segments[r].unique().tolist():
            where = (b.segments[r] == s).nonzero().flatten()
            x = torch.zeros(1, S, dtype=torch.int64)
            y = torch.full((1, S), -1, dtype=torch.int64)
            x[0, : len(where)], y[0, : len(where)] = b.inputs[r, where], b.targets[r, where]
            out.append((r, int(where[0]), Batch(x, y)))
    return out


def seeded(cfg: ModelConfig):
    torch.manual_seed(0)
    m = build_model(cfg)
    m.reset_parameters(seed=3)
    return m.eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_row_gives_each_sample_its_own_logits_and_gradients(name):
    model = seeded(MODELS[name])
    b = packed_batch(2, seed=1)
    packed = model(b.inputs, segments_BT=b.segments)
    plain = model(b.inputs)
    for r, t0, one in alone(b):
        n = int((b.segments[r] == b.segments[r, t0]).sum())
        want = model(one.inputs)[0, :n]
        assert torch.allclose(packed[r, t0 : t0 + n], want, atol=1e-5), (r, t0)
        if t0 > 0:  # without segments the later samples see the earlier ones
            assert not torch.allclose(plain[r, t0 : t0 + n], want, atol=1e-3)
    # the gradient of the packed rows' summed loss is the sum of the samples' alone
    count = int((b.targets != -1).sum())
    (model(b.inputs, b.targets, segments_BT=b.segments) * count).backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    for _, _, one in alone(b):
        c = int((one.targets != -1).sum())
        if c:
            (model(one.inputs, one.targets) * c).backward()
    for k, p in model.named_parameters():
        assert torch.allclose(got[k], p.grad, atol=1e-5, rtol=1e-4), k


def engine(cfg: ModelConfig, **kw):
    ecfg = EngineConfig(**{"engine": "zero", "zero_stage": 0, **kw})
    return build_engine(cfg, ecfg, PrecisionConfig(precision="fp32"), OptimConfig(), CPU)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("qwen3", {"engine": "ddp"}),
        ("qwen3", {"checkpointing": "full"}),  # the recompute in the backward gets the segments
        ("gpt2", {"zero_stage": 0}),
        ("gpt2_alibi", {"checkpointing": "cpu"}),  # ALiBi's bias folded into the mask
        ("mistral", {"offload_optimizer": "cpu", "offload_blocks": 1}),
    ],
)
def test_an_engine_step_on_packed_rows_equals_the_samples_alone(name, kw):
    """One step on 2 packed rows against a step whose micro-batches are the samples, one
    padded row each (counts 0-11: the token-weighted mean makes them the same step); the
    second step's loss shows the updates agree."""
    cfg, b = MODELS[name], packed_batch(2, seed=2)
    ea, eb = engine(cfg, **kw), engine(cfg, **kw)
    singles = [one for _, _, one in alone(b)]
    assert len({int((o.targets != -1).sum()) for o in singles}) > 2  # different counts
    assert any(int((o.targets != -1).sum()) == 0 for o in singles)  # padding: none counted
    sa, sb = ea.train_step([b], 1e-2), eb.train_step(singles, 1e-2)
    assert math.isfinite(sa.loss) and abs(sa.loss - sb.loss) < 1e-5
    assert abs(sa.grad_norm - sb.grad_norm) < 1e-5 and sa.counted == sb.counted
    assert abs(ea.train_step([b], 1e-2).loss - eb.train_step([b], 1e-2).loss) < 1e-5
    assert abs(ea.eval_loss([b]) - eb.eval_loss(singles)) < 1e-5


def test_the_step_loss_is_the_token_mean_over_micro_batches_of_different_counts():
    """Micro-batches of 1, 2 and 3 rows (plain token data with some targets masked) against the
    same 6 rows as one micro-batch: equal loss, gradient norm and update."""
    cfg = MODELS["gpt2"]
    b = packed_batch(6, seed=4, masked=0.6)
    plain = Batch(b.inputs, b.targets)  # no segments: the -1 targets alone
    parts = [Batch(plain.inputs[i:j], plain.targets[i:j]) for i, j in ((0, 1), (1, 3), (3, 6))]
    for kw in ({"engine": "ddp"}, {"zero_stage": 0}):
        ea, eb = engine(cfg, **kw), engine(cfg, **kw)
        sa, sb = ea.train_step([plain], 1e-2), eb.train_step(parts, 1e-2)
        assert abs(sa.loss - sb.loss) < 1e-5 and abs(sa.grad_norm - sb.grad_norm) < 1e-5
        assert abs(ea.train_step([plain], 1e-2).loss - eb.train_step([plain], 1e-2).loss) < 1e-5


def test_micro_batches_and_steps_with_no_counted_target_stay_finite():
    cfg = MODELS["qwen3"]
    b = packed_batch(2, seed=5)
    empty = Batch(b.inputs, torch.full_like(b.targets, -1), b.segments)
    for kw in ({"engine": "ddp"}, {"zero_stage": 0}):
        ea, eb = engine(cfg, **kw), engine(cfg, **kw)
        sa, sb = ea.train_step([b, empty], 1e-2), eb.train_step([b], 1e-2)
        assert abs(sa.loss - sb.loss) < 1e-6 and abs(sa.grad_norm - sb.grad_norm) < 1e-6
        # a whole step with nothing counted: loss 0, no update (the next step is unchanged)
        st = ea.train_step([empty, empty], 1e-2)
        assert (st.loss, st.grad_norm, st.counted, st.skipped) == (0.0, 0.0, 0, False)
        assert abs(ea.train_step([b], 1e-2).loss - eb.train_step([b], 1e-2).loss) < 1e-6
        assert math.isnan(ea.eval_loss([empty]))  # evaluation says it: no token to score


# ---- two gloo ranks -----------------------------------------------------------------------
STEPS = 3
DIST = {
    "mistral": ["zero1", "zero3", "zero3_offload_stream", "tp2_ddp", "tp2_zero2_sp"],
    "gpt2": ["ddp", "zero2", "tp2_zero2_sp"],  # learnt positions sliced by sequence parallelism
}


def packed_losses(cfg: ModelConfig, ecfg: EngineConfig, ctx) -> list[float]:
    """STEPS steps of 2 micro-batches of a global batch of 4 packed rows; data-parallel rank d
    takes rows [d·b, (d+1)·b): the ranks' counts differ, so the weights cross ranks."""
    ctx = ctx.laid_out(ecfg.tensor_parallel, ecfg.context_parallel)
    e = build_engine(cfg, ecfg, PrecisionConfig(precision="fp32"), OptimConfig(), ctx)
    dp, d = (e.ctx.dp_world, e.ctx.dp_rank) if ctx.distributed else (1, 0)
    n = 4 // dp
    out = []
    for step in range(STEPS):
        micro = []
        for m in range(2):
            b = packed_batch(4, seed=100 * step + m, masked=0.5)
            micro.append(Batch(*(t[d * n : (d + 1) * n] for t in b)))
        out.append(e.train_step(micro, 1e-2).loss)
    e.close()
    return out


def two_rank_worker(rank: int, world: int, tmp: str) -> None:
    from pathlib import Path

    from fitgpt.dist import init_distributed

    ctx = init_distributed("cpu")
    res = {
        f"{name}/{key}": packed_losses(MODELS[name], TWO_RANK_ENGINES[key], ctx)
        for name, keys in DIST.items()
        for key in keys
    }
    if ctx.rank == 0:
        (Path(tmp) / "results.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_packed_data_trains_on_two_ranks_as_on_one(tmp_path, gloo):
    refs = {name: packed_losses(MODELS[name], EngineConfig(engine="ddp"), CPU) for name in DIST}
    gloo(2, two_rank_worker, str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())
    for key, got in res.items():
        assert close(got, refs[key.split("/")[0]]), (key, got)


# ---- the command line ---------------------------------------------------------------------
def test_preprocess_chat_then_train_runs_end_to_end(tmp_path, capsys):
    tok = tf.qwen(tmp_path / "qwen")
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "ok", "why", "because"]
    with open(tmp_path / "chats.jsonl", "w") as f:
        for _ in range(60):
            say = lambda k: " ".join(rng.choice(words) for _ in range(rng.randint(1, k)))  # noqa: E731
            msgs = [{"role": "user", "content": say(8)}, {"role": "assistant", "content": say(12)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    code, err = run_in_process(
        capsys, "data", "preprocess", "--chat", "--input", tmp_path / "chats.jsonl",
        "--tokenizer", tok, "--output-prefix", tmp_path / "chats",
    )  # fmt: skip
    assert code in (0, None), err
    prefix = next(tmp_path.glob("chats*.idx")).with_suffix("")
    prefix = str(prefix).removesuffix(".loss_mask")
    code, err = run_in_process(
        capsys, "train", "--preset", "tiny-llama", "--layers", "2", "--hidden", "32",
        "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2", "--device", "cpu",
        "--data", prefix, "--steps", "3", "--log-every", "1", "--eval-every", "3",
        "--eval-batches", "2", "--no-save", "--out", tmp_path / "run",
    )  # fmt: skip
    assert code in (0, None), err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if r.get("kind") == "train"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), records
    assert all(math.isfinite(r["val_loss"]) for r in records if r.get("kind") == "eval")


@pytest.mark.slow
@pytest.mark.skipif(CXX is None, reason="no C++ compiler: TorchInductor cannot compile CPU code")
def test_compiled_regions_with_checkpointing_train_packed_rows_as_eager():
    """The compiled blocks take the Packing in their aux (and the recompute in the backward gets
    it again); a plain batch after packed ones still runs (a graph of its own)."""
    cfg, b = MODELS["qwen3"], packed_batch(2, seed=7)
    eager = engine(cfg, checkpointing="full")
    comp = engine(cfg, checkpointing="full", compile="blocks")
    for batch in (b, b, Batch(b.inputs, b.targets)):
        want, got = eager.train_step([batch], 1e-2), comp.train_step([batch], 1e-2)
        assert abs(want.loss - got.loss) < 1e-4 and abs(want.grad_norm - got.grad_norm) < 1e-3
    assert comp.compile_report()["eager"] == 0


@pytest.mark.slow
@pytest.mark.skipif(CXX is None, reason="no C++ compiler: TorchInductor cannot compile CPU code")
@pytest.mark.parametrize("window", [None, 17])
def test_the_cuda_kernels_document_mask_equals_the_reference_mask(window):
    """The flex path's BlockMask and call (what CUDA runs) against the SDPA mask, forward only:
    FlexAttention has no CPU backward (benchmarks/parts/packed_attention_gpu.py checks gradients on a
    GPU). Grouped-query heads, samples of 1-130 tokens, Mistral's window inside them."""
    from fitgpt.model.packing import Packing, block_mask, keep_mask, segment_positions

    seg = torch.zeros(2, 256, dtype=torch.int64)
    seg[0, 40:], seg[0, 170:], seg[1, 100:], seg[1, 101:] = 1, 2, 1, 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 256, 16, generator=g) for h in (4, 2, 2))
    pos = segment_positions(seg)
    flex = Packing(seg, pos, flex=block_mask(seg, window)).attend(q, k, v, 0.0)
    ref = Packing(seg, pos, mask=keep_mask(seg, window)).attend(q, k, v, 0.0)
    assert torch.allclose(flex, ref, atol=1e-5)
