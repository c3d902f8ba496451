"""Moment storage formats: round-trip error bounds, exact checkpoints, AdamW through the stores."""

import pytest
import torch
import torch.nn.functional as F

from fitgpt.engine.formats.moments import BLOCK, bytes_per_param, make_store
from fitgpt.errors import UserError

SIZES = [1, 2047, 2049, 100_003]


def moments(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Realistic m ~ N(0, 1e-3) and v spanning 1e-12..1e-4, with exact zeros and, when there is
    room, a whole block of zeros."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * 1e-3
    v = 10.0 ** (torch.rand(n, generator=g) * 8 - 12)
    m[::7] = 0.0
    v[::11] = 0.0
    if n > 2 * BLOCK:
        m[BLOCK : 2 * BLOCK] = 0.0
        v[BLOCK : 2 * BLOCK] = 0.0
    return m, v


def round_trip(kind: str, x: torch.Tensor, signed: bool) -> torch.Tensor:
    s = make_store(kind, x.numel(), signed)
    s.encode_from(x)
    out = torch.full_like(x, float("nan"))  # decode must write every element
    s.decode_into(out)
    return out


def blocks(x: torch.Tensor) -> torch.Tensor:
    """x zero-padded to whole blocks, as [nblocks, BLOCK]."""
    return F.pad(x, (0, -x.numel() % BLOCK)).view(-1, BLOCK)


@pytest.mark.parametrize("n", SIZES)
def test_fp32_is_exact(n):
    m, v = moments(n)
    assert torch.equal(round_trip("fp32", m, True), m)
    assert torch.equal(round_trip("fp32", v, False), v)


@pytest.mark.parametrize("n", SIZES)
def test_bf16_within_2_to_minus_8_relative(n):
    for x, signed in zip(moments(n), (True, False)):
        y = round_trip("bf16", x, signed)
        assert torch.all((y - x).abs() <= x.abs() * 2**-8)


@pytest.mark.parametrize("n", SIZES)
def test_int8_m_within_half_a_step_of_its_block(n):
    m, _ = moments(n)
    y = round_trip("int8", m, True)
    step = blocks(m).abs().amax(dim=1, keepdim=True) / 127
    err = blocks(y - m).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-5))
    assert torch.all(y[m == 0] == 0)


@pytest.mark.parametrize("n", SIZES)
def test_int8_v_via_sqrt(n):
    _, v = moments(n)
    y = round_trip("int8", v, False)
    # sqrt(v) is off by at most half a step s, so v by at most sqrt(v)·s + s²/4
    s = blocks(v).amax(dim=1, keepdim=True).sqrt() / 255
    r = blocks(v).sqrt()
    assert torch.all(blocks(y - v).abs() <= (r * s + s * s / 4) * (1 + 1e-4))
    # the bottom bucket decodes to its top: zero only where the whole block is zero
    assert torch.equal(y > 0, (s > 0).expand(-1, BLOCK).reshape(-1)[:n])


