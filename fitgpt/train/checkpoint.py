"""Run checkpoints: atomic, checksummed, the last K kept, resumable exactly.

A checkpoint is the folder run/step_XXXXXXXX holding the engine's state files (state_io), each
rank's RNG state, and meta.json (written last, by rank 0) with the configs, the chunk layout,
the trainer's state, the byte size of every file, a SHA-256 of every small file (indexes, RNG
states) and a SHA-256 of meta.json's own content. Everything is first written into
run/.step_XXXXXXXX.tmp and the folder is renamed only when complete, so a crash or Ctrl-C can
never leave a folder that looks like a checkpoint; a checkpoint is never overwritten in place.
A save that fails in any rank (full disk, I/O error, an exception, a dead rank) removes the
temporary folder, keeps every earlier checkpoint and ends the run in one line.

Node-local checkpoints (--node-local-checkpoints: machines that share no disk): each machine's
first rank makes the temporary folder in its own --out, the machine's ranks write their files
there, and every machine's first rank writes the same meta.json, which names the machine that
holds each file (`nodes`: the node count, the ranks per node and the node of every file) and
renames its folder into place. A resume on the same world and node shape reads each machine's
own files (every rank reads only its own shard: the flag is refused where that is not so,
train/assemble.py); any other resume, and an export, needs every file in one folder, and a
checkpoint whose files are scattered is refused in one line naming the nodes whose files are
missing and the rsync that gathers them (`require_files`), before anything is loaded.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from fitgpt.dist import DistContext
from fitgpt.dist.nodes import node_of_rank, node_shape
from fitgpt.engine.base import Engine
from fitgpt.engine.comm import CollectiveError, all_ok
from fitgpt.engine.layout import ChunkSpec
from fitgpt.engine.state_io import CorruptCheckpoint
from fitgpt.errors import UserError

FORMAT = "fitgpt-checkpoint"
VERSION = 2  # 2: checksums of meta.json and of every file; 1 (sizes and tensor CRCs) still reads
FAULT_ENV = "FITGPT_SAVE_FAULT"  # RANK:STEP:enospc|eio|error|die, for the failure tests
# What a run folder holds before its first checkpoint: the run as it was started (its config and
# --init-from source; train/rundir.py writes it, --resume reads it). The first checkpoint takes
# over that role, and the record goes.
RECORD_NAME = "run.json"


# load_meta(ckpt, node=ANY_NODE): meta.json and the files present (a node-local checkpoint read
# on one machine: its config, for settling a run); the files a rank needs are then checked by
# require_files, where the ranks that read them are known
ANY_NODE = -1


class ScatteredCheckpoint(UserError):
    """A node-local checkpoint whose files lie on other machines than the one reading it. Not a
    CorruptCheckpoint: an earlier checkpoint of the run is scattered the same way."""


class SaveFailed(UserError):
    """A checkpoint could not be written; its temporary folder is gone, earlier ones are kept."""

    agreed = True  # every rank learns the outcome from the same all_ok


def leads_folder(ctx: DistContext, node_local: bool) -> bool:
    """Whether this rank does a run folder's file work (makes, renames, prunes, sets aside, locks):
    rank 0 of the one shared --out, or with node-local checkpoints each machine's first rank in
    its own (whose folder holds that machine's files and a copy of meta.json)."""
    return ctx.local_rank == 0 if node_local else ctx.is_main


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


# ---- meta.json: written and read with its checksum -------------------------------------------
def _canonical(meta: dict) -> str:
    return json.dumps(meta, indent=1)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(folder: Path) -> dict:
    """The size of every file in `folder` and the SHA-256 of every file that is not a state file
    (those carry CRCs in their index): meta.json's `files` and `file_sha256`."""
    names = sorted(p.name for p in folder.iterdir() if p.name != "meta.json")
    return {
        "files": {n: (folder / n).stat().st_size for n in names},
        "file_sha256": {n: _sha256(folder / n) for n in names if not n.endswith(".safetensors")},
    }


def write_meta(folder: Path, meta: dict, files: dict | None = None) -> None:
    """Complete `meta` with the format, the `listing` of `folder` (or `files`: every node's,
    for a node-local checkpoint) and the checksum of meta's own content, and write it as
    folder/meta.json (fsynced, renamed into place). Any writer of fitgpt checkpoints (the
    trainer, an importer) ends with this call."""
    body = {"format": FORMAT, "version": VERSION, **meta, **(files or listing(folder))}
    body["checksum"] = hashlib.sha256(_canonical(body).encode()).hexdigest()
    tmp = folder / "meta.json.tmp"
    with open(tmp, "w") as f:
        f.write(_canonical(body))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / "meta.json")


