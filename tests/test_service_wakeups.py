"""Held check-ins are woken by device: waking some devices leaves every other held request
asleep (its readiness is not even re-checked), a wake-up whose condition is still false goes
back to sleep for the rest of its time, the timeout holds, and `wake_all` reaches everyone."""

import asyncio
import time

from dpfleet.service.wakeups import Wakeups


def test_only_the_woken_devices_recheck_and_return():
    async def main():
        held, checks = Wakeups(), {i: 0 for i in range(50)}
        ready = {i: False for i in range(50)}

        def probe(i):
            def check():
                checks[i] += 1
                return ready[i]
            return check

        tasks = {i: asyncio.create_task(held.hold(i, probe(i), 5.0)) for i in range(50)}
        await asyncio.sleep(0.05)
        before = dict(checks)
        for i in (3, 7):
            ready[i] = True
        held.wake([3, 7, 11])  # 11 is woken but not ready: it sleeps again
        await asyncio.sleep(0.05)
        done = {i for i, t in tasks.items() if t.done()}
        rechecked = {i for i in checks if checks[i] != before[i]}
        waiting = len(held)
        for i in ready:
            ready[i] = True
        held.wake_all()
        await asyncio.wait_for(asyncio.gather(*tasks.values()), 2.0)
        return done, rechecked, waiting, len(held)

    done, rechecked, waiting, left = asyncio.run(main())
    assert done == {3, 7}
    assert rechecked == {3, 7, 11}  # the other 47 were never woken
    assert waiting == 48 and left == 0


def test_a_hold_ends_at_its_timeout_and_returns_at_once_when_ready():
    async def main():
        held = Wakeups()
        began = time.monotonic()
        await held.hold(1, lambda: False, 0.3)
        timed = time.monotonic() - began
        began = time.monotonic()
        await held.hold(2, lambda: True, 10.0)
        return timed, time.monotonic() - began, len(held)

    timed, ready_s, left = asyncio.run(main())
    assert 0.25 <= timed < 2.0, timed
    assert ready_s < 0.05 and left == 0
