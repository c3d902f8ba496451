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
    from fitgpt.cli.args import add_node_args

    add_node_args(p, "probe")  # started on every node, it also measures the link between them
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
    from fitgpt.dist.nodes import Nodes

    nodes = Nodes.of(args, args.gpus)  # a bad node flag refused before any measurement
    if args.gpus is not None:
        if args.gpus < 1:
            raise UserError(f"--gpus {args.gpus} must be at least 1")
        from fitgpt.cli.args import LAUNCH_FLAGS
        from fitgpt.dist.launch import relaunch, strip_flag

        argv = sys.argv[1:]
        for flag in LAUNCH_FLAGS:  # torchrun's, not the ranks'
            argv = strip_flag(argv, flag)
        return relaunch(args.gpus, argv, nodes=nodes)
    from fitgpt.dist import init_distributed, shutdown
    from fitgpt.plan.rates import probe

    ctx = init_distributed()
    try:
        probe(args.nvme, log=print if ctx.is_main else (lambda *_: None))
    finally:
        shutdown(ctx)
    return 0
