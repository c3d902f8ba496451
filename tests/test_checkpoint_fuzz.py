"""Checkpoint damage fuzz: every kind of damage to every file is refused in one line that names
the previous good checkpoint by the resume path, which reads every byte; generate/export's path
reads the weights only, and refuses every damage to what it reads: a damaged optimizer moment,
which it does not read, leaves it loading exactly the weights of the undamaged checkpoint.

One run writes two checkpoints; each case copies the run, damages its newest checkpoint and
loads it in-process through the functions `fitgpt train --resume` and `fitgpt generate` use.
"""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_config, train

from fitgpt.dist import DistContext
from fitgpt.engine.factory import build_engine
from fitgpt.engine.state_io import CorruptCheckpoint
from fitgpt.infer.generate import load_model
from fitgpt.train import checkpoint as ckpt_io

CPU = DistContext(0, 1, 0, torch.device("cpu"))
GOOD, VICTIM = "step_00000001", "step_00000002"


def flip_bit(data: bytes, rng: random.Random, lo: int = 0, hi: int | None = None) -> bytes:
    b = bytearray(data)
    i = rng.randrange(lo, min(hi or len(b), len(b)))
    b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def edit_json(path: Path, change) -> None:
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj, indent=1))


def shift_offset(meta):
    meta["layout"][1]["slots"][0][2] += 4  # a parameter's offset in its chunk


def swap_slots(meta):
    slots = meta["layout"][1]["slots"]
    slots[0][2], slots[1][2] = slots[1][2], slots[0][2]


def change_range(index):
    index[0]["hi"] -= 1


DAMAGES = {
    "truncate": lambda d, r: d[: r.randrange(len(d))],
    "truncate-1": lambda d, r: d[:-1],
    "flip-any": lambda d, r: flip_bit(d, r),
    "flip-head": lambda d, r: flip_bit(d, r, 0, 96),
    "flip-tail": lambda d, r: flip_bit(d, r, max(0, len(d) - 64)),
    "zero-run": lambda d, r: (lambda i: d[:i] + bytes(16) + d[i + 16 :])(r.randrange(len(d))),
    "append": lambda d, r: d + b"\x00" * r.randrange(1, 9),
    "not-utf8": lambda d, r: b"\xff\xfe" + d[2:],
    "garbage": lambda d, r: bytes(r.randrange(256) for _ in range(len(d))),
    "empty": lambda d, r: b"",
}
FILES = [
    "meta.json",
    "index-r000.json",
    "rng-r000.pt",
    "c0000-r000.safetensors",
    "c0001-r000.safetensors",
    "c0002-r000.safetensors",
    "c0003-r000.safetensors",
]


def cases():
    out = [(f, kind, seed) for f in FILES for kind in DAMAGES for seed in (0, 1)]
    out += [(f, "delete", 0) for f in FILES if f != "meta.json"]
    out += [("meta.json", "shift-offset", 0), ("meta.json", "swap-slots", 0)]
    out += [("meta.json", "step", 0), ("index-r000.json", "range", 0)]
    out += [("c0001-r000.safetensors", "swap-with-c0002", 0)]
    return out


def damage(ckpt: Path, name: str, kind: str, seed: int) -> None:
    f = ckpt / name
    if kind == "delete":
        f.unlink()
    elif kind == "shift-offset":
        edit_json(f, shift_offset)
    elif kind == "swap-slots":
        edit_json(f, swap_slots)
    elif kind == "step":
        edit_json(f, lambda m: m.update(step=m["step"] + 1))
    elif kind == "range":
        edit_json(f, change_range)
    elif kind.startswith("swap-with-"):
        other = ckpt / name.replace("c0001", kind.split("-")[-1])
        a, b = f.read_bytes(), other.read_bytes()
        f.write_bytes(b)
        other.write_bytes(a)
    else:
        before = f.read_bytes()
        after = DAMAGES[kind](before, random.Random(f"{name}/{kind}/{seed}"))
        if after == before:  # e.g. garbage equal to the original: not a damage
            after = flip_bit(before, random.Random(seed))
        f.write_bytes(after)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run = tmp_path_factory.mktemp("fuzz") / "run"
    cfg = run_config(run, steps=2, save_every=1, keep=2, engine="zero", zero_stage=1)
    train(cfg, CPU)
    engine = build_engine(cfg.model, cfg.engine, cfg.precision, cfg.optim, CPU, seed=0)
    return run, engine


