"""When a run saves, what it keeps, and what a stopped run says: the trainer's checkpoint policy,
over train/checkpoint.py's files.

- Before step 1, a run whose checkpoints cannot fit on --out's disk is refused in one line
  (train/space.py), from the bytes of one checkpoint computed without allocating.
- A checkpoint is due every --save-every steps and at the last step. While the latest step is
  unhealthy (a NaN/inf loss or a skipped update: its weights may be broken) a due save waits
  for the next healthy step.
- The newest checkpoint is trusted once a healthy step has followed it: until then one extra is
  kept (at most --keep + 1, as while writing), then the oldest go.
- A run stopped by a signal saves its current step first; a diverged run sets aside the
  checkpoint whose weights gave its first bad step. Either ends in one line naming where to
  resume.

The trainer hands it the engine to save and the meta.json of the moment (the run, the step, the
data position); it touches no parameter or optimizer state itself.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from fitgpt.dist import DistContext
from fitgpt.dist.nodes import node_of_rank, node_shape
from fitgpt.engine.base import Engine
from fitgpt.engine.scaler import LossScaler
from fitgpt.engine.transforms.build import adapter_layout
from fitgpt.plan.apply import workload_of
from fitgpt.plan.memory import layout_of, placement_of
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train import space
from fitgpt.train.config import RunConfig
from fitgpt.train.guard import Diverged, DivergenceGuard, Interrupted, StopRequest
from fitgpt.train.metrics import say


class CheckpointPolicy:
    """The saves of one run: due, postponed, pruned; and the line a stopped run ends with."""

    def __init__(self, run: RunConfig, ctx: DistContext, meta: Callable[[], dict]) -> None:
        self.run, self.cfg, self.ctx = run, run.train, ctx
        self.out = Path(run.train.out)
        self.meta = meta  # a checkpoint's meta.json now: the run, the trainer's step and data
        self.saved_step: int | None = None  # the step the last save wrote
        self.prune_owed = False  # the newest save kept one extra until a healthy step
        self.owed = False  # a due save waits for a healthy step

    @functools.cached_property
    def size(self) -> space.CheckpointSize:
        """Bytes of one checkpoint of this run, full and weights-only, from the model's chunk
        layout (the engine's own, computed without allocating)."""
        e = self.run.engine
        layout = layout_of(self.run.model)
        if self.run.adapter.active:  # an adapter run saves its adapters alone
            layout = adapter_layout(self.run.model, self.run.adapter)
        meta = {
            **self.meta(),
            "layout": [c.to_dict() for c in layout],
            # what the engines' extra_state() holds: the optimizer's step and the loss scaler
            "engine_state": {
                "optimizer_step": 0,
                "scaler": LossScaler(self.run.precision).state_dict(),
            },
        }
        # who writes what is the placement's to say (Placement.replicated: rank 0 alone, or
        # each rank its shard); under TP rank 0 writes every chunk whole (engine/transforms/tp_state.py)
        sharded = False
        if e.engine == "zero" and e.tensor_parallel == 1:
            work = workload_of(self.run, self.ctx.world, self.ctx.device.type)
            sharded = not placement_of(work, e, layout).replicated
        meta_bytes = len(json.dumps(meta, indent=1))
        return space.checkpoint_size(layout, self.ctx.world, sharded, meta_bytes)

    def preflight(self, step: int) -> None:
        """Before step 1: refuse, in one line with the options, a run whose checkpoints cannot
        fit on --out's disk (from `step`, a resumed run's). Calling it twice is harmless."""
        if not self.cfg.save:
            return
        space.check_room(
            self.out,
            self.size,
            self.cfg.save_optimizer == "full",
            existing=len(ckpt_io.step_dirs(self.out)),
            saves=space.saves_in_run(step, self.cfg.steps, self.cfg.save_every),
            keep=self.cfg.keep,
        )

    def save(self, step: int, engine: Engine) -> Path:
        optimizer = self.cfg.save_optimizer == "full"
        t0 = time.perf_counter()
        path = ckpt_io.save(
            self.out,
            step,
            engine,
            self.meta(),
            self.ctx,
            self.cfg.keep + 1,  # the extra one goes after the next healthy step (prune)
            optimizer=optimizer,
            explain=space.explain_failure(self.out, self.size, optimizer),
            node_local=self.cfg.node_local_checkpoints,
        )
        self.saved_step, self.prune_owed = step, True
        size = self.size.of(optimizer) / 1e9
        what = "" if optimizer else "weights only, "
        say(self.ctx, f"saved {path} ({what}{size:.1f} GB in {time.perf_counter() - t0:.1f} s)")
        return path

    def after_step(self, step: int, guard: DivergenceGuard, engine: Engine) -> None:
        """Save the step just taken if a save is due or owed, unless it is unhealthy (its
        weights may be broken): the save then waits for a healthy step."""
        c = self.cfg
        due = (c.save_every and step % c.save_every == 0) or step == c.steps
        if not (c.save and (self.owed or due)):
            self.owed = False
        elif guard.healthy:
            self.save(step, engine)
            self.owed = False
        else:
            if not self.owed:
                say(self.ctx, f"step {step}: checkpoint postponed, {guard.why()}")
            self.owed = True

    def prune(self) -> None:
        """Checkpoints beyond --keep go once a healthy step has shown the newest one's weights
        to be good (save() keeps one extra until then: at most keep + 1, as while writing)."""
        leader = ckpt_io.leads_folder(self.ctx, self.cfg.node_local_checkpoints)
        if self.prune_owed and leader:  # node-local: every machine prunes its own --out
            ckpt_io.prune(self.out, self.cfg.keep)
        self.prune_owed = False

    def finish(self, step: int, guard: DivergenceGuard) -> None:
        """The end of the run's steps: prune, and say so if the last save never came."""
        self.prune()
        if self.owed:
            say(self.ctx, self.resume_hint(f"step {step} was not saved: {guard.why()}"))

    def newest(self) -> Path | None:
        found = ckpt_io.step_dirs(self.out)
        return found[-1] if found else None

    def resume_hint(self, what: str) -> str:
        last = self.newest()
        if last is None:
            return f"{what}; no checkpoint was written, so a new run starts from step 0"
        return f"{what}; the last checkpoint is {last}: resume with fitgpt train --out {self.out} --resume"

    def stop(self, stop: StopRequest, step: int, guard: DivergenceGuard, engine: Engine) -> None:
        """SIGINT/SIGTERM: save the current step (unless saving is off or the step unhealthy),
        then end with the resume command in one line."""
        what = f"stopped by {stop.name or 'a signal to another rank'} at step {step}"
        if self.cfg.save and self.saved_step != step and guard.healthy:
            self.save(
                step, engine
            )  # a failure here ends in SaveFailed's own line, naming the last one
        self.prune()
        if self.saved_step == step:
            raise Interrupted(
                f"{what}; saved {self.out / f'step_{step:08d}'}: resume with "
                f"fitgpt train --out {self.out} --resume"
            )
        reason = "--no-save" if not self.cfg.save else guard.why()
        raise Interrupted(self.resume_hint(f"{what}, not saved ({reason})"))

    def diverged(self, guard: DivergenceGuard, lr: float, step: int) -> None:
        """Stop a diverged run in one line, on every rank at once (rank 0's line). The checkpoint
        saved just before the first unhealthy step holds the weights that produced it: each
        folder's leader sets it aside (set_aside), never to be resumed."""
        what = (
            f"training diverged: {guard.streak} steps in a row (steps {guard.first_bad}-"
            f"{step}) had a NaN/inf loss or a skipped update (latest loss {guard.last_loss})"
        )
        # the checkpoint whose weights gave the first unhealthy step, if the streak had one
        first = guard.first_unhealthy
        suspect = None if first is None else self.out / f"step_{first - 1:08d}"
        outcomes = self.set_aside(suspect)
        if self.ctx.is_main:
            failed = sorted((node, why) for node, _, why in outcomes if why)
            moved = ""
            if failed:
                where = ", ".join(f"node {n}: {why}" for n, why in failed)
                moved = (
                    f"; {suspect.name}, whose weights gave the first bad step, could not be set "
                    f"aside ({where}): delete it there, never resume from it"
                )
            elif any(m for _, m, _ in outcomes):
                aside = self.out / f"diverged.{suspect.name}"
                each = " on every machine, in its own --out" if self.nodes > 1 else ""
                moved = (
                    f"; {suspect.name}, whose weights gave the first bad step, is now {aside}{each}"
                )
            # the suspect is no good one, even where it could not be moved
            kept = [p for p in ckpt_io.step_dirs(self.out) if p != suspect]
            last = kept[-1] if kept else None
            good = (
                f"; the last good checkpoint is {last}" if last else "; no good checkpoint exists"
            )
            line = (
                f"{what}; nothing was saved from them{moved}{good}; "
                f"{guard.advice(lr, self.cfg.lr, self.cfg.warmup)}, "
                "or pass --max-bad-steps 0 to train on"
            )
        else:
            line = f"{what}; rank 0 names the last good checkpoint"
        stop = Diverged(line)
        # every rank stops here together: rank 0 prints, the others wait for its line (a rank
        # that exited first would let torchrun end rank 0 before it spoke)
        stop.agreed = stop.identical = self.ctx.distributed
        raise stop

    @property
    def nodes(self) -> int:
        """The machines whose own --out holds a copy of each checkpoint (1 unless node-local)."""
        return node_shape(self.ctx.world)[1] if self.cfg.node_local_checkpoints else 1

    def set_aside(self, suspect: Path | None) -> list[tuple[int, bool, str | None]]:
        """Rename `suspect` to diverged.<name> in every folder that holds it: rank 0's --out, or
        with node-local checkpoints every machine's own, so that every machine's newest
        checkpoint stays the same step with the same meta.json (a --resume on all of them picks
        the same one). Returns every rank's (node, moved, why it failed), gathered: a few bytes,
        one all_gather_object, once per run."""
        moved, why = False, None
        leader = ckpt_io.leads_folder(self.ctx, self.cfg.node_local_checkpoints)
        if suspect is not None and leader and (suspect / "meta.json").is_file():
            aside = suspect.with_name(f"diverged.{suspect.name}")
            try:
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(suspect, aside)
                moved = True
            except OSError as e:
                why = f"{e.strerror or e} ({e.filename or suspect})"
        mine = (node_of_rank(), moved, why)
        if not self.ctx.distributed:
            return [mine]
        every: list = [None] * self.ctx.world
        dist.all_gather_object(every, mine, group=self.ctx.group)
        return every
