"""Attack: a device abuses the merged SecAgg post's `after=` cursor (PROTOCOL.md, merged posts).

Real sockets, signed SecAgg. After every device committed (the reply carried its first mail),
device A tries to (1) hold another request open by replaying its accepted message with a
cursor, (2) read past its mailbox (a far-future cursor) and (3) read from 0 again. Checked on
the value: the replay is refused at once (no poll is held for it), the far cursor returns no
message and A's own mailbox length as the next cursor, and every message A ever gets is
addressed to A's position."""

import asyncio
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from service_fleet import checkin_all, fleet_data, serving
from test_service_secagg import HELD_DEADLINE_S, first_messages, secagg_cfg

from dpfleet.fleet.link import LinkError

POLL_S = 3.0


def test_a_cursor_neither_holds_a_replay_nor_reads_beyond_the_own_mailbox(tmp_path):
    from dpfleet.secagg.messages import decode

    cfg = secagg_cfg(rounds=1, service={"overselect": 0.0, "secagg_phase_deadline_s": HELD_DEADLINE_S})
    users, _ = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        async with serving(cfg, tmp_path / "state", keys, poll_s=POLL_S) as (running, links):
            jobs = {u: r for u, r in (await checkin_all(links)).items() if r["kind"] == "assignment"}
            commits = first_messages(cfg, jobs, keys)
            number, attempt = next(iter(jobs.values()))["round"], next(iter(jobs.values()))["attempt"]
            first = dict(zip(jobs, await asyncio.gather(
                *(links[u].secagg_send_poll(number, attempt, commits[u], 0) for u in jobs)),
                strict=True))
            a = sorted(jobs)[0]
            began = time.monotonic()
            try:
                await links[a].secagg_send_poll(number, attempt, commits[a], len(first[a][0]))
                replay = None
            except LinkError as exc:
                replay = exc
            replay_s = time.monotonic() - began
            far = await links[a].secagg_poll(number, attempt, 10**9)
            again = await links[a].secagg_poll(number, attempt, 0)
            return jobs[a]["position"], first, first[a][0], replay, replay_s, far, again

    position, first, mine, replay, replay_s, far, again = asyncio.run(main())
    assert replay is not None and replay.status == 400 and replay.code == "secagg_refused"
    assert replay_s < POLL_S / 2, replay_s  # refused before any poll was held
    own = len(again[0])
    assert far[0] == [] and far[1] == own  # nothing from beyond its own mailbox
    assert own >= len(mine) >= 1 and again[0][: len(mine)] == mine  # the same mail, re-read
    assert {decode(m).recipient for m in again[0]} == {position}
    for messages, _, _ in first.values():
        assert len({decode(m).recipient for m in messages}) == 1
