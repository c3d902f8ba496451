"""A sweep: every (system, size) pair as a short real training run in its own process.

Results are appended to a JSON-lines file as each trial ends (flushed and fsynced), so an
interrupted sweep keeps what it finished and a re-run skips what is already recorded. Sizes run
from small to large; the first size a system fails at ends that system's line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from fitgpt import units
from fitgpt.bench.config import BenchConfig
from fitgpt.bench.systems import get_system
from fitgpt.dist.env import child_env
from fitgpt.dist.launch import command

# soft_wrap: whole lines, never cut at the console's width (80 columns when stderr is a pipe,
# `fitgpt bench ... 2>&1 | cat`), so a trial's line stays one line to read and to grep
console = Console(stderr=True, soft_wrap=True)


@dataclass(frozen=True)
class SweepSpec:
    systems: tuple[str, ...]
    sizes: tuple[int, ...]  # layer counts
    bench: BenchConfig
    gpus: int = 1
    device: str = "auto"
    cap_bytes: int = 0  # memory budget per rank (0: none), see fitgpt.bench.trial.apply_cap
    # seconds of wall time after which no trial is started that is predicted to end past it
    # (0: none); a later run of the same command resumes where this one stopped
    budget_s: float = 0.0


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write; the trial reruns
    return out


def append_result(path: Path, rec: dict) -> None:
    # a crash can cut the last line short: start a fresh line so this record stays whole
    cut = path.exists() and path.stat().st_size > 0 and path.read_bytes()[-1:] != b"\n"
    with open(path, "a") as f:
        f.write(("\n" if cut else "") + json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def merge_ranks(recs: list[dict]) -> dict:
    """Rank 0's timing; the worst status; memory as max (and sum) over ranks."""
    recs = sorted(recs, key=lambda r: r["rank"])
    out = dict(recs[0])
    order = ["error", "oom-host", "oom-gpu", "oom-cap", "refused", "ok"]
    worst = min(recs, key=lambda r: order.index(r["status"]) if r["status"] in order else 0)
    out["status"], out["reason"] = worst["status"], worst["reason"]
    if "gpu_peak_gib" in out:
        out["gpu_peak_gib"] = max(r.get("gpu_peak_gib", 0) for r in recs)
    out["host_rss_peak_gib"] = max(r["host_rss_peak_gib"] for r in recs)
    out["host_rss_total_gib"] = sum(r["host_rss_peak_gib"] for r in recs)
    out.pop("rank", None)
    return out


def run_one(spec: SweepSpec, system: str, layers: int, workdir: Path, cap_bytes: int = 0) -> dict:
    trial_spec = {
        "system": system,
        "layers": layers,
        "bench": spec.bench.to_dict(),
        "device": spec.device,
        "cap_bytes": cap_bytes,
    }
    spec_path, result = workdir / f"{system}-{layers}.json", workdir / f"{system}-{layers}.result"
    spec_path.write_text(json.dumps(trial_spec))
    for stale in workdir.glob(f"{result.name}.rank*"):
        stale.unlink()  # a previous attempt's per-rank results must not count for this one
    # the environment and command line of `fitgpt train --gpus N` (fitgpt.dist.launch)
    env = child_env(spec.gpus)
    cmd = command(spec.gpus, "fitgpt.bench.trial", [str(spec_path), str(result)])
    log = workdir / f"{system}-{layers}.log"
    t0 = time.time()
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=spec.bench.time_limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        except BaseException:
            # the sweep itself was stopped (Ctrl-C, SIGTERM from a wrapper's timeout): the trial
            # runs in its own session, so kill it too, or it would hold the GPU for the next run;
            # the unfinished trial is not recorded and a re-run does it again
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    ranks = [
        json.loads(p.read_text())
        for p in sorted(workdir.glob(f"{result.name}.rank*"))
        if not p.name.endswith(".tmp")
    ]
    base = {
        "system": system,
        "layers": layers,
        "hidden": spec.bench.hidden,
        "params": spec.bench.model(layers).num_params(),
        "world": spec.gpus,
        "bench": spec.bench.to_dict(),
        "wall_s": time.time() - t0,
    }
    if code is None:
        rec = {**base, "status": "timeout", "reason": f"killed after {spec.bench.time_limit:.0f} s"}
    elif ranks:
        rec = {**merge_ranks(ranks), "wall_s": base["wall_s"]}
        # the sweep's protocol is what resumes match on; an ablation's own change of it (no
        # gradient accumulation) is kept beside it
        rec["bench_effective"], rec["bench"] = rec["bench"], base["bench"]
        if len(ranks) < spec.gpus and rec["status"] == "ok":
            rec.update(status="error", reason=f"only {len(ranks)} of {spec.gpus} ranks reported")
    elif code in (-9, 137):
        rec = {
            **base,
            "status": "oom-host",
            "reason": "killed by SIGKILL (the kernel's OOM killer)",
        }
    else:
        tail = log.read_text()[-1500:]
        rec = {
            **base,
            "status": "error",
            "reason": f"exit code {code} and no result",
            "log_tail": tail,
        }
    return rec


