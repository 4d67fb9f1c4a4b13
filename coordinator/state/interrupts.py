"""Ctrl-C and SIGTERM at the points where a run's state must stay whole.

Why: an interrupt is a KeyboardInterrupt raised wherever the main thread happens to be. Two
places must never be cut in two: a round's DP step and the commit of its release (else the live
state has moved past what the release log says), and the writing of a resume point. In
`interrupts_deferred` an interrupt is held and acts when the block ends. `sigterm_interrupts`
makes a SIGTERM (`kill PID`, a batch scheduler's stop) raise KeyboardInterrupt too, so it takes
the same path as Ctrl-C (a resume point, exit 130) instead of ending the process where it stands.

Both act only in the main thread (the only one Python delivers signals to) and only on handlers
that raise KeyboardInterrupt: a caller's own handler (the service's event loop stops its rounds
itself) is left alone.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM's handler inside `sigterm_interrupts`: Ctrl-C's path."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside the block, SIGTERM raises KeyboardInterrupt (where it would otherwise end the
    process at once); a handler someone else installed is kept."""
    if not _in_main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT / SIGTERM that arrive in the block raise KeyboardInterrupt when it has finished
    (not when it raised: its own exception goes on)."""
    if not _in_main_thread():
        yield
        return
    held = [s for s in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(s) in (signal.default_int_handler, _interrupt)]
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if caught:
        raise KeyboardInterrupt(signal.Signals(caught[0]).name)
