"""Which tensors a long-sequence Llama step holds at its peak, on the CPU, against the memory model.

Why: on an H100 (2026-11-27, torch 2.11) Llama-3.1-8B's shape at 131,072 and 247,808 tokens,
eager, checkpointing cpu, peaked ~14.6 S·h·2 bytes above its state where plan/memory.py priced
~26 (activations + block_backward + logits). This runs fitgpt's own pieces at a small width and
long T, with the engine's structure: every block checkpointed with its input kept off the
device (engine/transforms/activation.py's hooks, the host copy left out of the count: pinned RAM on
a GPU run) and the previous block's input brought back ahead of need, the MLP in pieces
(model/pieces.py), the loss in pieces of rows (model/loss.py), bf16 weights whose gradients
land in preallocated buffers (the chunk engine's), one forward + backward.

How it counts: a TorchDispatchMode sees every tensor an ATen op returns and keeps a weak
reference to its storage; the live bytes are summed after every op, so the peak is exact for
tensors (what a caching allocator's max_memory_allocated counts, less the workspaces a kernel
allocates and frees inside itself: on a GPU the flash kernel's, priced apart by
memory.attention_bytes). At the peak it prints what is alive, by the op that made it, in units
of u = T·H·w bytes (one [T, H] tensor), and the model's terms for the same shape.

    PYTHONPATH=. .venv/bin/python benchmarks/memory/long_activation_memory_cpu.py --T 8192 16384
Measured (2 CPU cores, torch 2.13 CPU, 2026-11-27; hidden 256, 4 heads of 64, 1 kv head, F 896,
V 8192, 3 layers, bf16, checkpointing cpu, MLP pieces of 2048 tokens, loss pieces of 1024 rows;
u = T·H·2): at attention's backward 11.29 u alive at both T = 8,192 and 16,384: the two block
inputs (2), the norm's output (1), q and k rotated (1.25), the kv output (0.5), attention's
output and statistics (1.03), the stream's and the output's gradients (1 + 1), dq, dk, dv (1.5),
one more copy (1), the rotary tables (1 at this width; 0.125 u at Llama-3.1-8B's). Less the
tables, plus the H100's flash workspace (4 u), 14.4 u: the H100 measured 14.6 above the state.
The step's backward peak (the MLP piece's) 17.0 / 14.4 u, its piece 5.25 / 2.6 u.

    options: --n-embd 256 --heads 4 --kv 1 --ffn 896 --vocab 8192 --layers 3
             --mlp-piece 2048 (tokens) --loss-piece 1024 (rows) --ckpt cpu|full
"""

from __future__ import annotations

