"""`fitgpt matmul`: C = A·B for two n×n matrices across GPUs, or beyond one GPU's memory.

    fitgpt matmul --n 50000 --gpus 2                     # rows layout on 2 GPUs (spawns torchrun)
    torchrun --nproc-per-node 4 -m fitgpt matmul --layout 2d --matrix-size 50000
    fitgpt matmul --n 100000 --out-of-core               # one GPU, A and B in host memory

Prints a short table on rank 0 and exits 1 when the built-in verification fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from fitgpt.cli.args import add_config_args, explicit
from fitgpt.dist.context import init_distributed, shutdown, under_torchrun
from fitgpt.errors import UserError
from fitgpt.matmul.config import MatmulConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "matmul",
        help="multiply two n×n matrices across GPUs or out of core, verified",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p, MatmulConfig)
    # torchrun's own parser reads any prefix of its options, even after the script name, so
    # `torchrun ... -m fitgpt matmul --n 50000` fails as an ambiguous --nnodes/--nproc-per-node.
    p.add_argument(
        "--matrix-size",
        dest="n",
        type=int,
        default=None,
        metavar="N",
        help="the same as --n; use this spelling under torchrun",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="launch N processes (one per GPU) with torchrun; leave out when under torchrun",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", "0"))
    try:
        return _run(args)
    except UserError:
        if rank != 0:
            return 2  # every rank hit the same error; rank 0 says it once
        raise


def check_outputs(cfg: MatmulConfig, json_path: str | None) -> None:
    """C's .npy and the JSON record can be written: checked before anything is computed."""
    from fitgpt.paths import check_writable_file

    if cfg.out is not None:
        check_writable_file(cfg.out, "--out")
    if json_path is not None:
        check_writable_file(json_path, "--json")


def _run(args: argparse.Namespace) -> int:
    check_outputs(config_from(args), args.json)
    if args.gpus is not None:
        if args.gpus < 1:
            raise UserError(f"--gpus {args.gpus}: must be at least 1")
        if under_torchrun():
            if args.gpus != int(os.environ["WORLD_SIZE"]):
                raise UserError(
                    f"--gpus {args.gpus}: torchrun started {os.environ['WORLD_SIZE']} processes; "
                    "drop --gpus under torchrun"
                )
        elif args.gpus > 1:
            _check_world(config_from(args), args.gpus)  # refuse here, not in N tracebacks
            return launch(args)
    cfg = config_from(args)
    # Imported here so that `fitgpt --help` does not pay for the module's imports.
    from fitgpt.matmul.report import table, write_json
    from fitgpt.matmul.run import run_matmul

    ctx = init_distributed()
    try:
        result = run_matmul(cfg, ctx)
    finally:
        shutdown(ctx)
    if ctx.is_main:
        print(table(result), flush=True)
        if args.json:
            write_json(args.json, result.record())
        if not result.passed:
            v = result.verify
            print(
                f"fitgpt matmul: verification FAILED: Freivalds {v['freivalds']:.2e}, sampled "
                f"{v['sampled']:.2e} > tolerance {v['tolerance']:.0e}",
                file=sys.stderr,
            )
    return 0 if result.passed else 1


def config_from(args: argparse.Namespace) -> MatmulConfig:
    """The config of the flags; --n defaults to the size of the .npy operands when given."""
    from fitgpt.matmul.operands import npy_shape, operands

    changes = explicit(args, MatmulConfig)
    if "n" not in changes:
        # n is the files' size; with two files of different sizes neither is "the" n, so the
        # mismatch is told here, naming both, not later as a clash with an --n nobody typed.
        given = [(f, p) for f, p in (("--a", args.a_path), ("--b", args.b_path)) if p is not None]
        sizes = [(f, p, npy_shape(p, f)[0]) for f, p in given]
        if len({n for _, _, n in sizes}) > 1:
            (fa, pa, na), (fb, pb, nb) = sizes
            raise UserError(
                f"{fb} {pb}: {nb}×{nb} does not match {fa} {pa} ({na}×{na}); give two n×n "
                "matrices of one size"
            )
        if sizes:
            changes["n"] = sizes[0][2]
    cfg = MatmulConfig(**changes)
    operands(cfg)  # the files' headers against --n: refused before the reference GEMM runs
    return cfg


def _check_world(cfg: MatmulConfig, world: int) -> None:
    from fitgpt.matmul.summa import grid_side

    if cfg.out_of_core:
        raise UserError(f"--out-of-core runs on one GPU; drop --gpus {world}")
    if cfg.layout == "2d":
        grid_side(world)


def forwarded_flags(args: argparse.Namespace) -> list[str]:
    """The explicitly given flags, spelled again for the processes torchrun starts."""
    out = []
    for f in dataclasses.fields(MatmulConfig):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        flag = "--" + f.metadata.get("flag", f.name).replace("_", "-")
        flag = "--matrix-size" if flag == "--n" else flag
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    if args.json:
        out += ["--json", args.json]
    return out


def launch(args: argparse.Namespace) -> int:
    """Run this command again under torchrun with --gpus processes; its exit status is ours."""
    from fitgpt.dist.launch import relaunch

    return relaunch(args.gpus, ["matmul", *forwarded_flags(args)])
