"""Check-ins are long-polls that span a running round: a device that checks in while a round
runs is held and handed the NEXT round's assignment the moment that round opens (not told
"round full, come back in checkin_retry_s"); a participant that already reported is held until
its round ends and then, in the same request, checks in for the next round (no second check-in);
a stop releases every held check-in."""

import asyncio
import time

from service_fleet import checkin_all, device_keys, fleet_data, serving, tiny_cfg

from dpfleet.fleet.participant import take_part

RETRY_S = 30.0  # long: a device sent away for this long would miss the next round by far


def test_a_device_waiting_through_a_round_gets_the_next_one_at_once(tmp_path):
    cfg = tiny_cfg(rounds=2, service={"checkin_retry_s": RETRY_S, "checkin_window_s": 0.5,
                                      "overselect": 0.0})
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = device_keys(users)

    async def main():
        async with serving(cfg, tmp_path / "state", keys) as (running, links):
            first = await checkin_all(links)
            jobs = {u: r for u, r in first.items() if r["kind"] == "assignment"}
            idle = [u for u in users if u not in jobs]
            # round 1 runs: everyone else checks in again and is held through it
            waiting = {u: asyncio.create_task(links[u].checkin()) for u in idle}
            a, *others = sorted(jobs)
            await take_part(links[a], jobs[a], examples[a])
            full = asyncio.create_task(links[a].checkin())  # reported; its round still runs
            await asyncio.sleep(0.5)
            held_while_open = not full.done() and not any(t.done() for t in waiting.values())
            await asyncio.gather(*(take_part(links[u], jobs[u], examples[u]) for u in others))
            ended = time.monotonic()  # the last report closes round 1
            waiting[a] = full  # its request now waits for round 2 like the idle devices' do
            got: dict = {}
            pending = set(waiting.values())
            while len(got) < cfg.dp.report_goal and pending:
                done, pending = await asyncio.wait(pending, timeout=10,
                                                   return_when=asyncio.FIRST_COMPLETED)
                assert done, "no held check-in was answered within 10 s of round 1's end"
                for task in done:
                    got[next(u for u, t in waiting.items() if t is task)] = (
                        task.result(), time.monotonic() - ended)
            stopped = time.monotonic()
            running.driver.stop()
            released = await asyncio.wait_for(asyncio.gather(*pending), 5)
            return (jobs, idle, held_while_open, a, got, released, time.monotonic() - stopped)

    jobs, idle, held_while_open, a, got, released, release_s = asyncio.run(main())
    assert {r["round"] for r in jobs.values()} == {1} and len(jobs) == cfg.dp.report_goal
    assert held_while_open
    # the participant's held check-in was never sent away: round 2 took it, or the stop did
    assert set(got) <= set(idle) | {a} and len(got) == cfg.dp.report_goal
    for reply, seconds in got.values():
        assert reply["kind"] == "assignment" and reply["round"] == 2, reply
        # the window (0.5 s) and the round's opening, nowhere near a 30 s poll interval
        assert seconds < 5.0, seconds
    assert all(r["kind"] == "retry" and r["reason"] == "stopping" for r in released), released
    assert release_s < 3.0, release_s
