"""One SecAgg(+) round behind HTTP: the sans-I/O `SecAggServer` plus per-device mailboxes.

Why mailboxes and a cursor: the state machine answers a phase with one message per client;
each device long-polls for the messages addressed to its own position (never anyone else's)
and acknowledges by cursor, so a retried poll after a lost response delivers the same bytes
again and nothing is skipped. Deadlines are the driver's: it calls `close_phase` when a phase's
deadline passes, with whoever answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from dpfleet.secagg.errors import SecAggError
from dpfleet.secagg.messages import decode
from dpfleet.secagg.params import RoundSetup
from dpfleet.secagg.server import SecAggServer


class SecAggRound:
    def __init__(self, setup: RoundSetup):
        self.setup = setup
        self.server = SecAggServer(setup)
        self.mailboxes: list[list[bytes]] = [[] for _ in range(setup.n)]
        self.changed = asyncio.Condition()  # new mail or a new phase
        self.rejected = 0
        # bytes of SecAgg messages each position sent (refused ones too), as the in-process round
        # counts them (`inprocess.RoundReport.bytes_sent`): the aggregation record's costs
        self.bytes_in = dict.fromkeys(range(setup.n), 0)
        self.spoken: set[int] = set()  # positions that sent a message (their assignment arrived)
        # the coordinator's critical path (benchmarks/fleet_load.py): per phase, seconds from the
        # arrival of the message that completed it to its successor's messages being in the
        # mailboxes; `changed_at` is when the phase last changed (monotonic)
        self.critical: dict[str, float] = {}
        self.changed_at = time.monotonic()

    @property
    def phase(self) -> str:
        return self.server.phase

    @property
    def finished(self) -> bool:
        return self.server.phase in ("done", "aborted")

    async def _deliver(self, outbound, phase: str) -> None:
        """Post the server's messages; wake the pollers only when there is mail or a new phase
        (most client messages produce neither: waking every poller on each would cost
        n * n coroutine wake-ups per phase for nothing)."""
        for out in outbound:
            self.mailboxes[out.recipient].append(out.data)
        if outbound or self.phase != phase:
            async with self.changed:
                self.changed.notify_all()

    async def handle(self, position: int, data: bytes, arrived: float | None = None) -> None:
        """One client message from the device at `position`; SecAggError when refused.
        `arrived`: when its request reached the coordinator (monotonic), for `critical`."""
        self.bytes_in[position] += len(data)
        try:
            sender = decode(data).sender
        except SecAggError:
            self.rejected += 1
            raise
        if sender != position:  # a device speaks only for its own position
            self.rejected += 1
            raise SecAggError(f"message claims client {sender}, the device holds position {position}")
        self.spoken.add(position)
        before = self.phase
        try:
            outbound = self.server.handle(data)
        except SecAggError:
            self.rejected += 1
            raise
        await self._deliver(outbound, before)
        if self.phase != before:
            self._phase_changed(before, arrived)

    async def close_phase(self, since: float | None = None) -> None:
        """Go on with whoever answered (the phase's deadline passed at `since`, monotonic)."""
        before = self.phase
        await self._deliver(self.server.close_phase(), before)
        self._phase_changed(before, since)

    def _phase_changed(self, phase: str, since: float | None) -> None:
        self.changed_at = time.monotonic()
        if since is not None:
            self.critical[phase] = self.changed_at - since

    async def poll(self, position: int, after: int, timeout: float) -> tuple[list[bytes], int]:
        """Messages for `position` from index `after` on, waiting up to `timeout` for one."""
        box = self.mailboxes[position]
        if after >= len(box) and not self.finished:
            async with self.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self.changed.wait_for(lambda: len(box) > after or self.finished), timeout)
        return box[after:], len(box)

    def bytes_out(self) -> dict[int, int]:
        """Bytes of SecAgg messages posted to each position so far (its mail, delivered or not)."""
        return {u: sum(map(len, box)) for u, box in enumerate(self.mailboxes)}

    async def wait_phase_change(self, phase: str, timeout: float) -> None:
        async with self.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait_for(lambda: self.server.phase != phase),
                                       timeout)
