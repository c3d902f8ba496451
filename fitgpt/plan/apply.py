"""`--plan auto`: let the planner fill in the engine fields the user did not set."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from fitgpt.dist import DistContext
from fitgpt.plan import hardware, rates
from fitgpt.plan.memory import GiB, Workload
from fitgpt.plan.planner import choose, why


def plan_engine(run, ctx: DistContext, fixed: dict, force: bool, log=print):
    """`run` with its EngineConfig replaced by the planner's choice (fields in `fixed` kept).

    Rank 0 decides and broadcasts, so every rank of a multi-machine job runs the same plan even
    when their free memory differs. Refuses (UserError) before anything is allocated when the
    plan cannot fit, unless `force`.
    """
    decision = [None]
    if ctx.is_main:
        hw = hardware.detect(
            gpus=ctx.world, device=ctx.device.type, nvme=run.engine.nvme_path or None
        )
        prec = run.precision.resolved(ctx.device.type).precision
        work = Workload(run.model, run.train.micro_batch, ctx.world, prec, ctx.device.type)
        r = rates.load(hw.gpu_name)
        fixed = {**fixed, "nvme_path": run.engine.nvme_path}
        try:
            chosen, cands = choose(work, run.train.grad_accum, hw, r, fixed, force)
            decision[0] = (dataclasses.asdict(chosen.ecfg), None)
            mem = chosen.est.compute_total if chosen.est.compute else chosen.est.host_total
            log(
                f"plan: {chosen.name} (predicted {mem / GiB:.1f} GiB per rank, "
                f"{chosen.time['total']:.2f} s/step) — {why(chosen, cands)}"
            )
        except Exception as e:  # a refusal must reach every rank, not only rank 0
            decision[0] = (None, e)
    if ctx.distributed:
        dist.broadcast_object_list(decision, src=0, group=ctx.group)
    ecfg, err = decision[0]
    if err is not None:
        raise err
    from fitgpt.engine.config import EngineConfig

    return dataclasses.replace(run, engine=EngineConfig(**ecfg))