def _read_meta(path: Path) -> dict:
    """meta.json parsed, its checksum and exact bytes checked (any edit, even of whitespace)."""
    try:
        text = path.read_bytes().decode("utf-8")
        meta = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpoint(f"{path} is unreadable or not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{path.parent} is not a fitgpt checkpoint (no format {FORMAT!r})")
    version = meta.get("version", 1)
    if not isinstance(version, int) or version > VERSION:
        raise CorruptCheckpoint(f"{path}: version {version!r} is not one this fitgpt reads")
    if version >= 2 or "checksum" in meta:  # version 1 predates checksums
        body = {k: v for k, v in meta.items() if k != "checksum"}
        ok = meta.get("checksum") == hashlib.sha256(_canonical(body).encode()).hexdigest()
        if not ok or _canonical(meta) != text:
            raise CorruptCheckpoint(f"{path} does not match its checksum: it was damaged or edited")
    return meta


def verify(ckpt: Path, node: int | None = None) -> dict:
    """meta.json of a complete checkpoint whose files all have their recorded sizes and small
    files their recorded SHA-256, or CorruptCheckpoint naming the problem. The state files'
    headers are checked by StateReader when it opens them, their tensors when they are read.
    A node-local checkpoint's files are those of `node` (None: every node's, refused in one line
    naming the nodes whose files are missing; ANY_NODE: those present)."""
    meta_path = ckpt / "meta.json"
    if not meta_path.is_file():
        raise CorruptCheckpoint(
            f"{ckpt} has no meta.json: it is incomplete or not a fitgpt checkpoint"
        )
    meta = _read_meta(meta_path)
    try:
        needed = files_needed(meta, node)
        if node is None and (gaps := missing(ckpt, meta, needed)):
            raise scattered(ckpt, meta, gaps)
        for name in needed:
            f, size = ckpt / name, meta["files"][name]
            actual = f.stat().st_size if f.is_file() else -1
            if (
                actual < 0
                and node == ANY_NODE
                and name in (meta.get("nodes") or {}).get("files", {})
            ):
                continue  # another machine's file: require_files asks for it where it is read
            if actual != size:
                state = "missing" if actual < 0 else f"{actual} bytes instead of {size}"
                raise CorruptCheckpoint(f"{f} is {state}: the checkpoint is truncated or damaged")
        for name, digest in meta.get("file_sha256", {}).items():
            if name in needed and (ckpt / name).is_file() and _sha256(ckpt / name) != digest:
                raise CorruptCheckpoint(f"{ckpt / name} does not match its SHA-256: it is damaged")
        absent = [k for k in ("step", "world", "layout", "config") if k not in meta]
        if absent:
            raise KeyError(", ".join(absent))
    except (KeyError, TypeError, AttributeError, OSError) as e:
        raise CorruptCheckpoint(f"{meta_path} is malformed ({type(e).__name__}: {e})") from None
    return meta


# ---- node-local checkpoints -----------------------------------------------------------------
def files_needed(meta: dict, node: int | None) -> list[str]:
    """The files of `meta` a reader on `node` needs: a node-local checkpoint's files of that
    node (None or ANY_NODE: all of them), every file of any other checkpoint."""
    where = (meta.get("nodes") or {}).get("files")
    if where is None or node is None or node == ANY_NODE:
        return list(meta["files"])
    return [n for n in meta["files"] if where.get(n, node) == node]


def missing(ckpt: Path, meta: dict, names: list[str]) -> dict[str, int | None]:
    """The `names` absent from `ckpt`, each with the node that holds it (None: not node-local)."""
    where = (meta.get("nodes") or {}).get("files", {})
    return {n: where.get(n) for n in names if not (ckpt / n).is_file()}


