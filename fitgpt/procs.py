"""Processes on this machine: whether one is still alive (stale run locks, orphaned scratch), a
child that ends with its parent, and SIGTERM handled as Ctrl-C is. Standard library only, at the
package's top like paths.py: the data workers use it without importing torch (fitgpt.dist does)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (signal 0 probes without delivering)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """End this process when `parent` dies, even by SIGKILL (no cleanup of the parent's runs
    there, so a child left running would hold its memory, a GPU, its files), by `signum`
    (SIGTERM: a process that stops its own children on it, torchrun's agent).

    Linux: the kernel sends SIGKILL on the parent's exit (PR_SET_PDEATHSIG; it fires when the
    thread that started this process ends, which is the parent's main thread for the callers
    here). Everywhere, also a daemon thread that polls the parent pid once a second: the
    fallback, and a check for a parent that died before prctl took effect.
    """
    if not parent:
        return
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signum, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)  # the parent died before prctl took effect
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signum)  # reparented: the parent is gone

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C's KeyboardInterrupt is, so the same `finally` blocks run."""


def _raise_stopped(signum, frame) -> None:
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Inside the block, SIGTERM (`timeout`, `kill`, a job scheduler) raises Stopped in the main
    thread, as Ctrl-C raises KeyboardInterrupt: Python's default for SIGTERM ends the process at
    once, with no `finally` and no `with` exit, so the children it started and its temporary
    folders would outlive it. The previous handler is back after the block. Main thread only
    (where Python runs signal handlers); elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


# Set by a `--gpus N` launcher that speaks for its job when it is stopped in start-up
# (fitgpt/dist/launch.py relaunch): a file path in its ranks' environment, which every rank
# creates once its start-up is over (train: right before the first step). A job that ends after
# a stop without the file was stopped in start-up: there its ranks say nothing (each would print
# its own line, some a traceback) and the launcher prints the job's one line; from the first step
# on, the ranks say what a stop saved.
STARTED_ENV = "FITGPT_JOB_STARTED"


# whether this process's run is past its start-up (startup_over): process state, as the signal
# handlers it decides about are
_started = False


def in_startup() -> bool:
    """Whether a stop now is a stop in start-up: nothing to save yet (train/guard.py)."""
    return not _started


def launcher_speaks() -> bool:
    """Whether this process is a rank in start-up whose launcher says the job's line for a
    stop (STARTED_ENV)."""
    path = os.environ.get(STARTED_ENV)
    return bool(path) and "RANK" in os.environ and not os.path.exists(path)


def startup_over() -> None:
    """Start-up is over: a stop now saves, and the ranks say what (this rank's launcher is told)."""
    global _started
    _started = True
    path = os.environ.get(STARTED_ENV)
    if path:
        with contextlib.suppress(OSError):
            open(path, "a").close()
