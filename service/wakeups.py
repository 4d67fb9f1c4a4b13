"""Held long-polls by device: wake the devices a change concerns, not every held request.

Why: on a 1,000-device fleet ~900 check-ins are held while a round runs. With one
`asyncio.Condition` every round opening and ending woke all of them to re-check a predicate
that is false for all but the round's ~100 devices (and each woken waiter re-takes the
condition's lock in turn). Here a held request waits on its own future, keyed by device, and
the driver wakes exactly the devices a change concerns (the selected devices at opening, the
participants at the round's end); a run state change wakes everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable


class Wakeups:
    def __init__(self):
        self._held: dict[int, set[asyncio.Future]] = {}

    async def hold(self, device: int, ready: Callable[[], bool], timeout: float) -> None:
        """Return when `ready()` (checked at the start and on each wake-up of `device`) or
        after `timeout` seconds."""
        end = time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        while not ready():
            left = end - time.monotonic()
            if left <= 0:
                return
            fut = loop.create_future()
            held = self._held.setdefault(device, set())
            held.add(fut)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(fut, left)
            finally:
                held.discard(fut)
                if not held and self._held.get(device) is held:
                    del self._held[device]

    def wake(self, devices: Iterable[int]) -> None:
        for device in devices:
            for fut in self._held.get(device, ()):
                if not fut.done():
                    fut.set_result(None)

    def wake_all(self) -> None:
        self.wake(list(self._held))

    def __len__(self) -> int:
        return sum(len(v) for v in self._held.values())