def reading_node(meta: dict, ctx: DistContext) -> int | None:
    """The node whose files this rank reads: its own, when the checkpoint is node-local and the
    job has its world and node shape (each rank then reads only its own shard, which its own
    machine wrote); None (every file, in this folder) otherwise."""
    nodes = meta.get("nodes")
    if nodes is None or meta["world"] != ctx.world:
        return None
    per, count = node_shape(ctx.world)
    return node_of_rank() if (per, count) == (nodes["per_node"], nodes["count"]) else None


def scattered(ckpt: Path, meta: dict, gaps: dict[str, int | None], own: bool = False) -> UserError:
    """The one line refusing a checkpoint whose files `gaps` are not in `ckpt` (`own`: a job of
    the saving shape, whose nodes miss the files they wrote themselves)."""
    nodes = meta.get("nodes")
    if nodes is None or None in gaps.values():
        first = sorted(gaps)[0]
        return CorruptCheckpoint(
            f"{ckpt / first} is missing: the checkpoint is truncated or damaged"
        )
    held = sorted(set(gaps.values()))
    names = sorted(gaps)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    if own:
        return ScatteredCheckpoint(
            f"{ckpt}: node(s) {', '.join(map(str, held))} lack the files they saved there "
            f"({shown}): give each node the --out it saved into, or resume from an earlier "
            "checkpoint"
        )
    gather = "; ".join(f"rsync -a NODE{r}:{ckpt}/ {ckpt}/" for r in held)
    return ScatteredCheckpoint(
        f"{ckpt} was saved node-local on {nodes['count']} node(s) of {nodes['per_node']} "
        f"process(es); the files of node(s) {', '.join(map(str, held))} are not here ({shown}): "
        f"gather them into this folder first (on this machine: {gather}, NODE the machine's "
        f"address), or resume on {nodes['count']} node(s) of {nodes['per_node']} process(es), "
        "each with its own --out"
    )


def require_files(ckpt: Path, meta: dict, ctx: DistContext) -> None:
    """Every file each rank of the job needs is in its folder, or every rank raises the same
    one-line refusal naming the nodes whose files are missing (collective: one all_gather of
    the names, before anything is loaded). A checkpoint that is not node-local passes."""
    if "nodes" not in meta:
        return
    node = reading_node(meta, ctx)
    gaps = missing(ckpt, meta, files_needed(meta, node))
    if ctx.distributed:
        every: list = [None] * ctx.world
        dist.all_gather_object(every, gaps, group=ctx.group)
        gaps = {k: v for g in every for k, v in g.items()}
    if gaps:
        e = scattered(ckpt, meta, gaps, own=node is not None)
        e.agreed = e.identical = ctx.distributed  # every rank holds the same gathered names
        raise e


def resolve(path: Path) -> Path:
    """A checkpoint folder, or a run folder (its newest checkpoint)."""
    if (path / "meta.json").is_file():
        return path
    found = step_dirs(path)
    if not found:
        raise UserError(f"{path} holds no checkpoint (no step_*/meta.json); check the path")
    return found[-1]


# Reading a checkpoint that a live run may prune (`generate`/`export` of a run that still
# trains). The reader holds a shared flock on the checkpoint's meta.json until it exits, and
# prune() skips a checkpoint so held (it goes at a later save): otherwise the newest checkpoint
# of a run saving often with a small --keep was deleted between being picked and being read,
# and the reader failed with "has no index-r*.json" (every time at --keep 1 on CPU). Costs a
# reader that runs long (generate --interactive) one checkpoint more on the run's disk, until
# the reader lets go: a prune that skipped it marks it (PRUNE_OWED) and the reader deletes it
# as it exits (release_held), else a run that ended meanwhile left it beyond --keep for good.
_HELD: list[tuple[int, Path]] = []  # the readers' fds and checkpoints, for the process's life
PRUNE_OWED = ".prune-owed"


