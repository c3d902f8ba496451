"""User-facing errors: one line naming the input, what is wrong, and what to do.

Raise UserError for every mistake a user can fix (bad flag, missing path, a run that cannot fit).
The CLI prints it as one line without a traceback; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input; the message says what to change."""
