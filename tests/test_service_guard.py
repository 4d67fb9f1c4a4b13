"""The coordinator refuses check-ins that its `ParticipationGuard` would refuse (MinS / MaxP),
answering "refused: timer" / "max_participation", exactly as the simulation's guard does:
checked on the value, the committed participation never breaks MinS or MaxP and no device
refused before a round is in that round."""

import asyncio

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from service_fleet import fleet_data, run_devices, tiny_cfg

from dpfleet.service.server import shutdown, start


def test_check_ins_that_would_break_min_separation_or_max_participation_are_refused(tmp_path):
    cfg = tiny_cfg(rounds=4, participation={"min_separation": 1, "max_participation": 2})
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    replies = []

    async def main():
        running = await start(cfg, tmp_path / "state", log=lambda s: None)
        rounds_at = []
        driver = running.driver
        checkin = driver.checkin

        async def spy(device_id, body):  # the round a refusal was about
            reply = await checkin(device_id, body)
            # a refusal is answered right after the guard's check (no await between), so the
            # round it was about is the next one now: a held participant's check-in is checked
            # only once its own round has ended
            if reply["kind"] == "refused":
                rounds_at.append((driver.engine.next_round + 1, device_id, reply["reason"]))
            return reply

        driver.checkin = spy
        devices = asyncio.create_task(run_devices(running.url, keys, examples, replies=replies))
        await asyncio.wait_for(asyncio.shield(running.task), 120)
        releases = driver.store.releases()
        await asyncio.wait_for(devices, 30)
        await shutdown(running)
        return releases, rounds_at

    releases, refused = asyncio.run(main())
    assert [r["round"] for r in releases] == [1, 2, 3, 4]
    rounds_of = {u: [r["round"] for r in releases if u in r["participants"]] for u in users}
    for taken in rounds_of.values():
        assert len(taken) <= 2  # MaxP
        assert all(b - a - 1 >= 1 for a, b in zip(taken, taken[1:], strict=False))  # MinS
    assert {reason for _, _, reason in refused} <= {"timer", "max_participation"}
    assert any(reason == "timer" for _, _, reason in refused)
    for number, device, _ in refused:
        assert device not in releases[number - 1]["participants"]
    assert any(r[1]["kind"] == "refused" for r in replies)