import argparse
import collections
import json
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import fitgpt.engine.transforms.activation as act_mod
import fitgpt.model.loss as loss_mod
import fitgpt.model.pieces as pieces_mod
from fitgpt.engine.transforms.activation import HostActivations, _Stash
from fitgpt.model import ModelConfig, build_model
from fitgpt.plan.memory import Workload, activation_bytes


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes alive in storages made by ops while on, and what was alive then."""

    def __init__(self, before: list[torch.Tensor]) -> None:
        super().__init__()
        # storages made before the step (weights, gradient buffers, tokens): views of them are
        # not new bytes
        self.old = {t.untyped_storage().data_ptr() for t in before}
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.peak, self.at, self.phase = 0, "", "forward"
        self.snapshot: dict[str, int] = {}
        self.watch: dict[str, tuple[int, dict[str, int]]] = {}  # op -> (live after it, what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = f"{self.phase}:{func.overloadpacket.__name__}"
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st.data_ptr() in self.old:
                    continue
                old = self.live.get(st.data_ptr())
                if old is None or old[0].expired():
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes(), name)
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        now = sum(n for _, n, _ in self.live.values())
        watched = "attention" in name and name.endswith("backward")
        if now > self.peak or (watched and now > self.watch.get(name, (0,))[0]):
            snap: dict[str, int] = collections.Counter()
            for _, n, who in self.live.values():
                snap[who] += n
            if now > self.peak:
                self.peak, self.at, self.snapshot = now, name, dict(snap)
            if watched and now > self.watch.get(name, (0,))[0]:
                self.watch[name] = (now, dict(snap))
        return out


class FusedRMSNorm(torch.autograd.Function):
    """A CUDA run's RMSNorm: one kernel each way, saving the input and the per-token rstd and
    returning only y (forward) and dx, dw (backward); the CPU's decomposed norm instead keeps
    fp32 intermediates that no GPU run has. The arithmetic runs outside the count (a kernel's
    registers), its outputs inside it."""

    @staticmethod
    def forward(ctx, x, w, eps):
        y = torch.empty_like(x)
        with _disable_current_modes():
            xf = x.float()
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y.copy_(xf * r * w.float())
        rstd = torch.empty(r.shape, dtype=torch.float32)
        with _disable_current_modes():
            rstd.copy_(r)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        with _disable_current_modes():
            xf, gf, wf = x.float(), g.float(), w.float()
            xh = xf * rstd
            gw = gf * wf
            dx.copy_(rstd * (gw - xh * (gw * xh).mean(-1, keepdim=True)))
            dw.copy_((gf * xh).reshape(-1, x.shape[-1]).sum(0))
        return dx, dw, None


def fused_rms_norm(self, x):
    return FusedRMSNorm.apply(x, self.weight, self.eps or torch.finfo(x.dtype).eps)


class OffDevice(HostActivations):
    """engine/transforms/activation.py's hooks with the "host" copy made outside the count (on a GPU
    run it lives in pinned host RAM) and the way back (the block's input, the prefetched previous
    one) made inside it, as on the GPU."""

    def pack(self, t):
        if not t.requires_grad:
            return t
        with _disable_current_modes():
            host = t.detach().clone()
        stash = _Stash(t.device, host, None, self._last)
        self._last = weakref.ref(stash)
        return stash

    def _bring_back(self, s):
        if s.back is not None:
            x, s.back = s.back, None
            return x
        return s.host.clone()

    def _prefetch(self, s):
        s.back = s.host.clone()


def cfg_of(a, T: int) -> ModelConfig:
    return ModelConfig(
        family="llama",
        position="rope",
        bias=False,
        tie_embeddings=False,
        n_layer=a.layers,
        n_embd=a.n_embd,
        n_head=a.heads,
        n_kv_head=a.kv,
        ffn_hidden=a.ffn,
        seq_len=T,
        vocab_size=a.vocab,
    )


def measure(a, T: int) -> dict:
    cfg = cfg_of(a, T)
    if a.norm == "fused":
        torch.nn.RMSNorm.forward = fused_rms_norm
    H, F, V = cfg.n_embd, cfg.ffn_width, cfg.padded_vocab_size
    pieces_mod.MLP_PIECE_ELEMS = a.mlp_piece * F  # pieces of a.mlp_piece tokens (batch 1)
    loss_mod.PIECE_LOGITS = a.loss_piece * V  # pieces of a.loss_piece rows
    if a.ckpt == "cpu":
        act_mod.HostActivations = OffDevice  # checkpoint_blocks makes one per model
    torch.manual_seed(0)
    model = build_model(cfg)
    model.reset_parameters(0)
    model.to(torch.bfloat16).train()
    for p in model.parameters():  # the chunk engine's gradient buffers: state, not counted
        p.grad = torch.zeros_like(p)
    act_mod.checkpoint_blocks(model, to_host=a.ckpt == "cpu")
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=g)
    before = [idx] + [t for p in model.parameters() for t in (p, p.grad)]
    mode = LiveBytes(before)
    with mode:
        loss = model(idx[:, :-1], idx[:, 1:])
        fwd_peak, fwd_at, fwd_snap = mode.peak, mode.at, mode.snapshot
        mode.phase, mode.peak = "backward", 0
        loss.backward()
    u = T * H * 2
    w = Workload(cfg, 1, precision="bf16", device="cuda")
    model_terms = activation_bytes(w, "cpu" if a.ckpt == "cpu" else "full")
    top = sorted(mode.snapshot.items(), key=lambda kv: -kv[1])
    ftop = sorted(fwd_snap.items(), key=lambda kv: -kv[1])
    return dict(
        T=T,
        u_bytes=u,
        fwd_peak_u=fwd_peak / u,
        fwd_at=fwd_at,
        at_fwd_peak_u={k: round(v / u, 3) for k, v in ftop},
        bwd_peak_u=mode.peak / u,
        bwd_at=mode.at,
        at_bwd_peak_u={k: round(v / u, 3) for k, v in top},
        at_attention_backward={
            op: (round(n / u, 3), {k: round(v / u, 3) for k, v in sorted(snap.items())})
            for op, (n, snap) in mode.watch.items()
        },
        model_u={k: round(v / u, 3) for k, v in model_terms.items()},
        mlp_piece_u=6 * F * a.mlp_piece * 2 / u,
        loss_piece_u=(a.loss_piece * V * 6 + V * H * 2 + u) / u,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv", type=int, default=1)
    p.add_argument("--ffn", type=int, default=896)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--mlp-piece", type=int, default=2048)
    p.add_argument("--loss-piece", type=int, default=1024)
    p.add_argument("--ckpt", default="cpu", choices=("cpu", "full"))
    p.add_argument("--norm", default="fused", choices=("fused", "cpu"))
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(2)
    rows = []
    for T in a.T:
        r = measure(a, T)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
