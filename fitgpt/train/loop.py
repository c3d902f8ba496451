"""The training loop: setup → fit → (evaluate, checkpoint) → summary.

It reaches parameters, gradients and optimizer state only through the engine: swapping the plain
engine for the sharded or tiered one changes nothing here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fitgpt import units
from fitgpt.data.config import DataConfig, open_data
from fitgpt.data.source import BatchLoader
from fitgpt.dist import DistContext
from fitgpt.dist.env import thread_tuner
from fitgpt.engine.base import Engine, StepStats
from fitgpt.engine.comm import CollectiveError
from fitgpt.engine.compile import report_line
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.engine.scaler import LossScaler
from fitgpt.engine.timing import PHASES
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.parallel.shard import check_tensor_parallel
from fitgpt.plan.memory import layout_of
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train import space
from fitgpt.train.config import TrainConfig
from fitgpt.train.guard import Diverged, DivergenceGuard, Interrupted, StopRequest
from fitgpt.train.init_from import FREE, InitSource, checkpoint_of, drop_scratch
from fitgpt.train.metrics import MetricsLog, format_line, peak_flops
from fitgpt.train.profile import StepProfiler
from fitgpt.train.resume import changed_settings, saved_run
from fitgpt.train.rundir import close_run_dir, open_run_dir
from fitgpt.train.schedule import lr_at, resolve_schedule, tokens_per_step
from fitgpt.train.setup import OutOfMemory, is_oom, oom_message, phase_of, resolve_run


@dataclass(frozen=True)
class RunConfig:
    """Everything a run is made of; saved in every checkpoint."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    engine: EngineConfig
    precision: PrecisionConfig
    optim: OptimConfig

    def to_dict(self) -> dict:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}


def say(ctx: DistContext, msg: str) -> None:
    if ctx.is_main:
        print(msg, flush=True)


def check_same_architecture(meta: dict, model_cfg: ModelConfig, ckpt: Path) -> None:
    saved = ModelConfig.from_dict(meta["config"]["model"])
    free = {k: getattr(model_cfg, k) for k in FREE}  # not the weights' shape: may differ
    if dataclasses.replace(saved, **free) != model_cfg:
        diff = {
            k: (v, getattr(model_cfg, k))
            for k, v in saved.to_dict().items()
            if getattr(model_cfg, k) != v and k not in FREE
        }
        raise UserError(
            f"{ckpt} holds another architecture (saved vs asked: {diff}); "
            "resume with the same --preset/--layers/--hidden/--heads/--seq-len"
        )


