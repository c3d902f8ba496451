"""The tiered update: one AdamW step per chunk, run where the chunk's optimizer state lives.

Per step, after the gradients are reduced and the global norm is known (grad_mul folds the clip
coefficient and 1/loss-scale into the gradient):
  1. host-homed chunks first, in forward order (HostOptimizer, engine/chunked/offload.py): each
     chunk's reduced gradient is copied device→host on a side stream, the worker thread steps the
     fp32 state in host RAM (or read in from the disk tier) and copies the new weights back. Their
     copies and host AdamW start at once and run while the GPU does step 2;
  2. device-homed chunks: the reduced gradient upcast to a transient fp32 copy (4 bytes per
     element of one chunk), torch's fused AdamW over the fp32 master and moments, the master cast
     back into the working-dtype weights (or this rank's shard of them); a compiled run
     (`--compile on`) does the same in one compiled pass per param group instead (one_pass: no
     fp32 copy, 28 bytes moved per element against 40); a chunk in compact formats is stepped
     piece by piece through the device's fp32 scratch (no whole-chunk copy;
     engine/formats/compact.py);
  3. stages 1-2 on several ranks (weights replicated, state sharded): every chunk's updated shard
     is all-gathered into the full weights, (W-1)/W·N elements received per rank; the host-homed
     chunks' gathers wait for the host first. Stage 3 gathers only the embedding and head (the
     blocks are gathered before use, engine/chunked/fetch.py).
The next forward waits for a host-homed block's new weights just before the block runs (a
forward pre-hook: `register_host_waits`), so the host's work overlaps the forward of the blocks
before it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from fitgpt.engine.chunked.chunk import Chunk
from fitgpt.engine.chunked.offload import HostOptimizer
from fitgpt.engine.comm import Peers
from fitgpt.engine.formats.compact import Scratch
from fitgpt.engine.transforms.compile import compile_errors, error_line
from fitgpt.errors import UserError


class TieredUpdate:
    def __init__(
        self,
        chunks: list[Chunk],
        host_opt: HostOptimizer | None,
        peers: Peers,
        scratch: Scratch | None = None,
        speculative: bool = False,
        one_pass: bool = False,
        warn: Callable[[str], None] = print,
    ) -> None:
        """scratch: the compact formats' pieces on the compute device (engine/formats/compact.py);
        speculative: start host-homed chunks' updates during the backward (module doc);
        one_pass: step plain fp32 device state through the compiled pass (_adamw_pass); if
        that fails to compile, `warn` gets one line and the fused kernel takes over."""
        self.chunks, self.host_opt, self.peers = chunks, host_opt, peers
        self.one_pass, self.warn = one_pass, warn
        self.scratch = scratch
        self.hosted = [c for c in chunks if c.offloaded]
        # the host-homed chunks of stages 1-2 on several ranks: weights replicated, state
        # sharded (on one rank the shard is the weights: nothing to gather)
        self.regather = [c for c in self.hosted if c.gathers_updated and c.peers.world > 1]
        self.speculative = speculative and host_opt is not None
        self.lr, self.spec_mul = 0.0, None  # this step's, from begin_step
        self.guess = 1.0  # this step's grad_mul if it is neither clipped nor skipped
        # guess only after a step that was neither clipped nor skipped, and never at the first:
        # a heavy clip, where an undone step is least exact, rarely follows a clean step
        # (engine/formats/speculate.py). Saved with checkpoints, so a resumed run guesses as before.
        self.cautious = True
        self.last_clean = False
        self.speculated: set[int] = set()  # chunks whose update started on the guess, this step
        self.rollbacks = 0  # steps whose guess was wrong (run total)
        self.speculated_steps = 0  # steps that started updates on the guess (run total)

    def register_host_waits(self, modules: list[nn.Module], blocks: list[Chunk]) -> list:
        """The next forward waits for a host-homed block's new weights just before the block
        (register before the weight-fetch hooks, so a stage-3 gather sees updated shards)."""

        def hook(c: Chunk) -> None:  # returns None: a pre-hook's result replaces the input
            self.host_opt.wait(c)

        return [
            module.register_forward_pre_hook(lambda _m, _a, c=c: hook(c))
            for module, c in zip(modules, blocks)
            if c.offloaded
        ]

    def begin_step(self, lr: float, scale: float) -> None:
        """Before the step's backward: its learning rate, and whether host-homed chunks start
        their updates during the backward, guessing grad_mul = 1/scale (no clip, no overflow)."""
        self.lr, self.guess = lr, 1.0 / scale
        go = self.speculative and (self.last_clean or not self.cautious)
        self.spec_mul = self.guess if go else None

    def on_final(self, c: Chunk) -> None:
        """Chunk c's reduced gradient is final (engine/chunked/reduce.py, during the backward)."""
        if self.spec_mul is None or not c.offloaded:
            return
        self.host_opt.submit(c, self.lr, self.spec_mul, c.home_weights, guarded=True)
        self.speculated.add(c.spec.index)

    def step(self, lr: float, grad_mul: float | None) -> None:
        """Update every chunk from its reduced gradient times grad_mul (see the module doc);
        grad_mul None: an overflow, no chunk steps (speculative updates are undone)."""
        gathers, undone = [], []
        self.last_clean = grad_mul == self.guess
        if self.host_opt is not None:
            undone = self._settle(lr, grad_mul)
            for c in self.hosted:
                if c.spec.index in self.speculated or grad_mul is None:
                    continue
                self.host_opt.submit(c, lr, grad_mul, c.home_weights)
            self.speculated = set()
            self.host_opt.flush()  # every gradient staged before they are zeroed
        if grad_mul is None:
            if self.regather:
                # an undone shard comes back within ulps of the old one, cast to the working
                # dtype it may differ in the last bit: the other ranks get this rank's copy
                for c in undone:
                    self.host_opt.wait(c)
                    gathers.append(self._gather_updated(c))
                self.peers.wait_all(gathers)
            return
        gathers += self._step_device_chunks(lr, grad_mul)
        if self.regather:
            # the other ranks need this rank's updated shard: wait for the host, then gather
            for c in self.regather:
                self.host_opt.wait(c)
                gathers.append(self._gather_updated(c))
        self.peers.wait_all(gathers)

    @property
    def sync_free(self) -> bool:
        """Whether step_on_device can run this plan: every chunk's state on the device in plain
        fp32 (no host tier, which takes grad_mul as a host float, and no compact formats)."""
        return self.host_opt is None and all(c.compact is None for c in self.chunks)

    def step_on_device(self, lr: float, grad_mul: Tensor, skip: Tensor) -> None:
        """step() without waiting for the global norm on the host: grad_mul arrives as a
        one-element fp32 device tensor (bit-identical to step()'s host float, _device_step), and
        skip = 1.0 for an overflow, which torch's fused AdamW kernel reads to leave every tensor
        as it was (the step counts taken back). The GPU runs the update straight after the
        backward; with step() it idles while the host reads the norm and launches the update
        (4.0 ms of a 118 ms step at GPT-2 124 M on an H100:
        benchmarks/results/small_step_h100_2026-11-23)."""
        self.peers.wait_all(self._step_device_chunks(lr, grad_mul, skip))

    def _step_device_chunks(
        self, lr: float, grad_mul: float | Tensor, skip: Tensor | None = None
    ) -> list[tuple[object, str]]:
        """Every device-homed chunk stepped (_device_step); returns the all-gathers of updated
        shards started at stages 1-2 (stage 3 gathers only the embedding and head here)."""
        gathers = []
        for c in self.chunks:
            if c.offloaded:
                continue
            self._device_step(c, lr, grad_mul, skip)
            if c.gathers_updated:
                gathers.append(self._gather_updated(c))
        return gathers

    def _settle(self, lr: float, grad_mul: float | None) -> list[Chunk]:
        """The guess checked: when it was right the speculative updates stand, bit-identical to
        the exact path; when not (clipped, or an overflow), each is undone and redone with the
        true grad_mul once it has landed (engine/formats/speculate.py). Returns the chunks
        undone."""
        if not self.speculated:
            return []
        self.speculated_steps += 1
        if grad_mul == self.spec_mul:
            return []
        self.rollbacks += 1
        undone = []
        for c in [c for c in self.hosted if c.spec.index in self.speculated]:
            # its speculative update landed before the redo reads the weights; one that found
            # a non-finite gradient took no step, so there is nothing to undo
            stepped = self.host_opt.wait(c)
            if stepped or grad_mul is not None:
                undo_mul = self.spec_mul if stepped else None
                self.host_opt.submit(c, lr, grad_mul, c.home_weights, undo_mul=undo_mul)
            if stepped:
                undone.append(c)
        return undone

    def _device_step(
        self, c: Chunk, lr: float, grad_mul: float | Tensor, skip: Tensor | None = None
    ) -> None:
        """grad_mul: the host's float (step), or a one-element fp32 device tensor with skip
        (step_on_device; plain fp32 state only)."""
        if c.compact is not None:
            # piece by piece through the device scratch: no whole-chunk fp32 gradient
            c.compact.step(c.home_weights, c.opt_grad, grad_mul, lr, self.scratch)
            return
        opt = c.optimizer
        groups = list(zip(opt.param_groups, c.group_ranges))
        done = 0  # param groups stepped by the compiled pass
        if self.one_pass and not c.master_aliases_weight:
            done = self._one_pass_step(c, lr, grad_mul, skip)
            if done == len(groups):
                return
        if isinstance(grad_mul, Tensor):
            # the fp32 copy and the multiply in one pass: grad_mul's one dimension makes the
            # product fp32 (a 0-d operand would leave it in the gradient's dtype); each element
            # is rounded once, as the copy-then-multiply below rounds it
            g32 = torch.mul(c.opt_grad, grad_mul)
        else:
            g32 = c.opt_grad.float()  # transient fp32 copy of one chunk's gradient
            if grad_mul != 1.0:
                g32.mul_(grad_mul)
        for group, (lo, hi) in groups[done:]:
            group["lr"] = lr  # kept current: the optimizer's state_dict carries it
            _fused_adamw(opt, group, g32[lo:hi], lr, found_inf=skip)
        del g32  # freed here
        if not c.master_aliases_weight:
            c.home_weights.copy_(c.master)

    def _one_pass_step(
        self, c: Chunk, lr: float, grad_mul: float | Tensor, skip: Tensor | None
    ) -> int:
        """Chunk c's AdamW through the compiled pass, each param group's flat range at once;
        returns the groups stepped: all of them, or the ones before the group whose pass failed
        to compile (after one warning line; the caller steps the rest through torch's kernel).
        Replicated state (stage 0 on several ranks, each rank stepping its own copy) must take
        one path on every rank, or the copies would round apart: there a failure is an error."""
        weights = c.home_weights
        opt = c.optimizer
        for i, (group, (lo, hi)) in enumerate(zip(opt.param_groups, c.group_ranges)):
            group["lr"] = lr  # kept current: the optimizer's state_dict carries it
            state = opt.state[group["params"][0]]
            state["step"].add_(1)
            try:
                _adamw_pass()(
                    weights[lo:hi], group["params"][0], state["exp_avg"], state["exp_avg_sq"],
                    c.opt_grad[lo:hi], grad_mul, 0.0 if skip is None else skip, state["step"],
                    lr, group["betas"][0], group["betas"][1], group["eps"],
                    group["weight_decay"],
                )  # fmt: skip
            except compile_errors() as e:
                # raised at the call that compiles, before its kernel ran: of this group only
                # the step count was written, taken back here
                state["step"].sub_(1)
                why = f"the optimizer's compiled pass failed to compile ({error_line(e)})"
                if not c.shard_opt and c.peers.world > 1:
                    raise UserError(f"{why}; every rank steps its own copy of the state, so "
                                    "all must take one path: run with --compile off") from None  # fmt: skip
                self.one_pass = False
                self.warn(f"{why}; torch's fused AdamW steps the device state instead")
                return i
            if skip is not None:
                state["step"].sub_(skip)  # no step where skip is 1.0, as torch's kernel
        return len(opt.param_groups)

    def _gather_updated(self, c: Chunk) -> tuple[object, str]:
        work = c.peers.all_gather(c.weight, c.weight_shard)
        return work, f"all-gather updated weights of {c.spec.name}"

    def sync(self) -> None:
        """Wait for every pending host update (before eval, checkpoints and generation: they see
        the newest weights)."""
        if self.host_opt is not None:
            self.host_opt.drain(self.hosted)