def describe(rec: dict) -> str:
    size = f"L={rec['layers']} ({units.params(rec['params'])})"
    if rec["status"] != "ok":
        return f"{rec['system']:<20} {size:<18} {rec['status']}: {rec['reason'][:120]}"
    mem = f" GPU {rec['gpu_peak_gib']:.1f} GiB" if "gpu_peak_gib" in rec else ""
    rate = f" {units.tflops(rec['tflops'])}" if "tflops" in rec else ""  # none on a CPU trial
    return (
        f"{rec['system']:<20} {size:<18} ok {rec['step_s']:.2f} s/step "
        f"{rec['tokens_per_s']:,.0f} tok/s{rate}{mem} "
        f"RAM {rec['host_rss_peak_gib']:.1f} GiB"
    )


def protocol_key(bench: dict) -> str:
    """What makes two trials the same trial: the protocol (width, batch, checkpointing, steps...),
    not the harness's time limit or the folder of fitgpt's disk tier."""
    harness = ("time_limit", "nvme_path")  # where and how long, not what is measured
    # trials recorded before --compile existed ran eagerly, as auto does in a sweep's short trials
    bench = {"compile": "auto", **bench}
    return json.dumps({k: v for k, v in bench.items() if k not in harness}, sort_keys=True)


def predicted_wall(results: dict, system: str, layers: int, params_of) -> float:
    """A trial's wall time, predicted from this system's largest finished trial (init and step
    times grow about linearly with the parameters); a first trial is given a minute."""
    prev = [r for (s, _), r in results.items() if s == system and "wall_s" in r]
    if not prev:
        return 60.0
    last = max(prev, key=lambda r: r["params"])
    return 1.2 * last["wall_s"] * max(1.0, params_of(layers) / last["params"])


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def sweep(spec: SweepSpec, out: Path) -> list[dict]:
    for s in spec.systems:
        get_system(s)  # unknown names fail before anything runs
    out.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # `timeout` must not orphan a running trial
    t_start = time.time()
    proto = protocol_key(spec.bench.to_dict())
    done = {
        (r["system"], r["layers"]): r
        for r in read_results(out)
        if protocol_key(r.get("bench", {})) == proto and r.get("world") == spec.gpus
    }
    total = len(spec.systems) * len(spec.sizes)
    k = 0
    # each trial's spec, per-rank results and log stay beside the results file, for the record
    logs = out.with_name(out.stem + ".logs")
    logs.mkdir(exist_ok=True)
    for system in spec.systems:
        for layers in sorted(spec.sizes):
            k += 1
            prev = done.get((system, layers))
            if prev is None and spec.budget_s:
                left = spec.budget_s - (time.time() - t_start)
                need = predicted_wall(
                    done, system, layers, lambda n: spec.bench.model(n).num_params()
                )
                if need > left:
                    console.print(
                        f"[{k}/{total}] {system} L={layers}: not started, predicted {need:.0f} s "
                        f"with {left:.0f} s of --budget left; run the same command again to "
                        "resume",
                        highlight=False,
                        markup=False,
                    )
                    k += len([s for s in spec.sizes if s > layers])
                    break  # try the next system: its first trials may be short
            if prev is None:
                console.print(
                    f"[{k}/{total}] {system} L={layers} ...", highlight=False, markup=False
                )
                prev = run_one(spec, system, layers, logs, spec.cap_bytes)
                append_result(out, prev)
                done[(system, layers)] = prev
            console.print(f"[{k}/{total}] {describe(prev)}", highlight=False, markup=False)
            if prev["status"] != "ok":
                k += len([s for s in spec.sizes if s > layers])
                break  # this system's line ends at its first failure
    return list(done.values())