class Trainer:
    def __init__(self, run: RunConfig, ctx: DistContext, check_room: bool = False) -> None:
        """`check_room`: refuse a run whose checkpoints cannot fit its disk before the engine
        allocates anything (a resumed run is checked after its resume, in fit())."""
        tp = run.engine.tensor_parallel
        # before any data or model is touched
        check_tensor_parallel(tp, run.model, ctx.world, run.engine.sequence_parallel)
        # --tensor-parallel T: the ranks of one TP group take the same micro-batches, so data is
        # sharded by the data-parallel rank (ctx.dp_rank, ctx.dp_world; the job's at T=1)
        ctx = ctx.with_tensor_parallel(tp)
        # the rates and warm-up the command left unset, decided once (train/schedule.py): the
        # warm-up counts tokens, and the tokens per step count the data-parallel ranks
        tokens = tokens_per_step(
            run.train.micro_batch, run.train.grad_accum, run.model.seq_len, ctx.dp_world
        )
        train_cfg, self.defaults_line, warning = resolve_schedule(
            run.train, run.model, tokens, run.optim.beta2
        )
        run = dataclasses.replace(run, train=train_cfg)
        if warning:
            say(ctx, warning)
        self.run, self.ctx, self.cfg = run, ctx, run.train
        self.out = Path(self.cfg.out)
        self._counts: dict[str, float] = {}  # the engine's counters at the last metrics record
        c = self.cfg
        # the samples this run draws (Megatron's sample order is fixed for a run's length)
        per_batch = c.micro_batch * ctx.dp_world
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
        if self.tokenizer is not None and self.tokenizer.vocab_size != run.model.vocab_size:
            # the planner priced run.model: building another model would void its prediction
            raise UserError(
                f"the model's vocabulary ({run.model.vocab_size}) is not the tokenizer's "
                f"({self.tokenizer.vocab_size}): make the run with fitgpt.train.setup.setup_run"
            )
        self.model_cfg = run.model
        run = self.run = dataclasses.replace(run, precision=run.precision.resolved(ctx.device.type))
        self.loader = BatchLoader(train_src, self.cfg.micro_batch, ctx.dp_rank, ctx.dp_world)
        self.step = 0
        self.skipped = 0  # fp16 steps skipped on overflow, over the whole run
        self.source: str | None = None  # --init-from
        if check_room:
            self.preflight()
        # dropout masks differ per data-parallel rank, as in DDP, and agree within a TP group
        # (its replicated activations must stay identical)
        torch.manual_seed(self.cfg.seed + ctx.dp_rank)
        self.engine: Engine = build_engine(
            run.model, run.engine, run.precision, run.optim, ctx, self.cfg.seed
        )
        self.log = MetricsLog(self.out, ctx.is_main)
        self.peak = peak_flops(ctx.device)
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

    @functools.cached_property
    def ckpt_size(self) -> space.CheckpointSize:
        """Bytes of one checkpoint of this run, full and weights-only, from the model's chunk
        layout (the engine's own, computed without allocating)."""
        e = self.run.engine
        layout = layout_of(self.model_cfg)
        meta = {
            **self.meta(),
            "layout": [c.to_dict() for c in layout],
            # what the engines' extra_state() holds: the optimizer's step and the loss scaler
            "engine_state": {
                "optimizer_step": 0,
                "scaler": LossScaler(self.run.precision).state_dict(),
            },
        }
        # under TP, rank 0 writes every chunk whole (parallel/state.py)
        sharded = e.engine == "zero" and e.zero_stage >= 1 and e.tensor_parallel == 1
        meta_bytes = len(json.dumps(meta, indent=1))
        return space.checkpoint_size(layout, self.ctx.world, sharded, meta_bytes)

    def preflight(self) -> None:
        """Before step 1: refuse, in one line with the options, a run whose checkpoints cannot
        fit on --out's disk. fit() calls it; calling it earlier as well is harmless."""
        if not self.cfg.save:
            return
        space.check_room(
            self.out,
            self.ckpt_size,
            self.cfg.save_optimizer == "full",
            existing=len(ckpt_io.step_dirs(self.out)),
            saves=space.saves_in_run(self.step, self.cfg.steps, self.cfg.save_every),
            keep=self.cfg.keep,
        )

    def save(self) -> Path:
        optimizer = self.cfg.save_optimizer == "full"
        t0 = time.perf_counter()
        path = ckpt_io.save(
            self.out,
            self.step,
            self.engine,
            self.meta(),
            self.ctx,
            self.cfg.keep + 1,  # the extra one goes after the next healthy step (_prune)
            optimizer=optimizer,
            explain=space.explain_failure(self.out, self.ckpt_size, optimizer),
        )
        self.saved_step, self.prune_owed = self.step, True
        size = self.ckpt_size.of(optimizer) / 1e9
        what = "" if optimizer else "weights only, "
        say(self.ctx, f"saved {path} ({what}{size:.1f} GB in {time.perf_counter() - t0:.1f} s)")
        return path

    def resume(self, where: Path) -> None:
        """Continue from a checkpoint, or from --out's newest; --out with none yet starts
        fresh (so a restart loop needs no first-time case)."""
        if where.absolute() == self.out.absolute() and not ckpt_io.step_dirs(self.out):
            say(self.ctx, f"--resume: {self.out} holds no checkpoint yet; starting at step 0")
            self.log.drop_after(0)
            return
        ckpt = ckpt_io.resolve(where)
        meta = ckpt_io.load_meta(ckpt)
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
        changes = changed_settings(meta, ckpt, self.run, ctx.world, ctx.dp_world, ctx.device.type)
        changed = f"; changed {', '.join(changes)}" if changes else ""
        fresh = (
            ""
            if ckpt_io.holds_optimizer(meta)
            else "; optimizer state starts fresh: the checkpoint holds weights only"
        )
        say(ctx, f"resumed from {ckpt} at step {self.step}{changed}{fresh}")

    def init_from(self, source: InitSource) -> None:
        """Start from `source`'s weights: optimizer, step count and data position stay fresh."""
        ckpt = checkpoint_of(source, self.out, self.ctx)
        try:
            meta = ckpt_io.load_meta(ckpt)
            check_same_architecture(meta, self.model_cfg, ckpt)
            ckpt_io.load_state(ckpt, meta, self.engine, self.ctx, weights_only=True)
        finally:
            drop_scratch(self.out, self.ctx)
        self.source = str(source.path)
        say(
            self.ctx, f"initialised from {source.path}: its weights; optimizer, step and data fresh"
        )

    # ---- evaluation ---------------------------------------------------------------------------
    def evaluate(self) -> dict:
        loader = BatchLoader(
            self.val_src, self.cfg.micro_batch, self.ctx.dp_rank, self.ctx.dp_world
        )
        losses = [self.engine.eval_loss(loader.next()) for _ in range(self.cfg.eval_batches)]
        loss = sum(losses) / len(losses)
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
        self.preflight()
        if self.step == 0 and self.defaults_line:  # a resumed run took its saved config's
            say(ctx, self.defaults_line)
        compiled = ""
        if self.engine.compiled is not None:
            whole = self.engine.compiled.report()["scope"] == "model"
            compiled = " (compiled: the whole model)" if whole else " (compiled blocks and head)"
        tp_note = (
            f" (tensor-parallel {ctx.tp} × data-parallel {ctx.dp_world})" if ctx.tp > 1 else ""
        )
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
        self.saved_step, self.prune_owed, self.save_owed = None, False, False
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
                        self._report_compile()
                    self.window.append(dt)
                    losses.append(stats.loss)
                    history += self._after_step(stats, lr)
                    if written is not None:
                        say(ctx, written)
                    if stop.requested(ctx):
                        self._stop(stop)
            except KeyboardInterrupt as e:  # a second Ctrl-C: no save, say where to resume
                if isinstance(e, Interrupted):
                    raise
                raise Interrupted(self._resume_hint(f"interrupted at step {self.step}")) from None
            finally:
                prof.close()  # a run stopped inside the profiled steps: the profiler ends too
        self._prune()
        if self.save_owed:
            say(ctx, self._resume_hint(f"step {self.step} was not saved: {self.guard.why()}"))
        self.log.close()
        return {"losses": losses, "history": history}

    def _after_step(self, stats, lr: float) -> list[dict]:
        """Divergence check, log line, evaluation and checkpoint of the step just taken."""
        cfg, guard, logged = self.cfg, self.guard, []
        self.skipped += stats.skipped
        guard.record(self.step, stats.loss, stats.skipped, stats.loss_scale)
        if guard.healthy:
            self._prune()  # the newest checkpoint's weights gave a finite loss
        if self.step % cfg.log_every == 0 or self.step == cfg.steps or guard.tripped:
            logged.append(self._log_step(stats, lr, self.window, self.t_start))
            self.window = []
        if (spike := guard.spike_line(lr, cfg.lr, cfg.warmup)) is not None:  # once per run
            say(self.ctx, spike)
        if guard.tripped:
            self._diverged(guard, lr)
        if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
            self._evaluate_and_log()
        due = (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.steps
        self.save_owed = self._maybe_save(self.save_owed or due, self.save_owed, guard)
        return logged

    def _report_compile(self) -> None:
        """--compile on: one log line and one metrics record of the compiled regions, their
        graph breaks, recompiles and compile seconds (engine/compile.py)."""
        report = self.engine.compile_report()
        if report is not None:
            self.log.write({"kind": "compile", "step": self.step, **report})
            say(self.ctx, report_line(report))

    @property
    def tokens_per_step(self) -> int:
        cfg = self.cfg
        return tokens_per_step(
            cfg.micro_batch, cfg.grad_accum, self.model_cfg.seq_len, self.ctx.dp_world
        )

    def _log_step(self, stats, lr: float, window: list[float], t_start: float) -> dict:
        """One log line and metrics record; the ETA is the steps left at the median step time."""
        ctx, ms = self.ctx, 1000 * statistics.median(window)
        rec = {
            "kind": "train",
            "step": self.step,
            "loss": stats.loss,
            "lr": lr,
            "loss_scale": stats.loss_scale,
            "skipped": self.skipped,
            "grad_norm": stats.grad_norm,
            "ms_per_step": ms,
            "tokens_per_s": self.tokens_per_step / (ms / 1000),
        }
        flops = self.model_cfg.flops_per_token() * rec["tokens_per_s"] / ctx.world
        if ctx.device.type == "cpu":  # the count can change while the run trains
            rec["cpu_threads"] = torch.get_num_threads()
        if ctx.device.type == "cuda":
            rec["tflops"] = flops / 1e12  # per GPU
            rec["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
            if self.peak:
                rec["mfu"] = flops / self.peak
        report = self.engine.compile_report()
        rec["compiled"] = bool(report and report["regions"])
        if report is not None:
            rec["compile_s"] = report["compile_s"]  # so far: ms_per_step is a median beside it
        rec.update(self._breakdown(len(window)))
        rec["elapsed_s"] = time.perf_counter() - t_start
        rec["eta_s"] = (self.cfg.steps - self.step) * ms / 1000
        self.log.write(rec)
        say(ctx, format_line(rec))
        return rec

    def _breakdown(self, steps: int) -> dict:
        """Where the steps' time went (engine.breakdown): the last step's phases in seconds, the
        host optimizer's counters as seconds per step over the steps since the last record
        (worker busy, main-thread waits, copies), and the speculative update's run totals."""
        counts, out = self.engine.breakdown(), {}
        run_totals = ("speculated_steps_total", "rollbacks_total")
        out.update({f"{k}_s": counts[k] for k in PHASES if k in counts})
        for key, v in counts.items():
            if key in run_totals:
                out[key.removesuffix("_total")] = v
            elif key.endswith("_total"):
                name = key.removesuffix("_total")
                name += "" if name.endswith("_gb") else "_s"
                out[name] = (v - self._counts.get(key, 0.0)) / max(steps, 1)
        self._counts = counts
        return out

    def _evaluate_and_log(self) -> None:
        ev = self.evaluate()
        self.log.write(ev)
        say(
            self.ctx,
            f"eval step {self.step} | val loss {ev['val_loss']:.4f} | ppl {ev['val_ppl']:.2f}",
        )

    def _maybe_save(self, wanted: bool, pending: bool, guard: DivergenceGuard) -> bool:
        """Save if wanted, unless the latest step is unhealthy (its weights may be broken): the
        save then waits for a healthy step. Returns whether a save is still owed."""
        if not (self.cfg.save and wanted):
            return False
        if guard.healthy:
            self.save()
            return False
        if not pending:
            say(self.ctx, f"step {self.step}: checkpoint postponed, {guard.why()}")
        return True

    def _prune(self) -> None:
        """Checkpoints beyond --keep go once a healthy step has shown the newest one's weights
        to be good (save() keeps one extra until then: at most keep + 1, as while writing)."""
        if self.prune_owed and self.ctx.is_main:
            ckpt_io.prune(self.out, self.cfg.keep)
        self.prune_owed = False

    def _newest(self) -> Path | None:
        found = ckpt_io.step_dirs(self.out)
        return found[-1] if found else None

    def _resume_hint(self, what: str) -> str:
        last = self._newest()
        if last is None:
            return f"{what}; no checkpoint was written, so a new run starts from step 0"
        return f"{what}; the last checkpoint is {last}: resume with fitgpt train --out {self.out} --resume"

    def _stop(self, stop: StopRequest) -> None:
        """SIGINT/SIGTERM: save the current step (unless saving is off or the step unhealthy),
        then end with the resume command in one line."""
        guard = self.guard
        what = f"stopped by {stop.name or 'a signal to another rank'} at step {self.step}"
        if self.cfg.save and self.saved_step != self.step and guard.healthy:
            self.save()  # a failure here ends in SaveFailed's own line, naming the last one
        self._prune()
        if self.saved_step == self.step:
            raise Interrupted(
                f"{what}; saved {self.out / f'step_{self.step:08d}'}: resume with "
                f"fitgpt train --out {self.out} --resume"
            )
        reason = "--no-save" if not self.cfg.save else guard.why()
        raise Interrupted(self._resume_hint(f"{what}, not saved ({reason})"))

    def _diverged(self, guard: DivergenceGuard, lr: float) -> None:
        """Stop a diverged run in one line. The checkpoint saved just before the first unhealthy
        step holds the weights that produced it: rank 0 sets it aside, never to be resumed."""
        what = (
            f"training diverged: {guard.streak} steps in a row (steps {guard.first_bad}-"
            f"{self.step}) had a NaN/inf loss or a skipped update (latest loss {guard.last_loss})"
        )
        if not self.ctx.is_main:
            raise Diverged(f"{what}; rank 0 names the last good checkpoint")
        moved = ""
        suspect = self.out / f"step_{(guard.first_unhealthy or 1) - 1:08d}"
        if guard.first_unhealthy is not None and (suspect / "meta.json").is_file():
            aside = self.out / f"diverged.{suspect.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(suspect, aside)
            moved = f"; {suspect.name}, whose weights gave the first bad step, is now {aside}"
        last = self._newest()
        good = f"; the last good checkpoint is {last}" if last else "; no good checkpoint exists"
        raise Diverged(
            f"{what}; nothing was saved from them{moved}{good}; "
            f"{guard.advice(lr, self.cfg.lr, self.cfg.warmup)}, "
            "or pass --max-bad-steps 0 to train on"
        )


def _is_backend_error(e: RuntimeError) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    keys = ("distbackenderror", "gloo", "nccl", "connection", "timed out", "timeout")
    return any(k in text for k in keys)


def _write_run_files(out: Path, files: dict[str, str]) -> None:
    """Small text files kept with the run (deepspeed_notes.txt), each renamed into place whole."""
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        try:
            tmp.write_text(text)
            os.replace(tmp, out / name)
        except OSError as e:
            raise UserError(f"--out {out}: cannot write {name} ({e.strerror})") from None


def train(
    run: RunConfig,
    ctx: DistContext,
    resume: str | None = None,
    overwrite: bool = False,
    init_from: InitSource | None = None,
    run_files: dict[str, str] | None = None,
) -> dict:
    """Train `run`; `run_files` (name -> text) are kept in the run folder (rank 0), written once
    the trainer has started, so a run refused at start-up still leaves no folder behind."""
    run = resolve_run(run, ctx.device.type)  # a no-op for a run setup_run made (and planned)
    out = Path(run.train.out)
    lock = open_run_dir(out, resume is not None, overwrite, ctx)  # run folder: locked, checked
    trainer, failed = None, True
    try:
        trainer = Trainer(run, ctx, check_room=resume is None)
        if resume is not None:
            trainer.resume(Path(resume) if resume else out)
        elif init_from is not None:
            trainer.init_from(init_from)
        if ctx.is_main:
            _write_run_files(out, run_files or {})
        out_ = trainer.fit()
        failed = False
        return out_
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as e:
        where = is_oom(e)
        if where is None:
            raise
        step = f"step {trainer.step + 1}" if trainer is not None else "start-up"
        raise OutOfMemory(oom_message(run, ctx, where, phase_of(e, step)), where) from None
    finally:
        if trainer is not None:
            trainer.engine.close()
        close_run_dir(out, lock, failed)
