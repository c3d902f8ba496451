"""The loss a piece of rows at a time (fitgpt/model/loss.py) against the plain full-logits loss.

Loss and gradients (hidden rows, head weight; tied and untied) within fp32 rounding for several
piece sizes, padded vocabulary rows, ignored targets; bf16 close to the plain path; the model
(head_loss) switching past PIECE_LOGITS, left out of a compiled graph; the vocabulary-
parallel form at T = 2 on gloo equal to one process; no [N, V] tensor made.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fitgpt.model.loss as loss_mod
from fitgpt.model import GPT, ModelConfig
from fitgpt.model.loss import loss_pieces, pieces_cross_entropy

N, H, V, REAL = 45, 16, 48, 41  # V padded past the real vocabulary, as padded_vocab_size does


def plain_loss(x_NH, w_VH, t_N, real):
    """The full-logits loss as DecoderLM.head_loss computes it (padded columns -inf)."""
    z = x_NH @ w_VH.t()
    z = z.masked_fill(torch.arange(w_VH.shape[0]) >= real, float("-inf"))
    return F.cross_entropy(z.float(), t_N, ignore_index=-1)


def inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = (0.5 * torch.randn(V, H, generator=g)).to(dtype).requires_grad_()
    t = torch.randint(0, REAL, (N,), generator=g)
    t[[0, 7, 30]] = -1  # ignored targets, scattered
    t[10:20] = -1  # a whole piece ignored (rows 10-19 at piece 10)
    return x, w, t


def loss_and_grads(fn, x, w, t, scale=3.0):
    loss = fn(x, w, t)
    gx, gw = torch.autograd.grad(loss * scale, (x, w))  # grad_output != 1, as the engines scale
    return loss, gx, gw


@pytest.mark.parametrize("rows", [1, 7, 10, 16, 45, 64])
def test_pieces_equal_the_full_loss_and_gradients(rows):
    x, w, t = inputs()
    want = loss_and_grads(lambda *a: plain_loss(*a, REAL), x, w, t)
    got = loss_and_grads(lambda *a: pieces_cross_entropy(*a, rows, REAL), x, w, t)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_all_ignored_targets_give_nan_and_zero_gradients_as_cross_entropy():
    x, w, t = inputs()
    t[:] = -1
    loss, gx, gw = loss_and_grads(lambda *a: pieces_cross_entropy(*a, 8, REAL), x, w, t)
    want, wx, ww = loss_and_grads(lambda *a: plain_loss(*a, REAL), x, w, t)
    assert loss.isnan() and want.isnan()
    assert gx.abs().sum() == 0 and gw.abs().sum() == 0 and wx.abs().sum() == ww.abs().sum() == 0


def test_padded_rows_get_no_gradient_and_no_probability():
    x, w, t = inputs()
    _, _, gw = loss_and_grads(lambda *a: pieces_cross_entropy(*a, 8, REAL), x, w, t)
    assert gw[REAL:].abs().sum() == 0 and gw[:REAL].abs().sum() > 0
    with torch.no_grad():  # large padded weights change nothing: they are out of the softmax
        w2 = w.detach().clone()
        w2[REAL:] = 50.0
    assert pieces_cross_entropy(x, w2, t, 8, REAL) == pieces_cross_entropy(x, w, t, 8, REAL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_and_fp16_are_close_to_the_plain_path(dtype):
    x, w, t = inputs(dtype)
    want = loss_and_grads(lambda *a: plain_loss(*a, REAL), x, w, t)
    got = loss_and_grads(lambda *a: pieces_cross_entropy(*a, 10, REAL), x, w, t)
    assert got[1].dtype == got[2].dtype == dtype and got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(got[1:], want[1:]):  # a few bf16 roundings apart (one per piece in gw)
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def tiny(tie: bool) -> GPT:
    cfg = ModelConfig(
        n_layer=2, n_embd=32, n_head=4, seq_len=24, vocab_size=200, tie_embeddings=tie
    )
    m = GPT(cfg)
    m.reset_parameters(0)
    return m


def batch():
    return torch.randint(0, 200, (2, 25), generator=torch.Generator().manual_seed(1))


def grads_of(m, x):
    m.zero_grad()
    loss = m(x[:, :-1], x[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.fixture
def small_pieces(monkeypatch):
    """PIECE_LOGITS lowered so a tiny model's 48 × 256 logits go in pieces of 10 rows."""
    monkeypatch.setattr(loss_mod, "PIECE_LOGITS", 10 * 256)
    assert loss_pieces(48, 256) == 10 and loss_pieces(10, 256) == 0


