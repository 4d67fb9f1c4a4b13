"""Check-in handler and round-open selection cost at 10^3 / 10^5 registered devices, before and
after the service asked the guard per device (`admits`, `allowed_waiting`) instead of building
`guard.allowed(r)`, a mask over every registered device, on each check-in and round open.

What runs: the real `HttpCollector.checkin` coroutine on a refused check-in (the device is inside
its MinS window: the handler's whole path up to the answer, no hold), driven with a stand-in
for the booted run (a `ParticipationGuard` with the registered population and a recent history;
no SQLite store, no HTTP; registering devices in a store does not enter this path). "before"
swaps `admits` for the previous expression `guard.allowed(r)[i]` in the same process; the
round-open "before" is the previous inline code (mask, its sum, a comprehension over the pool),
with POOL devices waiting. Before and after alternate in BLOCKS blocks; medians are reported.
Saves results/checkin_scale.json with cores, torch threads and the load average.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from dpfleet.coordinator.engine.participation import ParticipationGuard
from dpfleet.service.rounds import HttpCollector, allowed_waiting
from dpfleet.service.wakeups import Wakeups

MINS, GOAL, POOL, BLOCKS = 3, 100, 300, 7
BODY = {"eligibility": {"charging": True, "idle": True, "unmetered": True}, "runtime": "eager"}


def _driver(size: int) -> tuple[HttpCollector, ParticipationGuard]:
    guard = ParticipationGuard(size, MINS, 4)
    for r in range(10):
        guard.record(list(range(r * GOAL, (r + 1) * GOAL)), r)
    d = object.__new__(HttpCollector)  # stand-in for a booted run: only what checkin reads
    d.index = {f"d{i}": i for i in range(size)}
    d.svc = SimpleNamespace(checkin_retry_s=1.0, checkin_window_s=1.0)
    d.cfg = SimpleNamespace(client=SimpleNamespace(runtime="eager"))
    d.engine = SimpleNamespace(participation=SimpleNamespace(guard=guard), next_round=10)
    d.run_state, d.current, d.refused_timer = "running", None, set()
    d.pool, d.waiting_since, d.wake, d.held = {}, {}, asyncio.Event(), Wakeups()
    return d, guard


def _old_open(guard: ParticipationGuard, pool: dict, r: int) -> tuple[list[int], int]:
    allowed = guard.allowed(r)
    return sorted(i for i in pool if allowed[i]), int(allowed.sum())


def _per_call(fn, reps: int) -> float:
    fn()
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - began) / reps


def bench(size: int, reps: int) -> dict:
    driver, guard = _driver(size)
    device = f"d{9 * GOAL + 5}"  # took part in round 9: refused (MinS) in round 10
    loop = asyncio.new_event_loop()

    def checkin():
        reply = loop.run_until_complete(driver.checkin(device, BODY))
        assert reply["kind"] == "refused"

    pool = {i: 0.0 for i in range(size - POOL, size)}
    assert allowed_waiting(guard, pool, 10) == _old_open(guard, pool, 10)
    saved = ParticipationGuard.admits
    times: dict[str, list[float]] = {k: [] for k in ("old_c", "new_c", "old_o", "new_o")}
    for _ in range(BLOCKS):  # before and after interleaved: the shared machine's load drifts
        times["new_c"].append(_per_call(checkin, reps))
        ParticipationGuard.admits = lambda self, i, r: bool(self.allowed(r)[i])  # the old path
        try:
            times["old_c"].append(_per_call(checkin, reps))
        finally:
            ParticipationGuard.admits = saved
        times["new_o"].append(_per_call(lambda: allowed_waiting(guard, pool, 10), reps))
        times["old_o"].append(_per_call(lambda: _old_open(guard, pool, 10), reps))
    old_checkin, new_checkin, old_open, new_open = (float(np.median(times[k])) for k in times)
    loop.close()
    return {"registered": size, "reps": reps,
            "blocks": BLOCKS, "statistic": "median of the blocks' means",
            "checkin_us": {"before": old_checkin * 1e6, "after": new_checkin * 1e6,
                           "ratio": old_checkin / new_checkin},
            "round_open_us": {"before": old_open * 1e6, "after": new_open * 1e6,
                              "ratio": old_open / new_open, "pool": POOL}}


def main() -> None:
    load = os.getloadavg()
    rows = [bench(1_000, 500), bench(100_000, 100)]
    out = {"machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "loadavg_before": load, "loadavg_after": os.getloadavg()},
           "min_separation": MINS, "recent_rounds": 10, "per_round": GOAL, "results": rows}
    path = Path(__file__).parent / "results" / "checkin_scale.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    for row in rows:
        c, o = row["checkin_us"], row["round_open_us"]
        print(f"{row['registered']:>7} devices: check-in {c['before']:.1f} -> {c['after']:.1f} us "
              f"({c['ratio']:.1f}x), round open {o['before']:.1f} -> {o['after']:.1f} us "
              f"({o['ratio']:.1f}x)")
    print(f"saved {path}; load {load}")


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
