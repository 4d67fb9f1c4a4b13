"""Which asyncio event loop the coordinator and the emulated devices' workers run on.

Why uvloop: most of the coordinator's CPU per request is event-loop and transport work
(socket reads and writes, callbacks, futures), which uvloop (libuv) does in C. It is a
Linux-only dependency (pyproject marker; it builds for no Windows) and optional here: when it
is not installed, or `DPFLEET_EVENT_LOOP=asyncio` asks for the standard loop (to compare), the
standard loop runs the same code with the same behaviour.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None (asyncio's default loop)."""
    if os.environ.get("DPFLEET_EVENT_LOOP", "uvloop") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def loop_name() -> str:
    return "asyncio" if loop_factory() is None else "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
