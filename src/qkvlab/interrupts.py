"""Stop signals (SIGINT, SIGTERM) that come before a command's work begins.

`python -m qkvlab` defers them from its first line: while torch and numpy load, the first one
is remembered, not raised (a KeyboardInterrupt inside torch's C start-up can be swallowed,
leave numpy half-imported, or abort the process). A command that trains calls `arm` once its
imports are done: a signal that came meanwhile is raised then, as `Interrupted`, and so is
each later one (SIGTERM too, so a run folder's lock is released on the way out) until the
training loop or the sweep executor installs handlers of its own. Every other command gets
Python's usual handlers back (`release`). A second Ctrl-C while one waits aborts at once.
"""

from __future__ import annotations

# only `signal` at start-up: this module is imported before anything else, and a signal
# that comes before it is loaded still ends in Python's own traceback
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A stop signal outside the training loop; BaseException, like KeyboardInterrupt, so no
    `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)


class _State:
    pending: int | None = None  # the first signal while deferred
    resume: str | None = None  # the command that resumes the interrupted work, once known


_state = _State()


def _remember(signum: int, frame: object) -> None:
    if _state.pending is None:
        _state.pending = int(signum)
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt


def _raise(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def _install(handlers: dict) -> None:
    for sig, handler in handlers.items():
        if handler is None:  # a handler not set from Python: none to restore
            continue
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread: a library caller's thread keeps its own
            return


def defer() -> None:
    """Remember the first stop signal instead of acting on it."""
    _install(dict.fromkeys(STOP_SIGNALS, _remember))


def arm(resume: str | None = None) -> None:
    """Raise stop signals as `Interrupted` from now on, a deferred one at once; `resume` is the
    command that continues the work, for the message."""
    _state.resume = resume
    _install(dict.fromkeys(STOP_SIGNALS, _raise))
    pending, _state.pending = _state.pending, None
    if pending is not None:
        raise Interrupted(pending)


def release() -> None:
    """Python's default handlers again; a signal deferred meanwhile takes effect now."""
    _install({signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL})
    pending, _state.pending = _state.pending, None
    if pending is not None:
        signal.raise_signal(pending)


def resume_command() -> str | None:
    return _state.resume


class deferred:  # noqa: N801 - used as a function: `with interrupts.deferred():`
    """Defer stop signals in the block (a signal deferred before it stays pending); the
    handlers found are restored on leaving it."""

    def __enter__(self) -> None:
        self.found = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        defer()

    def __exit__(self, *exc: object) -> None:
        _install(self.found)
        _state.pending, _state.resume = None, None
