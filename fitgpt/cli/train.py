"""`fitgpt train`: build a RunConfig from a preset plus flags, and run the training loop."""

from __future__ import annotations

import argparse
import sys

from fitgpt.cli.args import add_config_args, config_from_args, explicit
from fitgpt.data.config import DataConfig
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, get_preset
from fitgpt.train.config import TrainConfig


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of a run (shared by `train`, `plan` and the benchmark harness)."""
    p.add_argument(
        "--preset",
        default="tiny",
        help="named model config (see `fitgpt presets`); "
        "the model flags below override its fields (default: tiny)",
    )
    add_config_args(
        p.add_argument_group("model"),
        ModelConfig,
        defaults=get_preset("tiny"),
        default_text="from --preset; tiny: {}",
    )
    add_config_args(p.add_argument_group("data"), DataConfig, defaults=DataConfig(data="stdlib"))
    add_config_args(p.add_argument_group("training"), TrainConfig)
    add_config_args(
        p.add_argument_group(
            "engine and memory (with --plan auto, the planner chooses what you do not set)"
        ),
        EngineConfig,
        planned_text="the planner's choice; with --plan off: {}",
    )
    add_config_args(p.add_argument_group("precision"), PrecisionConfig)
    add_config_args(p.add_argument_group("optimizer"), OptimConfig)


def run_config_from_args(args: argparse.Namespace):
    from fitgpt.train.loop import RunConfig

    data = config_from_args(
        args, DataConfig, DataConfig(data="stdlib") if args.data is None else None
    )
    return RunConfig(
        model=config_from_args(args, ModelConfig, get_preset(args.preset)),
        data=data,
        train=config_from_args(args, TrainConfig),
        engine=config_from_args(args, EngineConfig),
        precision=config_from_args(args, PrecisionConfig),
        optim=config_from_args(args, OptimConfig),
    )


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a GPT model",
        description="Train a GPT model. With no flags: the tiny preset on the Python standard "
        "library's source, on the GPU if there is one. Runs under torchrun for several GPUs or "
        "machines; --gpus N starts torchrun on this machine.",
    )
    add_run_args(p)
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="CKPT",
        help="continue from a checkpoint folder, or (no value) from the newest in --out",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete --out's checkpoints and start over"
    )
    p.add_argument(
        "--gpus", type=int, default=None, help="start torchrun with N processes on this machine"
    )
    p.add_argument(
        "--plan",
        choices=["auto", "off"],
        default="auto",
        help="auto: the planner chooses the engine fields you did not set, and refuses a run "
        "predicted not to fit before allocating anything; off: use the flags as given "
        "(default: auto)",
    )
    p.add_argument(
        "--force", action="store_true", help="train even if the planner predicts it will not fit"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.gpus is not None:
        if args.gpus < 1:
            raise UserError(f"--gpus {args.gpus} must be at least 1")
        from fitgpt.dist.launch import relaunch, strip_flag

        argv = strip_flag(sys.argv[1:], "--gpus")
        return relaunch(args.gpus, argv)
    run_cfg = run_config_from_args(args)  # validates every config before anything is allocated
    # [cli helper, issue 21] the run folder can be written; CPU runs use only the idle cores
    from fitgpt.cli.outputs import check_writable_dir
    from fitgpt.dist.threads import set_cpu_threads

    check_writable_dir(run_cfg.train.out, "--out")
    set_cpu_threads(run_cfg.train.device)
    from fitgpt.dist import init_distributed, shutdown
    from fitgpt.train.loop import train

    ctx = init_distributed(run_cfg.train.device, run_cfg.train.dist_timeout)
    try:
        if args.plan == "auto":
            from fitgpt.plan.apply import plan_engine

            def log(msg: str) -> None:
                if ctx.is_main:
                    print(msg, flush=True)

            run_cfg = plan_engine(run_cfg, ctx, explicit(args, EngineConfig), args.force, log)
        train(run_cfg, ctx, resume=args.resume, overwrite=args.overwrite)
    finally:
        shutdown(ctx)
    return 0
