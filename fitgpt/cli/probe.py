"""`fitgpt probe`: measure this machine's rates for the planner (under a minute) and cache them."""

from __future__ import annotations

import os
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "probe", help="measure GPU, PCIe, CPU-optimizer, disk and collective rates for the planner"
    )
    p.add_argument("--nvme", default="", help="also measure the disk holding this folder")
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="also measure all-gather/reduce-scatter bandwidth across N GPUs (starts torchrun)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from fitgpt.errors import UserError
    from fitgpt.paths import check_writable_dir
    from fitgpt.plan.rates import cache_path

    if args.nvme and not os.path.isdir(args.nvme):
        raise UserError(
            f"--nvme {args.nvme}: not a folder; pass an existing folder on the disk to measure"
        )
    if args.nvme:
        check_writable_dir(args.nvme, "--nvme")  # the disk test writes a file there
    # the rates are cached here at the end: refuse now, not after the measurements
    check_writable_dir(cache_path("").parent, "the probe cache (FITGPT_CACHE)")
    if args.gpus is not None:
        if args.gpus < 1:
            raise UserError(f"--gpus {args.gpus} must be at least 1")
        from fitgpt.dist.launch import relaunch, strip_flag

        return relaunch(args.gpus, strip_flag(sys.argv[1:], "--gpus"))
    from fitgpt.dist import init_distributed, shutdown
    from fitgpt.plan.rates import probe

    ctx = init_distributed()
    try:
        probe(args.nvme, log=print if ctx.is_main else (lambda *_: None))
    finally:
        shutdown(ctx)
    return 0