def resolve_held(path: Path) -> Path:
    """`resolve`, the checkpoint then held against pruning for the rest of this process. A run
    folder's newest checkpoint pruned before the hold took is picked again (the run saved a newer
    one meanwhile); a named checkpoint folder that went is refused in one line."""
    for _ in range(100):  # each retry means the run saved again: a bound, never reached
        ckpt = resolve(path)
        try:
            fd = os.open(ckpt / "meta.json", os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a prune deleting it right now
        except OSError:  # a filesystem without flock: no prune can hold it either (_claim)
            os.close(fd)
            return ckpt
        try:
            here = os.stat(ckpt / "meta.json").st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            here = False
        if here:
            if not _HELD:
                atexit.register(release_held)
            _HELD.append((fd, ckpt))
            return ckpt
        os.close(fd)
        if ckpt == path:
            break
    raise UserError(f"{path} was deleted while it was opened (a run pruned it?); check the path")


def release_held() -> None:
    """Let go of the checkpoints this process held (at its exit), deleting those a prune
    skipped meanwhile (PRUNE_OWED) that no other reader holds: the prune the run owed them."""
    while _HELD:
        fd, ckpt = _HELD.pop()
        os.close(fd)  # drops this process's shared hold
        if (ckpt / PRUNE_OWED).exists():
            _delete(ckpt)


def _delete(ckpt: Path) -> bool:
    """Delete checkpoint `ckpt` unless a reader holds it (resolve_held); whether it went."""
    fd = _claim(ckpt)
    if fd is None:
        with contextlib.suppress(OSError):  # owed: the last reader to let go deletes it
            (ckpt / PRUNE_OWED).touch()
        fd = _claim(ckpt)  # a reader that let go before the mark went without seeing it
        if fd is None:
            return False
    shutil.rmtree(ckpt, ignore_errors=True)
    if fd >= 0:
        os.close(fd)
    return True


def _claim(ckpt: Path) -> int | None:
    """An fd holding `ckpt`'s meta.json exclusively, to delete it under (a reader waiting for
    its hold then finds it gone), or None when a reader holds it (resolve_held). -1: nothing
    to lock (no meta.json, or a filesystem without flock, where no reader can hold it either)."""
    try:
        fd = os.open(ckpt / "meta.json", os.O_RDONLY)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        return -1


def lineage(meta: dict, hops: int = 8) -> list[tuple[Path, dict | None]]:
    """Where a checkpoint's weights came from, nearest first, each with its meta.json when it
    is a fitgpt checkpoint (None for a Hugging Face folder or file): its --init-from source and
    the folder `fitgpt import hf` read, then theirs, through every fitgpt checkpoint on the way
    (`hops` at most: a chain of fine-tunes). A link that is gone or damaged ends the walk."""
    found: list[tuple[Path, dict | None]] = []
    while hops > 0:
        hops -= 1
        links = [meta.get("init_from"), (meta.get("imported_from") or {}).get("path")]
        seen = {p for p, _ in found}
        new = [Path(p) for p in links if isinstance(p, str) and p and Path(p) not in seen]
        nxt = None
        for p in new:
            try:
                source = verify(p) if (p / "meta.json").is_file() else None
            except CorruptCheckpoint:
                source = None
            found.append((p, source))
            nxt = nxt or source
        if nxt is None:
            break
        meta = nxt
    return found


def sources(meta: dict) -> list[Path]:
    """The paths of `lineage`: the models a checkpoint came from, nearest first."""
    return [p for p, _ in lineage(meta)]


def previous_good(ckpt: Path) -> Path | None:
    for p in reversed(step_dirs(ckpt.parent)):
        if p.name < ckpt.name:
            try:
                verify(p)
                return p
            except CorruptCheckpoint:
                continue
    return None


@contextlib.contextmanager
def pointing_back(ckpt: Path):
    """CorruptCheckpoint raised inside gets the previous good checkpoint appended, in one line."""
    try:
        yield
    except CorruptCheckpoint as e:
        prev = previous_good(ckpt)
        hint = (
            f"; the previous good checkpoint is {prev}: resume from it with --resume {prev}"
            if prev
            else ""
        )
        raise CorruptCheckpoint(f"{e}{hint}".replace("\n", " ")) from None


def load_meta(ckpt: Path, node: int | None = None) -> dict:
    """verify() with a message that points at the previous good checkpoint when there is one."""
    with pointing_back(ckpt):
        return verify(ckpt, node)


def check_layout(meta: dict, layout: list[ChunkSpec], ckpt: Path) -> None:
    """The layout recorded in meta must be the one of the model its config describes."""
    try:
        saved = [ChunkSpec.from_dict(d) for d in meta["layout"]]
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpoint(f"{ckpt}/meta.json: its layout is malformed ({e})") from None
    if saved != list(layout):
        names = {c.name for c in saved}
        split = [c for c in layout if c.name.endswith(".experts") and c.name not in names]
        if split and _slots(saved) == _slots(layout):
            # the same parameters cut into other chunks: a mixture of experts' sparse block was
            # one chunk until the experts became chunks of their own (engine/layout.py)
            raise CorruptCheckpoint(
                f"{ckpt}/meta.json: its chunks are an older fitgpt's (a sparse block's experts "
                "in the block's chunk); import the model again, or resume with that fitgpt"
            )
        raise CorruptCheckpoint(
            f"{ckpt}/meta.json: its chunk layout does not match the model it describes"
        )


def _slots(layout: list[ChunkSpec]) -> set[tuple[str, tuple[int, ...]]]:
    return {(s.name, tuple(s.shape)) for c in layout for s in c.slots}


def holds_optimizer(meta: dict) -> bool:
    """False for a weights-only checkpoint (`--save-optimizer none`, or an imported model)."""
    return meta.get("optimizer_state", True) is not False


def load_state(
    ckpt: Path, meta: dict, engine: Engine, ctx: DistContext, weights_only: bool = False
) -> None:
    """The engine's weights (and optimizer state, when the checkpoint holds it and a run is
    resumed rather than started from it: `weights_only`) and this rank's RNG state, every file
    checked; damage ends in the one-line previous-good message."""
    with pointing_back(ckpt):
        check_layout(meta, engine.layout, ckpt)
        optimizer = holds_optimizer(meta) and not weights_only
        engine.load_state(ckpt, meta.get("engine_state", {}), optimizer=optimizer)
        if meta["world"] == ctx.world and not weights_only:
            load_rng(ckpt, ctx.rank)


def load_rng(ckpt: Path, rank: int) -> None:
    f = ckpt / f"rng-r{rank:03d}.pt"
    if not f.exists():
        return
    try:
        state = torch.load(f, weights_only=True)
        set_rng_state(state)
    except Exception as e:  # an unpicklable or wrong-typed file (checksums make this rare)
        raise CorruptCheckpoint(f"{f} is unreadable ({type(e).__name__})") from None


# ---- writing ------------------------------------------------------------------------------
def clean_stale(run_dir: Path) -> None:
    """Leftovers of a save that was killed: a `.tmp` folder is never valid and goes; an `.old`
    folder is a complete checkpoint set aside for a re-save of its step, and goes back if the
    new one never arrived. Run by rank 0 while it holds the run folder's lock."""
    for old in run_dir.glob(".step_*.old"):
        final = run_dir / old.name[1:-4]
        if not final.exists() and (old / "meta.json").is_file():
            os.replace(old, final)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in run_dir.glob(".step_*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def _maybe_inject_fault(rank: int, step: int) -> None:
    """FITGPT_SAVE_FAULT=RANK:STEP:KIND fails one rank's save after its state files are written:
    enospc/eio raise that OSError, error a RuntimeError, die ends the process (a kill)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    r, s, kind = spec.split(":")
    if int(r) != rank or int(s) != step:
        return
    if kind == "die":
        os._exit(17)
    if kind in ("enospc", "eio"):
        code = errno.ENOSPC if kind == "enospc" else errno.EIO
        raise OSError(code, os.strerror(code) + " (injected)")
    raise RuntimeError("injected save failure")


def _write_files(tmp: Path, step: int, engine: Engine, ctx: DistContext, optimizer: bool):
    """This rank's files; the exception that stopped them, or None."""
    try:
        engine.save_state(tmp, optimizer=optimizer)
        _maybe_inject_fault(ctx.rank, step)
        torch.save(rng_state(), tmp / f"rng-r{ctx.rank:03d}.pt")
    except (Exception, KeyboardInterrupt) as e:
        return e
    return None


def _publish(
    run_dir: Path, tmp: Path, final: Path, meta: dict, keep: int, files: dict | None = None
) -> None:
    """Rank 0 (node-local: each node's first rank): meta.json last, then the rename; an existing
    folder of the same step (a re-save after a resume) is set aside first and deleted only once
    the new one is in place."""
    write_meta(tmp, meta, files)
    old = run_dir / f".{final.name}.old"
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old.exists():
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):  # the checkpoint now says what the run is
        (run_dir / RECORD_NAME).unlink()
    prune(run_dir, keep)


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (rank 0), but for those a reader holds
    (resolve_held), which go at a later save or when their last reader exits."""
    for stale in step_dirs(run_dir)[:-keep]:
        _delete(stale)


def save(
    run_dir: Path,
    step: int,
    engine: Engine,
    meta: dict,
    ctx: DistContext,
    keep: int,
    optimizer: bool = True,
    explain=None,
    node_local: bool = False,
) -> Path:
    """Write step_XXXXXXXX (weights only when optimizer=False; node_local: into each machine's
    own `run_dir`, the module docstring says how). On failure in any rank the temporary folder
    is removed and SaveFailed raised in every rank; `explain(cause, error)` gives the sentence
    that follows the cause (sizes, free space, options)."""
    final = run_dir / f"step_{step:08d}"
    tmp = run_dir / f".step_{step:08d}.tmp"
    failure: BaseException | None = None
    leader = leads_folder(ctx, node_local)  # makes, names, cleans the folder
    try:
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save are never valid
            tmp.mkdir(parents=True)
    except OSError as e:
        failure = e
    label = f"checkpoint {final.name}"
    try:
        if all_ok(ctx, failure is None, f"{label}: folder made"):
            failure = _write_files(tmp, step, engine, ctx, optimizer)
        wrote = all_ok(ctx, failure is None, f"{label}: every rank wrote its files")
        full = files = None
        if wrote and ctx.is_main:
            full = {
                "step": step,
                "world": ctx.world,
                "device": ctx.device.type,  # a resume on another device says so
                "optimizer_state": optimizer,
                "layout": [c.to_dict() for c in engine.layout],
                "engine_state": engine.extra_state(),
                **meta,
            }
        if wrote and node_local:  # rank 0's meta and every node's files, to every node
            full, files = _node_listings(tmp, full, ctx, leader)
        if wrote and leader:
            try:
                _publish(run_dir, tmp, final, full, keep, files)
            except (Exception, KeyboardInterrupt) as e:
                failure = e
        ok = all_ok(ctx, failure is None, f"{label}: rank 0 renamed it")
    except CollectiveError:
        if leader:  # a dead rank writes nothing more: the partial folder can go
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if ok:
        return final
    if leader:
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(failure, KeyboardInterrupt):
        raise failure
    raise _failed(run_dir, final, failure, explain) from failure


def _node_listings(tmp: Path, full: dict | None, ctx: DistContext, leader: bool):
    """(rank 0's meta with `nodes`, every node's files merged): each node's first rank lists
    its folder, and one all_gather_object brings the lists and rank 0's meta to every rank
    (a few KB: the names, sizes and small files' SHA-256)."""
    mine = (node_of_rank(), listing(tmp) if leader else None, full)
    every: list = [mine]
    if ctx.distributed:
        every = [None] * ctx.world
        dist.all_gather_object(every, mine, group=ctx.group)
    files: dict = {"files": {}, "file_sha256": {}}
    where: dict[str, int] = {}
    for node, lst, _ in every:
        if lst is None:
            continue
        for key in files:
            files[key].update(lst[key])
        where.update(dict.fromkeys(lst["files"], node))
    files["files"] = dict(sorted(files["files"].items()))
    files["file_sha256"] = dict(sorted(files["file_sha256"].items()))
    per, count = node_shape(ctx.world)
    nodes = {"count": count, "per_node": per, "files": dict(sorted(where.items()))}
    return {**every[0][2], "nodes": nodes}, files


def is_disk_full(e: BaseException | None) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)  # safetensors wraps the OS error in its own type
    return "No space left" in text or "StorageFull" in text or "os error 28" in text


def _failed(run_dir: Path, final: Path, e: BaseException | None, explain) -> SaveFailed:
    if e is None:
        cause = "another rank failed to write its files (see its message)"
    elif is_disk_full(e):
        cause = "the disk is full (No space left on device)"
    elif isinstance(e, OSError):
        cause = f"{e.strerror or e} ({getattr(e, 'filename', None) or run_dir})"
    else:
        cause = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    earlier = [p for p in step_dirs(run_dir) if p != final]
    kept = (
        f"the earlier checkpoints are kept (newest {earlier[-1]}: resume from it with --resume)"
        if earlier
        else "there is no earlier checkpoint"
    )
    detail = explain(cause, e) if explain else ""
    return SaveFailed(
        f"checkpoint {final} could not be written: {cause}; {detail}the partial folder was "
        f"removed and {kept}"
    )
