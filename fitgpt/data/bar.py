"""The progress bar of the data commands (preprocess, inspect, clean, merge, fake): rich's, on
stderr, erased when the work ends, and shown only on a terminal.

Why only a terminal: to a pipe or a log file rich draws nothing while the work runs, and its
erase at the end writes a bare newline. That blank line came before a refusal's one line
(`fitgpt data ... 2> log`) and before every summary, on every piped run; leaving the bar off
there costs nothing, as nothing of it was shown.
"""

from __future__ import annotations


def transient_bar(enabled: bool, *columns):
    """A rich Progress over `columns` on stderr: drawn while `enabled` and stderr is a terminal,
    erased when its `with` block ends (a refusal found during the work is then the one line on
    stderr, and the summary follows no bar)."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    return Progress(*columns, console=console, disable=not (enabled and console.is_terminal),
                    transient=True)  # fmt: skip
