"""`fitgpt probe`: measure this machine's rates for the planner (under a minute) and cache them."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "probe", help="measure GPU, PCIe, CPU-optimizer and disk rates for the planner"
    )
    p.add_argument("--nvme", default="", help="also measure the disk holding this folder")
    p.set_defaults(func=run)


def run(args) -> int:
    import os

    from fitgpt.errors import UserError
    from fitgpt.plan.rates import probe

    if args.nvme and not os.path.isdir(args.nvme):
        raise UserError(
            f"--nvme {args.nvme}: not a folder; pass an existing folder on the disk to measure"
        )
    probe(args.nvme)
    return 0
