"""The training loop: setup → fit → (evaluate, checkpoint) → summary.

It reaches parameters, gradients and optimizer state only through the engine: swapping the plain
engine for the sharded or tiered one changes nothing here.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fitgpt.data.config import DataConfig, open_data
from fitgpt.data.source import BatchLoader
from fitgpt.dist import DistContext
from fitgpt.engine.base import Engine, StepStats
from fitgpt.engine.comm import CollectiveError
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.engine.state_io import CorruptCheckpoint
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.config import TrainConfig
from fitgpt.train.metrics import MetricsLog, format_line, peak_flops
from fitgpt.train.schedule import lr_at
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


def prepare_run_dir(out: Path, resume: bool, overwrite: bool, ctx: DistContext) -> None:
    existing = ckpt_io.step_dirs(out)
    if existing and not resume and not overwrite:
        raise UserError(
            f"{out} already holds checkpoints ({existing[-1].name}); pass --resume to continue, "
            "--overwrite to start over, or another --out"
        )
    if ctx.is_main:
        if overwrite and not resume and out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    ctx.barrier()


def check_same_architecture(meta: dict, model_cfg: ModelConfig, ckpt: Path) -> None:
    saved = ModelConfig.from_dict(meta["config"]["model"])
    if saved != model_cfg:
        diff = {
            k: (v, getattr(model_cfg, k))
            for k, v in saved.to_dict().items()
            if getattr(model_cfg, k) != v
        }
        raise UserError(
            f"{ckpt} holds another architecture (saved vs asked: {diff}); "
            "resume with the same --preset/--layers/--hidden/--heads/--seq-len"
        )


class Trainer:
    def __init__(self, run: RunConfig, ctx: DistContext) -> None:
        self.run, self.ctx, self.cfg = run, ctx, run.train
        self.out = Path(self.cfg.out)
        c = self.cfg
        # the samples this run draws (Megatron's sample order is fixed for a run's length)
        per_batch = c.micro_batch * ctx.world
        train_src, self.val_src, self.tokenizer = open_data(
            run.data,
            run.model.seq_len,
            run.model.vocab_size,
            c.seed,
            num_samples=(c.steps * c.grad_accum * per_batch, c.eval_batches * per_batch),
        )
        if self.tokenizer is not None and self.tokenizer.vocab_size != run.model.vocab_size:
            # the planner priced run.model: building another model would void its prediction
            raise UserError(
                f"the model's vocabulary ({run.model.vocab_size}) is not the tokenizer's "
                f"({self.tokenizer.vocab_size}): make the run with fitgpt.train.setup.setup_run"
            )
        self.model_cfg = run.model
        run = self.run = dataclasses.replace(run, precision=run.precision.resolved(ctx.device.type))
        torch.manual_seed(self.cfg.seed + ctx.rank)  # dropout masks differ per rank, as in DDP
        self.engine: Engine = build_engine(
            run.model, run.engine, run.precision, run.optim, ctx, self.cfg.seed
        )
        self.loader = BatchLoader(train_src, self.cfg.micro_batch, ctx.rank, ctx.world)
        self.step = 0
        self.skipped = 0  # fp16 steps skipped on overflow, over the whole run
        self.log = MetricsLog(self.out, ctx.is_main)
        self.peak = peak_flops(ctx.device)

    # ---- checkpoints --------------------------------------------------------------------------
    def meta(self) -> dict:
        return {
            "config": self.run.to_dict(),
            "tokenizer": self.tokenizer.name if self.tokenizer is not None else None,
            "trainer": {
                "step": self.step,
                "skipped": self.skipped,
                "data": self.loader.state_dict(),
            },
        }

    def save(self) -> Path:
        path = ckpt_io.save(self.out, self.step, self.engine, self.meta(), self.ctx, self.cfg.keep)
        say(self.ctx, f"saved {path}")
        return path

    def resume(self, where: Path) -> None:
        ckpt = ckpt_io.resolve(where)
        meta = ckpt_io.load_meta(ckpt)
        check_same_architecture(meta, self.model_cfg, ckpt)
        try:
            self.engine.load_state(ckpt, meta["engine_state"])
        except CorruptCheckpoint as e:
            prev = ckpt_io.previous_good(ckpt)
            hint = (
                f"; the previous good checkpoint is {prev}: resume from it with --resume {prev}"
                if prev
                else ""
            )
            raise CorruptCheckpoint(f"{e}{hint}") from None
        self.step = meta["trainer"]["step"]
        self.skipped = meta["trainer"].get("skipped", 0)
        self.loader.load_state_dict(meta["trainer"]["data"])
        if meta["world"] == self.ctx.world:
            ckpt_io.load_rng(ckpt, self.ctx.rank)
        say(self.ctx, f"resumed from {ckpt} at step {self.step}")

    # ---- evaluation ---------------------------------------------------------------------------
    def evaluate(self) -> dict:
        loader = BatchLoader(self.val_src, self.cfg.micro_batch, self.ctx.rank, self.ctx.world)
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
        """FITGPT_FAULT=RANK:STEP:die|hang makes one rank fail at a step: the failure-handling
        test uses it to check that the job ends with the rank and collective named."""
        spec = os.environ.get("FITGPT_FAULT")
        if not spec:
            return
        rank, step, kind = spec.split(":")
        if int(rank) == self.ctx.rank and int(step) == self.step:
            if kind == "die":
                os._exit(17)
            time.sleep(3600)

    def step_once(self, micro: list | None = None) -> tuple[StepStats, float, float]:
        """One optimizer step on `micro` (default: the next micro-batches of the run's data):
        (its stats, its seconds without reading the data, its lr). The benchmark harness runs
        these same steps on the batches every system of a sweep shares."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        if micro is None:
            micro = [self.loader.next() for _ in range(cfg.grad_accum)]
        self._maybe_inject_fault()
        t0 = time.perf_counter()
        stats = self._guarded_step(micro, lr)  # ends in a host sync: the timing is real
        dt = time.perf_counter() - t0
        self.step += 1
        return stats, dt, lr

    def fit(self) -> dict:
        cfg, ctx = self.cfg, self.ctx
        tokens_per_step = cfg.micro_batch * cfg.grad_accum * ctx.world * self.model_cfg.seq_len
        say(
            ctx,
            f"model {self.model_cfg.num_params() / 1e6:.2f} M parameters, engine "
            f"{self.run.engine.engine}, {ctx.world} rank(s) on {ctx.device}, "
            f"{tokens_per_step:,} tokens per step, {torch.get_num_threads()} CPU threads per rank",
        )
        window, losses, history = [], [], []
        on_cuda = ctx.device.type == "cuda"
        while self.step < cfg.steps:
            stats, dt, lr = self.step_once()
            window.append(dt)
            losses.append(stats.loss)
            self.skipped += stats.skipped
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                ms = 1000 * statistics.median(window)
                rec = {
                    "kind": "train",
                    "step": self.step,
                    "loss": stats.loss,
                    "lr": lr,
                    "loss_scale": stats.loss_scale,
                    "skipped": self.skipped,
                    "grad_norm": stats.grad_norm,
                    "ms_per_step": ms,
                    "tokens_per_s": tokens_per_step / (ms / 1000),
                }
                flops = self.model_cfg.flops_per_token() * rec["tokens_per_s"] / ctx.world
                if on_cuda:
                    rec["tflops"] = flops / 1e12  # per GPU
                    rec["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
                    if self.peak:
                        rec["mfu"] = flops / self.peak
                self.log.write(rec)
                say(ctx, format_line(rec))
                history.append(rec)
                window = []
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                ev = self.evaluate()
                self.log.write(ev)
                say(
                    ctx,
                    f"eval step {self.step} | val loss {ev['val_loss']:.4f} | ppl {ev['val_ppl']:.2f}",
                )
            due = (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.steps
            if cfg.save and due:
                self.save()
        self.log.close()
        return {"losses": losses, "history": history}


def _is_backend_error(e: RuntimeError) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    keys = ("distbackenderror", "gloo", "nccl", "connection", "timed out", "timeout")
    return any(k in text for k in keys)


def train(
    run: RunConfig, ctx: DistContext, resume: str | None = None, overwrite: bool = False
) -> dict:
    run = resolve_run(run, ctx.device.type)  # a no-op for a run setup_run made (and planned)
    out = Path(run.train.out)
    prepare_run_dir(out, resume is not None, overwrite, ctx)
    trainer = None
    try:
        trainer = Trainer(run, ctx)
        if resume is not None:
            trainer.resume(Path(resume) if resume else out)
        return trainer.fit()
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as e:
        where = is_oom(e)
        if where is None:
            raise
        step = f"step {trainer.step + 1}" if trainer is not None else "start-up"
        raise OutOfMemory(oom_message(run, ctx, where, phase_of(e, step)), where) from None
    finally:
        if trainer is not None:
            trainer.engine.close()
