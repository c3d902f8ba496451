"""torchrun's launcher (torch.distributed.run), minus its own traceback: `--gpus N` runs this.

Why: when a rank stops with fitgpt's one-line refusal (exit status 2, fitgpt.errors.UserError),
torchrun's agent raises ChildFailedError and Python prints its traceback and a block of failure
records after that line, so a refusal reads like a crash. Here the agent runs as torchrun runs
it (the same argument parser and `run`), and a failed job ends with the first failed rank's exit
status: silently after a refusal, whose line the rank printed already; otherwise with one line
naming the rank and its status (the rank's own output above says why). The agent's own log
lines (stopping the other ranks, the failed rank's status) are silenced: torch's elastic
loggers are set to CRITICAL, so a rank's exit is reported once, here. A rank that crashes still
prints its own traceback: that output is the rank's, not the agent's.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from fitgpt.dist.launch import AGENT_ENV, LAUNCHER_ENV, STOPPED, STOPS
from fitgpt.dist.nodes import RollCall
from fitgpt.procs import die_with_parent


def launcher_args(argv: list[str]):
    """torchrun's arguments: its own options up to `-m MODULE`, and everything after them
    handed to the ranks untouched. torchrun's parser reads its options out of the whole line and
    takes an unknown flag for an abbreviation of its own, so `fitgpt train --gpus 2 --master
    split` failed with "ambiguous option: --master could match --master-addr, --master-port"."""
    if "-m" not in argv:
        return parse_args(argv)
    cut = argv.index("-m") + 2
    args = parse_args(argv[:cut])
    args.training_script_args = argv[cut:]
    return args


def quiet_agent() -> None:
    """torch's elastic loggers at CRITICAL: each sets its own level (elastic/utils/logging.py
    get_logger), so the parent's level alone left the agent's "Received 2 death signal,
    shutting down workers" warning above a stopped run's one line."""
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def signal_name(n: int) -> str:
    try:
        return f"signal {n} ({signal.Signals(n).name})"
    except ValueError:
        return f"signal {n}"


def culprit(e: ChildFailedError):
    """(rank, failure) that ended the job: a rank killed by a signal (kill -9, the OOM killer, a
    crash) before the first to fail, since the others then fail in a collective and exit 1,
    often before the agent sees the dead one; torch's first failure named rank 0 for a kill -9
    of rank 1."""
    killed = [(r, f) for r, f in e.failures.items() if f.exitcode < 0]
    return min(killed, key=lambda rf: rf[1].timestamp) if killed else e.get_first_failure()


def take_stops() -> None:
    """SIGINT and SIGTERM raised as torch's agent raises them once it starts the ranks, so run()
    ends as after a stop, then unblocked: a `--gpus` launcher starts this process with them
    blocked (launch.STOPS), so one sent while Python and torch were loading waits until here.
    Before, a Ctrl-C then or in the rendezvous printed the agent's traceback, and a SIGTERM
    ended it without a word."""
    for s in STOPS:
        if signal.getsignal(s) != signal.SIG_IGN:  # ignored at start (nohup): left so
            signal.signal(s, stop_agent)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # a pending stop raises here


def stop_agent(signum: int, frame) -> None:
    raise SignalException(f"stopped by signal {signum}", sigval=signal.Signals(signum))


def main(argv: list[str]) -> int:
    quiet_agent()
    if os.environ.get(LAUNCHER_ENV) == str(os.getppid()):  # `fitgpt train --gpus N` started us
        # its launcher killed outright: stop the job as a SIGTERM to the launcher would
        die_with_parent(os.getppid(), signal.SIGTERM)
    os.environ[AGENT_ENV] = str(os.getpid())  # the ranks end with this process (die_with_agent)
    args = launcher_args(argv)
    roll = RollCall.of(args)  # several nodes: each named if it does not join or goes silent
    try:
        take_stops()
        if roll is not None and (line := roll.sign_in()) is not None:
            print(line, file=sys.stderr, flush=True)
            return 1
        run(args)
    except SignalException:
        # a stop (launch.wait_job forwards the launcher's): the agent handed it to the ranks
        # and waited for them; each saved and rank 0 printed the line, the status a rank's stop's
        if roll is not None:
            roll.sign_out()
        return STOPPED[0]
    except ChildFailedError as e:
        rank, failure = culprit(e)
        code = failure.exitcode
        if roll is not None:
            roll.sign_out()
        if code == 2 or code in STOPPED:
            return code  # a refusal or a stop: the rank printed its one line
        silent = roll.silent_nodes() if roll is not None else []
        if silent:  # the ranks' lines say a collective failed; this one says where
            nodes = ", ".join(map(str, silent))
            print(f"fitgpt: node(s) {nodes} stopped answering; the job ends", file=sys.stderr)
            return code if code > 0 else 1
        if code < 0:  # killed: it said nothing; the others' lines name the collective it left
            print(f"fitgpt: rank {rank} was ended by {signal_name(-code)}; the job ends",
                  file=sys.stderr)  # fmt: skip
            return 1
        print(f"fitgpt: rank {rank} stopped (exit status {code}); its output above says why",
              file=sys.stderr)  # fmt: skip
        return code
    if roll is not None:
        roll.sign_out()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
