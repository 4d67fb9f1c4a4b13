"""Attack: a participant's held check-in is carried into the next round's check-in
(`service/rounds.py`); can a device use it to join a round it is not allowed in?

Real sockets, real training. With MinS = 1, round 1's participants check in again at once after
reporting and are held through round 1: one lies (no timer at all), one is honest (its timer
set a period ahead). When round 1 commits, both carried check-ins must be refused ("timer", the
guard and the device's own timer asked at that moment), and neither may be in round 2; the
third participant's check-in while the run is paused must not come back as an assignment.
Checked on the value: round 2's released participants."""

import asyncio
import time

from service_fleet import checkin_all, device_keys, fleet_data, serving, tiny_cfg

from dpfleet.fleet.participant import take_part


def test_carried_check_ins_cannot_break_min_separation_the_timer_or_a_pause(tmp_path):
    cfg = tiny_cfg(rounds=2, participation={"min_separation": 1},
                   service={"checkin_window_s": 0.5, "overselect": 0.0})
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = device_keys(users)

    async def main():
        async with serving(cfg, tmp_path / "state", keys) as (running, links):
            first = await checkin_all(links)
            jobs = {u: r for u, r in first.items() if r["kind"] == "assignment"}
            liar, honest, last = sorted(jobs)
            await take_part(links[liar], jobs[liar], examples[liar])
            lying = asyncio.create_task(links[liar].checkin(timer_expires_at=None))
            await take_part(links[honest], jobs[honest], examples[honest])
            timed = asyncio.create_task(links[honest].checkin(
                timer_expires_at=time.time() + 3600.0))
            await asyncio.sleep(0.3)
            held = not lying.done() and not timed.done()
            await take_part(links[last], jobs[last], examples[last])  # round 1 is complete
            carried = await asyncio.wait_for(asyncio.gather(lying, timed), 30)
            running.driver.pause()  # the last participant checks in while the run is paused
            paused = await asyncio.wait_for(links[last].checkin(), 10)
            running.driver.resume()
            # the others fill round 2 (the ones not selected stay held until the run ends)
            rest = {asyncio.create_task(links[u].checkin()): u for u in users if u not in jobs}
            round2, pending = {}, set(rest)
            while len(round2) < cfg.dp.report_goal and pending:
                done, pending = await asyncio.wait(pending, timeout=30,
                                                   return_when=asyncio.FIRST_COMPLETED)
                assert done, "round 2 never opened"
                round2.update({rest[t]: t.result() for t in done
                               if t.result()["kind"] == "assignment"})
            await asyncio.gather(*(take_part(links[u], r, examples[u]) for u, r in round2.items()))
            await asyncio.wait_for(asyncio.shield(running.task), 60)
            return (jobs, held, paused, carried, (liar, honest, last),
                    running.driver.store.releases())

    jobs, held, paused, carried, (liar, honest, last), releases = asyncio.run(main())
    assert len(jobs) == cfg.dp.report_goal and held
    assert paused["kind"] == "retry", paused  # never an assignment while paused
    for reply in carried:
        assert reply["kind"] == "refused" and reply["reason"] == "timer", reply
    assert [r["round"] for r in releases] == [1, 2]
    assert sorted(releases[0]["participants"]) == sorted(jobs)
    assert not set(releases[1]["participants"]) & {liar, honest, last}, releases[1]