@pytest.mark.parametrize("tie", [True, False])
def test_the_model_takes_the_pieces_past_one_piece(small_pieces, tie):
    ref, m, x = tiny(tie), tiny(tie), batch()
    loss_mod.PIECE_LOGITS, saved = 10**9, loss_mod.PIECE_LOGITS  # the plain path for ref
    want, gw = grads_of(ref, x)
    loss_mod.PIECE_LOGITS = saved
    got, gg = grads_of(m, x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name in gw:  # the tied head's gradient lands on the embedding with its own
        torch.testing.assert_close(gg[name], gw[name], rtol=1e-5, atol=1e-6)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an ATen op returns while the mode is on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_all_tokens_by_vocabulary_is_made(small_pieces):
    m, x = tiny(False), batch()
    Vp = m.cfg.padded_vocab_size  # 256 columns, 48 tokens
    with LargestTensor() as seen:
        grads_of(m, x)
    # the largest is the [256, 32] head weight and its gradient; a piece is [10, 256]
    assert seen.largest == Vp * 32 < 48 * Vp
    loss_mod.PIECE_LOGITS = 10**9  # the plain path: the check can fail
    with LargestTensor() as seen:
        grads_of(m, x)
    assert seen.largest == 48 * Vp


def test_the_compiled_head_leaves_the_pieces_out_of_its_graph(small_pieces):
    # compiled, the unrolled pieces held nearly the whole [N, V] from 64 pieces on and ran an
    # H100 out of memory (model/loss.py pieces_cross_entropy): the compiled head breaks the
    # graph around them and runs them as the eager loss does; equal results
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    m, x = tiny(True), batch()
    h = torch.randn(2, 24, 32, requires_grad=True)
    counter = CompileCounterWithBackend("eager")
    fn = torch.compile(lambda h, t: GPT.head_loss(m, h, t), backend=counter)
    got = fn(h, x[:, 1:])
    (gh,) = torch.autograd.grad(got, h)
    want = GPT.head_loss(m, h, x[:, 1:])
    (wh,) = torch.autograd.grad(want, h)
    assert counter.frame_count >= 1  # the final norm is still compiled
    ops = [n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert not any(type(op).__name__ == "AutogradFunctionApply" for op in ops)
    assert not any("mm" in str(op) or "matmul" in str(op) for op in ops), ops
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gh, wh, rtol=1e-5, atol=1e-6)
    # below one piece the plain loss stays in the graph (fused whole: its peak is priced so)
    loss_mod.PIECE_LOGITS = 10**9
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    fn = torch.compile(lambda h, t: GPT.head_loss(m, h, t), backend=counter, fullgraph=True)
    fn(h, x[:, 1:])
    assert counter.frame_count == 1


def tp_worker(rank: int, world: int) -> None:
    from helpers import full_tp_grads

    from fitgpt.dist import init_distributed
    from fitgpt.parallel import parallelize

    loss_mod.PIECE_LOGITS = 10 * 128  # this rank's 128 columns: pieces of 10 rows
    assert loss_pieces(48, 128) == 10
    ctx = init_distributed("cpu").with_tensor_parallel(2)
    for tie, sp in ((True, False), (False, False), (True, True)):
        ref, x = tiny(tie), batch()
        tp = parallelize(copy.deepcopy(ref), ctx.mesh, sequence_parallel=sp)
        saved, loss_mod.PIECE_LOGITS = loss_mod.PIECE_LOGITS, 10**9
        want, gw = grads_of(ref, x)  # one process, the plain loss
        loss_mod.PIECE_LOGITS = saved
        got, _ = grads_of(tp, x)
        assert abs(got.item() - want.item()) < 1e-5, (tie, sp)
        full = full_tp_grads(tp, ctx.mesh, ref.family.split_rule, sp)
        for name, g in full.items():
            torch.testing.assert_close(g, gw[name], rtol=1e-4, atol=1e-6, msg=name)


def test_vocab_parallel_pieces_equal_one_process(gloo):
    gloo(2, tp_worker)