@pytest.mark.parametrize("signed", [True, False])
def test_int8_encode_through_callers_room_matches_its_own(signed):
    """The compact update hands int8 its spent gradient piece as the quantisation temporary
    (no allocation per pass on a GPU): the stored bytes are the same, the room is really used,
    and room too small is refused. Over more than one host pass (WORK) and a partial block."""
    from fitgpt.engine.formats.moments import WORK

    n = WORK + 3 * BLOCK + 5
    x = moments(n)[0 if signed else 1]
    own, given = make_store("int8", n, signed), make_store("int8", n, signed)
    own.encode(0, n, x)
    work = torch.full((n,), float("nan"))
    given.encode(0, n, x, work=work)
    for k in own.tensors:
        assert torch.equal(own.tensors[k], given.tensors[k])
    assert not torch.isnan(work[: n // BLOCK * BLOCK]).any()
    with pytest.raises(ValueError, match="work room"):
        given.encode(0, n, x, work=torch.empty(n - 1))


def test_int8_quiet_element_in_a_noisy_block_takes_an_adam_sized_step():
    """An element with m = 1e-5, v = 2.8e-10 and no gradient this step, sharing a block with a
    noisy one (v = 1e-4, m ≈ 0): its v is in the bottom bucket while its m survives. fp32 moves
    it by 0.55·lr; decoding v as 0 would move it by m/eps ≈ 900·lr."""
    lr, m, v = 1e-3, torch.zeros(BLOCK), torch.zeros(BLOCK)
    m[0], v[0], m[1], v[1] = 1e-6, 1e-4, 1e-5, 2.8e-10
    w = torch.zeros(BLOCK, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    m32, v32 = round_trip("int8", m, True), round_trip("int8", v, False)
    opt.state[w] = {"step": torch.tensor(100.0), "exp_avg": m32, "exp_avg_sq": v32}
    w.grad = torch.zeros(BLOCK)
    w.grad[0] = 1e-2
    opt.step()
    assert 0.3 * lr < -float(w.detach()[1]) < 1.2 * lr


def test_sizes():
    n = 10 * BLOCK
    assert make_store("fp32", n, True).nbytes() == 4 * n
    assert make_store("bf16", n, False).nbytes() == 2 * n
    assert make_store("int8", n, True).nbytes() == n + 4 * 10
    assert bytes_per_param("fp32") == 8 and bytes_per_param("bf16") == 4
    assert 2.0 < bytes_per_param("int8") < 2.005


def test_unknown_kind_is_refused():
    for call in (lambda: make_store("fp8", 4, True), lambda: bytes_per_param("fp8")):
        with pytest.raises(UserError, match="fp32, bf16, int8"):
            call()


# ---- AdamW through the stores, on a quadratic: loss = ½ Σ a·(w - t)², curvatures 1e-2..1e2 ----
N = 4099  # three int8 blocks, the last one partial


def quadratic():
    g = torch.Generator().manual_seed(3)
    a = 10.0 ** (torch.rand(N, generator=g) * 4 - 2)
    t = torch.randn(N, generator=g) * 0.1
    return a, t


def adamw_run(kind: str | None, steps: int = 50) -> tuple[torch.Tensor, list[float]]:
    """Train w from 0 with fused AdamW; kind=None keeps the moments in AdamW's own fp32 state,
    otherwise they live in stores and pass through fp32 scratch around each step."""
    a, t = quadratic()
    w = torch.zeros(N, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    if kind is not None:
        m32, v32 = torch.zeros(N), torch.zeros(N)  # the scratch
        stores = make_store(kind, N, True), make_store(kind, N, False)
        opt.state[w] = {"step": torch.zeros(()), "exp_avg": m32, "exp_avg_sq": v32}
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            losses.append(float(0.5 * (a * (w - t) ** 2).sum()))
            w.grad = a * (w - t)
        if kind is not None:
            stores[0].decode_into(m32)
            stores[1].decode_into(v32)
        opt.step()
        if kind is not None:
            stores[0].encode_from(m32)
            stores[1].encode_from(v32)
    return w.detach(), losses


def test_adamw_with_narrow_moments_tracks_fp32():
    w_ref, ref = adamw_run(None)
    w32, _ = adamw_run("fp32")
    assert torch.equal(w32, w_ref)
    w16, l16 = adamw_run("bf16")
    # measured: bf16 within 0.2% of how far w moved, final loss within 0.2% of fp32's
    assert (w16 - w_ref).abs().max() < 0.01 * w_ref.abs().max()
    assert abs(l16[-1] - ref[-1]) < 0.01 * ref[-1]
    # measured: fp32 divides the loss by 316, int8 by 112 (its small m round to 0 and lag)
    _, l8 = adamw_run("int8")
    assert ref[-1] < ref[0] / 200 and l8[-1] < l8[0] / 50
