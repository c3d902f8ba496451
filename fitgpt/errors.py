"""User-facing errors: one line naming the input, what is wrong, and what to do.

Raise UserError for every mistake a user can fix (bad flag, missing path, a run that cannot fit).
The CLI prints it as one line without a traceback; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input; the message says what to change."""

    # True when every rank of a torchrun job raises this error at the same agreement
    # (engine/comm.py all_ok). The CLI then prints it on every rank and waits for the others
    # before exiting: torchrun ends the remaining ranks as soon as one has exited, so without the
    # wait the rank whose line names the cause could be killed before it prints.
    agreed: bool = False
    # True when, besides, every rank's message is the same (rank 0's plan refusal, broadcast;
    # a verdict on all-reduced figures): printed once, by rank 0. Where the ranks' messages
    # differ (a save that failed on one rank names its cause there only) each prints its own.
    identical: bool = False


def print_line(text: str, stream=None) -> None:
    """`text` and its newline in one write, flushed. The ranks of a torchrun job share one
    stderr, and under PYTHONUNBUFFERED (common in containers and job scripts) print() writes
    a text and its newline apart: two ranks failing together then printed "AB\\n\\n", one
    line naming both causes (CI, 2026-11-28). One write of a line under the pipe's 4 KiB is
    atomic; a longer one may still interleave, at no cost here."""
    import sys

    out = stream if stream is not None else sys.stderr
    out.write(text + "\n")
    out.flush()