def _fused_adamw(
    opt: torch.optim.AdamW,
    group: dict,
    grad: Tensor,
    lr: float,
    found_inf: Tensor | None = None,
) -> None:
    """What `opt.step()` runs for one group of one flat parameter with fused=True (its step
    count +1, then torch's fused kernel, the same operands: bit-identical), without the
    optimizer's Python around it (grouping by device and dtype, state checks, hooks), paid per
    chunk and param group (after the norm's host sync, while the GPU waits). Measured at GPT-2
    124 M on an H100: the update phase 2.4-2.5 ms against 2.8-3.0 ms
    (benchmarks/results/ab_small_h100_2026-11-23). found_inf as the optimizer passes it under a
    GradScaler: no step where it is 1.0, and the step count taken back, as torch does."""
    param = group["params"][0]
    state = opt.state[param]
    state["step"].add_(1)
    torch._fused_adamw_(
        [param], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]],
        amsgrad=False, lr=lr, beta1=group["betas"][0], beta2=group["betas"][1],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        found_inf=found_inf,
    )  # fmt: skip
    if found_inf is not None:
        state["step"].sub_(found_inf)


def _adamw_math(w, master, m, v, g, grad_mul, skip, step, lr, beta1, beta2, eps, wd) -> None:
    """torch's AdamW (decoupled weight decay, bias corrections from the step count) over one
    param group's flat views, in one pass: the working-dtype gradient read and scaled in fp32,
    the fp32 master and moments updated in place, the new weights written in the working dtype.
    28 bytes move per element (gradient 2, master and moments read and written 24, weights 2)
    where the fused kernel's path moves 40 (the fp32 gradient copy written and read again, the
    master read again by the cast back): at the 2.7b preset on an H100 the update phase fell
    from 47.4 to 27.7 ms per step (results/ab_speed2_h100_2026-11-24/built). skip 1.0 (an overflow)
    leaves every tensor as it was."""
    g32 = g.float() * grad_mul
    m_new = torch.lerp(m, g32, 1 - beta1)
    v_new = v * beta2 + (1 - beta2) * g32 * g32
    denom = v_new.sqrt() / (1 - beta2**step).sqrt() + eps
    p = master * (1 - lr * wd) - (lr / (1 - beta1**step)) * m_new / denom
    keep = torch.as_tensor(skip, device=g.device) > 0
    p = torch.where(keep, master, p)
    m.copy_(torch.where(keep, m, m_new))
    v.copy_(torch.where(keep, v, v_new))
    master.copy_(p)
    w.copy_(p.to(w.dtype))


@functools.cache
def _adamw_pass():
    """_adamw_math compiled once for every chunk size (dynamic shapes; the floats stay symbolic,
    so a moving learning rate recompiles nothing), on first use."""
    return torch.compile(_adamw_math, dynamic=True, fullgraph=True)
