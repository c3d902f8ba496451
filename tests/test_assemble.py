"""The run is assembled once (train/assemble.py): the command line read once into Settings,
settled (sized, resolved, validated) once for the job's ranks, handed to a launcher's ranks
as it is, and a Run whose parts the trainer and the engines take as given."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import TINY, run_config

from fitgpt.cli import build_parser
from fitgpt.cli.train import HANDED, asked_by, handed_over
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.errors import UserError
from fitgpt.train.assemble import Settings, assemble, settle

CPU = DistContext(0, 1, 0, torch.device("cpu"))
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--device", "cpu"]


def parse(*flags: str):
    return build_parser().parse_args(["train", "--data", "synthetic", *SMALL, *flags])


def test_settled_settings_are_validated_once_and_then_taken_as_given(tmp_path):
    """A run settled for these ranks is not settled again: a rank handed settled settings
    does not redo the launcher's validation (here a setting it would refuse shows it)."""
    fp16 = run_config(tmp_path, precision="fp16")  # refused on a CPU (plan/validate.py)
    with pytest.raises(UserError, match="fp16 on a CPU"):
        assemble(Settings(fp16), CPU)
    run = assemble(Settings(fp16, settled=(1, "cpu")), CPU)
    assert run.config.precision.precision == "fp16" and run.ctx is CPU
    # settled for other ranks: settled again, for these
    with pytest.raises(UserError, match="fp16 on a CPU"):
        assemble(Settings(fp16, settled=(2, "cpu")), CPU)


def test_the_run_has_its_vocabulary_precision_and_compile_settled(tmp_path):
    run = run_config(tmp_path, data="stdlib", tokenizer="bytes", precision="auto", compile="auto")
    assert run.model.vocab_size == TINY.vocab_size and run.precision.precision == "auto"
    settled = assemble(Settings(run), CPU).config
    assert settled.model.vocab_size == 256  # the bytes tokenizer's
    assert settled.precision.precision == "fp32"  # auto on a CPU
    assert settled.engine.compile == "off"  # auto, unplanned, on a CPU


def test_a_launchers_settings_reach_its_ranks_as_settled(tmp_path, monkeypatch):
    """`fitgpt train --gpus N` settles in the launcher and hands the result to its ranks
    (cli/train.py HANDED): what a rank reads back is what was settled, plan, typed flags and
    DeepSpeed notes included, and only under torchrun."""
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    )
    args = parse("--engine", "zero", "--precision", "bf16", "--master", "split",
                 "--deepspeed-config", str(ds), "--out", str(tmp_path / "run"))  # fmt: skip
    settings = settle(asked_by(args), 2, "cpu")
    assert settings.config.train.grad_accum == 2 and settings.typed["master"] == "split"
    monkeypatch.setenv(HANDED, json.dumps(settings.to_dict()))
    assert handed_over() is None  # not a rank of a torchrun job: it settles its own
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert handed_over() == settings


def test_the_command_line_is_read_not_written(tmp_path):
    """A DeepSpeed config's keys and the block shares reach the run (and the planner's fixed
    fields) without being written back into the parsed command line."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"gradient_accumulation_steps": 3}))
    args = parse("--engine", "zero", "--offload-optimizer", "cpu", "--offload-fraction", "0.5",
                 "--deepspeed-config", str(ds))  # fmt: skip
    before = dict(vars(args))
    settings = asked_by(args)
    assert vars(args) == before
    assert settings.config.train.grad_accum == 3 and settings.config.engine.offload_blocks == 1
    fixed = settings.fixed.as_dict()
    assert fixed["offload_blocks"] == 1 and "nvme_blocks" not in fixed
    assert "offload_fraction" in settings.typed and "offload_blocks" not in settings.typed


def test_an_engine_takes_the_ranks_as_laid_out():
    """The mesh is the run's (train/assemble.py lays it out once): an engine builds none, and
    refuses a context laid out for another T or C."""
    ecfg = EngineConfig(engine="ddp", tensor_parallel=2)
    with pytest.raises(ValueError, match="laid out for --tensor-parallel 1"):
        build_engine(TINY, ecfg, PrecisionConfig("fp32"), OptimConfig(), CPU)
    e = build_engine(TINY, dataclasses.replace(ecfg, tensor_parallel=1),
                     PrecisionConfig("fp32"), OptimConfig(), CPU)  # fmt: skip
    assert e.ctx is CPU
    e.close()