def load(path: str, ckpt: Path, engine) -> dict | None:
    if path == "resume":  # as Trainer.resume
        meta = ckpt_io.load_meta(ckpt)
        ckpt_io.load_state(ckpt, meta, engine, CPU)
        return None
    model, _ = load_model(ckpt, torch.device("cpu"))  # as generate and export
    return model.state_dict()


def test_at_least_100_damages_all_refused_in_one_line(saved, tmp_path):
    run, engine = saved
    all_cases = cases()
    assert len(all_cases) >= 100
    assert sorted(p.name for p in (run / VICTIM).iterdir()) == sorted(FILES)
    reference, _ = load_model(run / VICTIM, torch.device("cpu"))
    reference = reference.state_dict()
    problems, refused, unread = [], 0, 0
    for i, (name, kind, seed) in enumerate(all_cases):
        case = tmp_path / f"case{i}"
        shutil.copytree(run, case)
        damage(case / VICTIM, name, kind, seed)
        for path in ("resume", "generate"):
            where = f"{name} {kind} {seed} via {path}"
            try:
                weights = load(path, case / VICTIM, engine)
                same = weights is not None and all(
                    torch.equal(weights[k], v) for k, v in reference.items()
                )
                if not (same and name.endswith(".safetensors")):
                    problems.append(f"{where}: loaded without a word")
                unread += 1
            except CorruptCheckpoint as e:
                msg = str(e)
                if "\n" in msg or f"previous good checkpoint is {case / GOOD}" not in msg:
                    problems.append(f"{where}: {msg}")
                refused += 1
            except Exception as e:  # a traceback for the user
                problems.append(f"{where}: {type(e).__name__}: {e}")
        shutil.rmtree(case)
    assert not problems, "\n".join(problems)
    assert refused + unread == 2 * len(all_cases) and refused >= 100 + len(all_cases)
    print(f"{len(all_cases)} damages: {refused} refusals, {unread} damaged moments not read")


def test_the_undamaged_checkpoint_loads_through_the_same_paths(saved):
    run, engine = saved
    meta = ckpt_io.load_meta(run / VICTIM)
    ckpt_io.load_state(run / VICTIM, meta, engine, CPU)
    model, _ = load_model(run / VICTIM, torch.device("cpu"))
    for (n, p), q in zip(model.named_parameters(), engine.inference_model().parameters()):
        torch.testing.assert_close(p, q, msg=n)


def rewrite_meta(ckpt: Path, change) -> None:
    """Edit meta.json and give it a valid checksum again, as a deliberate edit would."""
    meta = json.loads((ckpt / "meta.json").read_text())
    for key in ("format", "version", "files", "file_sha256", "checksum"):
        meta.pop(key)
    change(meta)
    ckpt_io.write_meta(ckpt, meta)


def test_a_layout_edited_with_a_valid_checksum_still_cannot_load(saved, tmp_path):
    run, engine = saved
    shutil.copytree(run, tmp_path / "run")
    ckpt = tmp_path / "run" / VICTIM
    rewrite_meta(ckpt, shift_offset)
    ckpt_io.verify(ckpt)  # the checksum is right
    for path in ("resume", "generate"):
        with pytest.raises(CorruptCheckpoint, match="layout does not match the model"):
            load(path, ckpt, engine)


def test_a_version_1_checkpoint_without_checksums_still_loads(saved, tmp_path):
    run, engine = saved
    shutil.copytree(run, tmp_path / "run")
    ckpt = tmp_path / "run" / VICTIM
    meta = json.loads((ckpt / "meta.json").read_text())
    for key in ("file_sha256", "checksum"):
        meta.pop(key)
    meta["version"] = 1
    (ckpt / "meta.json").write_text(json.dumps(meta))
    load("resume", ckpt, engine)
    load("generate", ckpt, engine)
