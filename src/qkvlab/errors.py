"""User-facing errors.

A `QkvlabError` is a mistake the user can fix (bad config, missing data, wrong checkpoint).
The CLI prints its message on one line and exits with status 2; anything else is a bug and
keeps its traceback.
"""


class QkvlabError(Exception):
    """A problem with the user's input; the message names the problem and the fix."""

    exit_code = 2


def require(ok: bool, message: str) -> None:
    """Raise QkvlabError(message) unless `ok`: the one guard every validation step uses."""
    if not ok:
        raise QkvlabError(message)
