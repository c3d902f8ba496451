"""The training loop: setup → fit → (evaluate, checkpoint) → summary.

It reaches parameters, gradients and optimizer state only through the engine: swapping the plain
engine for the sharded or tiered one changes nothing here. When to save and what to keep is the
run's CheckpointPolicy (train/checkpoint_policy.py); what each logged step records, its
StepMetrics (train/metrics.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from fitgpt import units
from fitgpt.adapters.peft import read_peft_weights
from fitgpt.data.config import open_data
from fitgpt.data.source import BatchLoader
from fitgpt.dist.env import thread_tuner
from fitgpt.engine.base import Engine, StepStats
from fitgpt.engine.comm import CollectiveError
from fitgpt.engine.factory import build_engine
from fitgpt.engine.state_io import NamedWeights
from fitgpt.plan.memory import tokens_per_step
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.assemble import Run
from fitgpt.train.checkpoint_policy import CheckpointPolicy
from fitgpt.train.guard import DivergenceGuard, Interrupted, StopRequest
from fitgpt.train.init_from import InitSource, check_same_architecture, load_source
from fitgpt.train.metrics import MetricsLog, StepMetrics, say
from fitgpt.train.profile import StepProfiler
from fitgpt.train.resume import changed_settings, run_record, saved_run
from fitgpt.train.rundir import close_run_dir, open_run_dir, write_run_files
from fitgpt.train.schedule import lr_at
from fitgpt.train.setup import OutOfMemory, gpu_held, is_oom, oom_message, phase_of


class Trainer:
    """One run: its data, its engine and its schedule, stepped by fit()."""

    def __init__(self, assembled: Run, check_room: bool = False) -> None:
        """`assembled`: the run (train/assemble.py), taken as given. `check_room`: refuse a run
        whose checkpoints cannot fit its disk before the engine allocates anything (a resumed
        run is checked after its resume, in fit())."""
        run, ctx = assembled.config, assembled.ctx
        self.schedule_line = assembled.schedule_line  # said at step 0 (train/assemble.py)
        self.run, self.ctx, self.cfg = run, ctx, run.train
        self.out = Path(self.cfg.out)
        c = self.cfg
        # the samples this run draws (Megatron's sample order is fixed for a run's length). The
        # ranks of one TP group (--tensor-parallel T) take the same micro-batches, and the C
        # ranks of a CP group (--context-parallel C) the same rows, each keeping its slice of
        # their tokens: the rows are sharded over ctx.data_world (the job's at T = C = 1)
        per_batch = c.micro_batch * ctx.data_world
        train_src, self.val_src, self.tokenizer = open_data(
            run.data,
            run.model.seq_len,
            run.model.vocab_size,
            c.seed,
            # no validation sample for a run that never validates: it opens no valid split
            num_samples=(
                c.steps * c.grad_accum * per_batch,
                c.eval_batches * per_batch if c.eval_every else 0,
            ),
        )
        if hasattr(train_src, "describe"):  # packed chat data: its rows, its long conversations
            say(ctx, train_src.describe())
        self.model_cfg = run.model
        self.loader = self._loader(train_src)
        self.step = 0
        self.skipped = 0  # fp16 steps skipped on overflow, over the whole run
        self.source: str | None = None  # --init-from
        # when to save and what to keep (train/checkpoint_policy.py)
        self.checkpoints = CheckpointPolicy(run, ctx, self.meta)
        if check_room:
            self.checkpoints.preflight(self.step)
        # dropout masks differ per data-parallel rank, as in DDP, and agree within a TP group
        # (its replicated activations must stay identical)
        torch.manual_seed(self.cfg.seed + ctx.dp_rank)
        self.engine: Engine = build_engine(
            run.model, run.engine, run.precision, run.optim, ctx, self.cfg.seed, run.adapter
        )
        self.log = MetricsLog(self.out, ctx.is_main)
        self.metrics = StepMetrics(
            self.log, ctx, self.engine, run.flops_per_token(), self.cfg.steps, self.tokens_per_step
        )
        # a CPU run keeps the faster thread count as other programs come and go (dist/threads.py)
        self.threads = thread_tuner(self.cfg.cpu_threads, ctx.device.type)

    # ---- checkpoints --------------------------------------------------------------------------
    def meta(self) -> dict:
        return {
            **saved_run(self.run, self.tokenizer, self.source),  # paths absolute, fingerprints
            "trainer": {
                "step": self.step,
                "skipped": self.skipped,
                "data": self.loader.state_dict(),
            },
        }

    def resume(self, where: Path) -> None:
        """Continue from a checkpoint, or from --out's newest; --out with none yet starts
        fresh (so a restart loop needs no first-time case)."""
        if where.absolute() == self.out.absolute() and not ckpt_io.step_dirs(self.out):
            say(self.ctx, f"--resume: {self.out} holds no checkpoint yet; starting at step 0")
            self.log.drop_after(0)
            return
        ckpt = ckpt_io.resolve(where)
        # the files present checked; then every file each rank reads, wherever it lies (a
        # node-local checkpoint: the rank's own machine's, or all of them), before any is read
        meta = ckpt_io.load_meta(ckpt, ckpt_io.ANY_NODE)
        ckpt_io.require_files(ckpt, meta, self.ctx)
        check_same_architecture(meta, self.model_cfg, ckpt)
        ckpt_io.load_state(ckpt, meta, self.engine, self.ctx)
        trainer = meta.get("trainer", {})  # an imported model may carry no trainer state
        self.step = trainer.get("step", meta["step"])
        self.skipped = trainer.get("skipped", 0)
        self.source = meta.get("init_from")  # a fine-tune's later checkpoints still name it
        if "data" in trainer:
            self.loader.load_state_dict(trainer["data"])
        self.log.drop_after(self.step)  # the steps after it are run, and logged, again
        # every setting that differs from the saved run's, the planner's choices included: the
        # one place a resume says what it changed (train/resume.py)
        ctx = self.ctx
        changes = changed_settings(meta, ckpt, self.run, ctx.world, ctx.data_world, ctx.device.type)
        changed = f"; changed {', '.join(changes)}" if changes else ""
        fresh = (
            ""
            if ckpt_io.holds_optimizer(meta)
            else "; optimizer state starts fresh: the checkpoint holds weights only"
        )
        say(ctx, f"resumed from {ckpt} at step {self.step}{changed}{fresh}")

    def init_from(self, source: InitSource) -> None:
        """Start from `source`'s weights: optimizer, step count and data position stay fresh.
        An adapter run freezes them and trains its adapters, new or --lora-from's."""
        load_source(source, self.engine, self.model_cfg, self.ctx)
        self.source = str(source.path)
        a = self.run.adapter
        if a.lora_from:  # a PEFT folder's adapters, to go on training (fitgpt/adapters/peft.py)
            tensors = read_peft_weights(Path(a.lora_from), self.model_cfg, a)
            self.engine.load_state(NamedWeights(tensors, self.engine.layout), {}, optimizer=False)
        what = "its weights"
        if a.active:
            trained = sum(c.numel for c in self.engine.layout)
            start = f"from {a.lora_from}" if a.lora_from else "fresh"
            what = f"its weights, frozen; LoRA rank {a.lora_rank} ({trained:,} trained) {start}"
        say(self.ctx, f"initialised from {source.path}: {what}; optimizer, step and data fresh")

    def base_from(self, source: InitSource) -> None:
        """A resumed adapter run's frozen base, read again from the source its checkpoint
        names (checkpoints hold the adapters alone)."""
        load_source(source, self.engine, self.model_cfg, self.ctx)
        say(self.ctx, f"the frozen base read from {source.path}")

    def _loader(self, source) -> BatchLoader:
        """This rank's rows (its data rank's), and under context parallelism its slice of them."""
        ctx = self.ctx
        cp_rank = ctx.cp.rank if ctx.cp is not None else 0
        return BatchLoader(
            source, self.cfg.micro_batch, ctx.data_rank, ctx.data_world, 0, cp_rank, ctx.cp_size
        )

    # ---- evaluation ---------------------------------------------------------------------------
    def evaluate(self) -> dict:
        loader = self._loader(self.val_src)
        # one token-weighted mean over every batch and rank, as the training loss
        loss = self.engine.eval_loss([loader.next() for _ in range(self.cfg.eval_batches)])
        return {
            "kind": "eval",
            "step": self.step,
            "val_loss": loss,
            "val_ppl": float(torch.tensor(loss).exp()),
        }

    # ---- the loop -----------------------------------------------------------------------------
    def _guarded_step(self, micro, lr):
        """engine.train_step, with a backend failure inside it (DDP's own all-reduce, say) turned
        into a CollectiveError that names this rank instead of a bare backend traceback."""
        try:
            return self.engine.train_step(micro, lr)
        except CollectiveError:
            raise
        except RuntimeError as e:
            if not self.ctx.distributed or not _is_backend_error(e):
                raise
            raise CollectiveError(
                f"rank {self.ctx.rank}: a collective inside step {self.step + 1} failed "
                f"({str(e).strip().splitlines()[0][:200]}); another rank died or hangs"
            ) from e

    def _maybe_inject_fault(self) -> None:
        """FITGPT_FAULT=RANK:STEP:die|hang|error makes one rank fail at a step: the
        failure-handling tests use it to check that the job ends with the rank named. A hung rank
        stops for twice --dist-timeout (the others time out meanwhile), then dies: a truly stuck
        one would outlive torchrun's SIGTERM (a stop request it cannot act on) by 30 s. "error"
        raises, as a bug on one rank would, while the others wait in the step's collectives."""
        spec = os.environ.get("FITGPT_FAULT")
        if not spec:
            return
        rank, step, kind = spec.split(":")
        if int(rank) == self.ctx.rank and int(step) == self.step:
            if kind == "error":
                raise RuntimeError(f"injected fault (FITGPT_FAULT={spec})")
            if kind == "hang":
                time.sleep(2 * self.cfg.dist_timeout)
            os._exit(17)

    def step_once(self, micro: list | None = None) -> tuple[StepStats, float, float]:
        """One optimizer step on `micro` (default: the next micro-batches of the run's data):
        (its stats, its seconds, its lr). The seconds count the reading of the run's own data (a
        user's tokens/s is paid with it; nanoGPT's and torchtitan's step times count theirs); the
        benchmark harness passes batches every system of a sweep shares, read beforehand."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        t0 = time.perf_counter()
        if micro is None:
            micro = [self.loader.next() for _ in range(cfg.grad_accum)]
        self._maybe_inject_fault()
        stats = self._guarded_step(micro, lr)  # ends in a host sync: the timing is real
        dt = time.perf_counter() - t0
        self.step += 1
        return stats, dt, lr

    def fit(self) -> dict:
        cfg, ctx = self.cfg, self.ctx
        self.checkpoints.preflight(self.step)
        if self.step == 0 and self.schedule_line:  # a resumed run took its saved config's
            say(ctx, self.schedule_line)
        compiled = ""
        if self.engine.compiled is not None:
            whole = self.engine.compiled.report()["scope"] == "model"
            compiled = " (compiled: the whole model)" if whole else " (compiled blocks and head)"
        layout = [f"tensor-parallel {ctx.tp}"] if ctx.tp > 1 else []
        layout += [f"context-parallel {ctx.cp_size}"] if ctx.cp_size > 1 else []
        tp_note = f" ({' × '.join([*layout, f'data-parallel {ctx.data_world}'])})" if layout else ""
        say(
            ctx,
            f"model {units.params(self.model_cfg.num_params())} parameters, engine "
            f"{self.run.engine.engine}{compiled}, {ctx.world} rank(s){tp_note} on {ctx.device}, "
            f"{self.tokens_per_step:,} tokens per step, {torch.get_num_threads()} CPU threads "
            "per rank",
        )
        placement = self.engine.describe()["placement"]
        if placement:
            say(ctx, f"placement: {placement}")
        fp16 = self.run.precision.precision == "fp16"
        self.guard = DivergenceGuard(cfg.max_bad_steps, dynamic_scale=fp16)
        self.window, losses, history = [], [], []
        self.t_start = time.perf_counter()
        prof = StepProfiler(
            cfg.profile if ctx.is_main else 0, self.step, cfg.steps, Path(cfg.out), ctx.device
        )
        with StopRequest() as stop:
            try:
                while self.step < cfg.steps:
                    prof.before(self.step)
                    stats, dt, lr = self.step_once()
                    written = prof.after(self.step - 1, dt)
                    switched = self.threads.after_step(dt)
                    if switched:
                        say(ctx, switched)
                    if not losses:  # this process's first step compiled forward and backward
                        self.metrics.compiled(self.step)
                    self.window.append(dt)
                    losses.append(stats.loss)
                    history += self._after_step(stats, lr)
                    if written is not None:
                        say(ctx, written)
                    if stop.requested(ctx):
                        self.checkpoints.stop(stop, self.step, self.guard, self.engine)
            except KeyboardInterrupt as e:  # a second Ctrl-C: no save, say where to resume
                if isinstance(e, Interrupted):
                    raise
                hint = self.checkpoints.resume_hint(f"interrupted at step {self.step}")
                raise Interrupted(hint) from None
            finally:
                prof.close()  # a run stopped inside the profiled steps: the profiler ends too
        self.checkpoints.finish(self.step, self.guard)
        self.log.close()
        return {"losses": losses, "history": history}

    def _after_step(self, stats, lr: float) -> list[dict]:
        """Divergence check, log line, evaluation and checkpoint of the step just taken."""
        cfg, guard, logged = self.cfg, self.guard, []
        if stats.counted == 0:  # every target of the step masked: the engine took no update
            say(
                self.ctx,
                f"step {self.step}: no target of the step counts toward the loss (all -1: no "
                "assistant tokens in its samples?); no update, the run goes on",
            )
        self.skipped += stats.skipped
        guard.record(self.step, stats.loss, stats.skipped, stats.loss_scale)
        if guard.healthy:
            self.checkpoints.prune()  # the newest checkpoint's weights gave a finite loss
        if self.step % cfg.log_every == 0 or self.step == cfg.steps or guard.tripped:
            rec = self.metrics.train(stats, self.step, lr, self.skipped, self.window, self.t_start)
            logged.append(rec)
            self.window = []
        if (spike := guard.spike_line(lr, cfg.lr, cfg.warmup)) is not None:  # once per run
            say(self.ctx, spike)
        if guard.tripped:
            self.checkpoints.diverged(guard, lr, self.step)
        if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
            self.metrics.eval(self.evaluate())
        self.checkpoints.after_step(self.step, guard, self.engine)
        return logged

    @property
    def tokens_per_step(self) -> int:
        cfg = self.cfg
        return tokens_per_step(
            cfg.micro_batch, cfg.grad_accum, self.model_cfg.seq_len, self.ctx.data_world
        )


def _is_backend_error(e: RuntimeError) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    keys = ("distbackenderror", "gloo", "nccl", "connection", "timed out", "timeout")
    return any(k in text for k in keys)


def train(run: Run) -> dict:
    """Train an assembled run (train/assemble.py); its files (name -> text) are kept in the run
    folder (rank 0), written once the trainer has started, so a run refused at start-up still
    leaves no folder behind."""
    config, ctx, resume = run.config, run.ctx, run.resume
    out = Path(config.train.out)
    # the run as started, kept in --out until its first checkpoint: what --resume restarts
    source = run.init_from and str(run.init_from.path)
    record = run_record(config, source, resume or None)
    per_node = config.train.node_local_checkpoints  # each machine opens and locks its own --out
    lock = open_run_dir(out, resume is not None, run.overwrite, ctx, record, per_node)
    trainer, failed = None, True
    try:
        trainer = Trainer(run, check_room=resume is None)
        if resume is not None:
            trainer.resume(Path(resume) if resume else out)
        # a new run, or one --resume restarts from its record (no checkpoint in --out yet)
        fresh = resume is None or (not resume and not ckpt_io.step_dirs(out))
        if run.init_from is not None and fresh:
            trainer.init_from(run.init_from)
        elif run.init_from is not None:  # a resumed adapter run: its base, not in its checkpoints
            trainer.base_from(run.init_from)
        if ctx.is_main:
            write_run_files(out, dict(run.files))
        out_ = trainer.fit()
        failed = False
        return out_
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as e:
        where = is_oom(e)
        if where is None:
            raise
        step = f"step {trainer.step + 1}" if trainer is not None else "start-up"
        held = gpu_held(e, ctx.device) if where == "gpu" and ctx.device.type == "cuda" else ""
        msg = oom_message(config, ctx, where, phase_of(e, step), held)
        raise OutOfMemory(msg, where) from None
    finally:
        if trainer is not None:
            trainer.engine.close()
        close_run_dir(out, lock, failed, started=trainer is not None)
