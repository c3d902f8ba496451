"""Run checkpoints: atomic, verified, the last K kept, resumable exactly.

A checkpoint is the folder run/step_XXXXXXXX holding the engine's state files (state_io), each
rank's RNG state, and meta.json (written last, by rank 0) with the configs, the chunk layout,
the trainer's state and the byte size of every file. Everything is first written into
run/.step_XXXXXXXX.tmp and the folder is renamed only when complete, so a crash or Ctrl-C can
never leave a folder that looks like a checkpoint; a checkpoint is never overwritten in place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from fitgpt.dist import DistContext
from fitgpt.engine.base import Engine
from fitgpt.engine.state_io import CorruptCheckpoint, fsync_write_json
from fitgpt.errors import UserError

FORMAT = "fitgpt-checkpoint"
VERSION = 1


def step_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints (with meta.json) of a run, oldest first."""
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.glob("step_*") if p.is_dir() and (p / "meta.json").is_file())


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(run_dir: Path, step: int, engine: Engine, meta: dict, ctx: DistContext, keep: int) -> Path:
    final = run_dir / f"step_{step:08d}"
    tmp = run_dir / f".step_{step:08d}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save are never valid
        tmp.mkdir(parents=True)
    ctx.barrier()
    engine.save_state(tmp)
    torch.save(rng_state(), tmp / f"rng-r{ctx.rank:03d}.pt")
    ctx.barrier()
    if ctx.is_main:
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        full = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "world": ctx.world,
            "layout": [c.to_dict() for c in engine.layout],
            "engine_state": engine.extra_state(),
            **meta,
            "files": files,
        }
        fsync_write_json(tmp / "meta.json", full)
        old = run_dir / f".step_{step:08d}.old"
        if final.exists():  # re-saving a step after a resume: swap, never delete before the rename
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        for stale in step_dirs(run_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    ctx.barrier()
    return final


def verify(ckpt: Path) -> dict:
    """meta.json of a complete, untruncated checkpoint, or CorruptCheckpoint naming the problem."""
    meta_path = ckpt / "meta.json"
    if not meta_path.is_file():
        raise CorruptCheckpoint(
            f"{ckpt} has no meta.json: it is incomplete or not a fitgpt checkpoint"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CorruptCheckpoint(f"{meta_path} is not valid JSON ({e})") from e
    if meta.get("format") != FORMAT:
        raise CorruptCheckpoint(
            f"{ckpt} is not a fitgpt checkpoint (format {meta.get('format')!r})"
        )
    for name, size in meta["files"].items():
        f = ckpt / name
        actual = f.stat().st_size if f.exists() else -1
        if actual != size:
            state = "missing" if actual < 0 else f"{actual} bytes instead of {size}"
            raise CorruptCheckpoint(f"{f} is {state}: the checkpoint is truncated or damaged")
    return meta


def resolve(path: Path) -> Path:
    """A checkpoint folder, or a run folder (its newest checkpoint)."""
    if (path / "meta.json").is_file():
        return path
    found = step_dirs(path)
    if not found:
        raise UserError(f"{path} holds no checkpoint (no step_*/meta.json); check the path")
    return found[-1]


def previous_good(ckpt: Path) -> Path | None:
    for p in reversed(step_dirs(ckpt.parent)):
        if p.name < ckpt.name:
            try:
                verify(p)
                return p
            except CorruptCheckpoint:
                continue
    return None


def load_meta(ckpt: Path) -> dict:
    """verify() with a message that points at the previous good checkpoint when there is one."""
    try:
        return verify(ckpt)
    except CorruptCheckpoint as e:
        prev = previous_good(ckpt)
        hint = (
            f"; the previous good checkpoint is {prev}: resume from it with --resume {prev}"
            if prev
            else ""
        )
        raise CorruptCheckpoint(f"{e}{hint}") from None


def load_rng(ckpt: Path, rank: int) -> None:
    f = ckpt / f"rng-r{rank:03d}.pt"
    if f.exists():
        set_rng_state(torch.load(f, weights_only=True))
