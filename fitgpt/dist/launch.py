"""`--gpus N`: start torchrun's launcher on this machine with the same command minus --gpus.

The one launcher of fitgpt: `train`, `probe`, `matmul`, the benchmark harness and the capacity
search all start their processes here, with the environment of `fitgpt.dist.env.child_env`.

For several machines, `fitgpt train --gpus G --nnodes N --node-rank R --master-addr A
--master-port P` on each starts torchrun's static rendezvous (dist/nodes.py); a user's own
`torchrun ... -m fitgpt train ...` works too: fitgpt joins whatever job torchrun sets up, and
every process sets itself up the same way (`fitgpt.dist.env.configure_process`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fitgpt.dist.env import SAFE_ENV, child_env
from fitgpt.dist.nodes import Nodes
from fitgpt.procs import STARTED_ENV

__all__ = ["SAFE_ENV", "command", "relaunch", "strip_flag"]


def strip_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def command(
    nproc: int,
    module: str,
    argv: list[str],
    torchrun: bool | None = None,
    nodes: Nodes | None = None,
) -> list[str]:
    """`python -m module argv` under torchrun with `nproc` processes on this machine (by default
    only when nproc > 1: one process needs no rendezvous), this machine one of `nodes`."""
    if not (nproc > 1 if torchrun is None else torchrun):
        return [sys.executable, "-m", module, *argv]
    return [
        sys.executable,
        "-m",
        "fitgpt.dist.torchrun",  # torchrun, minus its traceback after a refusal
        *(nodes or Nodes()).torchrun_args(nproc),
        "-m",
        module,
        *argv,
    ]


def relaunch(
    nproc: int,
    argv: list[str],
    module: str = "fitgpt",
    env: dict[str, str] | None = None,
    nodes: Nodes | None = None,
    startup_stop: Callable[[int], None] | None = None,
) -> int:
    """Run `python -m fitgpt <argv>` under torchrun with nproc processes on this machine (one of
    `nodes`), `env` added to their environment (train's settled settings: cli/train.py launch);
    return its exit code. `startup_stop(signum)`, where given, is called when the job ended after
    a stop this launcher forwarded before its ranks' start-up was over (procs.STARTED_ENV): it
    says the job's one line (or raises the exception that does); the ranks say nothing then."""
    cmd = command(nproc, module, argv, torchrun=True, nodes=nodes)
    env = {**child_env(nproc), **(env or {}), LAUNCHER_ENV: str(os.getpid())}
    with tempfile.TemporaryDirectory(prefix="fitgpt-job-") as tmp:
        started = Path(tmp) / "started"
        if startup_stop is not None:
            env[STARTED_ENV] = str(started)
        # torchrun's agent in a process group of its own (its ranks have sessions of their own
        # already): a Ctrl-C at the terminal reaches this launcher alone, which hands the agent
        # one stop request (wait_job). Sharing the terminal's group, the agent got the Ctrl-C
        # from the terminal and a second one from here, and raised out of its own shutdown with
        # a traceback.
        code, signum = wait_job(start_agent(cmd, env), started if startup_stop else None)
        stopped = signum is not None and code in STOPPED
        if startup_stop is not None and stopped and not started.exists():
            startup_stop(signum)
    return code


# Ctrl-C and SIGTERM: blocked in torchrun's agent until it can take them (torchrun.py
# take_stops); before, one sent while it loaded Python and torch printed a traceback or no line
STOPS = {signal.SIGINT, signal.SIGTERM}


def start_agent(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """torchrun's agent, started with STOPS blocked (a child inherits its parent's signal mask
    across exec; blocked here for the moment of the start, not in a preexec_fn, which is unsafe
    once torch has started threads). A stop sent to this launcher meanwhile is raised here
    once the agent is running, which then stops as its parent exits (torchrun.py)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        return subprocess.Popen(cmd, env=env, process_group=0)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


# a job's exit status after a stop (fitgpt.cli: Ctrl-C's 130, SIGTERM's 143; torchrun.py's agent
# ends with 130 after one): the ranks, or this launcher in start-up, said what it saved
STOPPED = (130, 143)

# set by torchrun.py in its ranks' environment: its pid, which a rank ends with (cli/train.py)
AGENT_ENV = "FITGPT_AGENT_PID"

# torch's agent: how long the ranks may take to end after a stop before it SIGKILLs them
# (30 s by default; cli/train.py gives a save --dist-timeout)
SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
# A rank stopped in start-up ends at once, unless a stop reached it inside torch's C++ (the
# rendezvous waiting for a rank that ended already), where Python's handlers never run: it is
# SIGKILLed this long after the stop, as torch's agent did before it was given a save's time.
STARTUP_GRACE_S = 30.0

# set in the agent's environment: fitgpt/dist/torchrun.py then stops the job when this
# launcher dies, even by SIGKILL (the agent's pdeathsig)
LAUNCHER_ENV = "FITGPT_LAUNCHER_PID"


def wait_job(agent: subprocess.Popen, started: Path | None = None) -> tuple[int, int | None]:
    """Wait for torchrun's agent; its exit status (128 + N for signal N) and the first signal
    this launcher forwarded to it (None if none). `started`: the file whose absence says the
    ranks are in start-up (procs.STARTED_ENV), where a stop has nothing to save: ranks still
    there STARTUP_GRACE_S after it are SIGKILLed.

    SIGINT and SIGTERM to this launcher (Ctrl-C, `timeout`, `kill`, a scheduler) go on to the
    job instead of ending the launcher: the first to the agent, which hands it to every rank
    (each saves the step it stopped at and the agent waits for them, up to --dist-timeout:
    relaunch); a second to the ranks themselves, which stop at once as after a second Ctrl-C. Before, Python's
    default SIGTERM ended the launcher alone and the job trained on unwatched, holding --out's
    lock, and a Ctrl-C made subprocess.call SIGKILL the agent, which left its ranks training."""
    asked: list[int] = []
    asked_at = [0.0]

    def forward(signum, frame) -> None:
        asked.append(signum)
        asked_at[0] = asked_at[0] or time.monotonic()
        send([agent.pid] if len(asked) == 1 else children(agent.pid), signum)

    # a signal ignored at start stays ignored (nohup, a script's `cmd &` ignores SIGINT)
    main = threading.current_thread() is threading.main_thread()
    taken = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) != signal.SIG_IGN]
    before = {s: signal.signal(s, forward) for s in taken} if main else {}
    try:
        while True:
            try:
                code = agent.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                late = asked and time.monotonic() - asked_at[0] > STARTUP_GRACE_S
                if late and started is not None and not started.exists():
                    send(children(agent.pid), signal.SIGKILL)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    return (code if code >= 0 else 128 - code), (asked[0] if asked else None)


def send(pids: list[int], signum: int) -> None:
    """`signum` to each of `pids`, those that ended meanwhile skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def children(pid: int) -> list[int]:
    """The processes `pid` started (the agent's ranks), from /proc (Linux; elsewhere none)."""
    found = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found
