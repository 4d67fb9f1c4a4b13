"""The service asks the guard per device (check-in) and per waiting set (round open) instead of
building a mask over every registered device; its decisions must be the mask rule's, exactly.

The oracle is the MinS/MaxP rule written out from the participation history itself (no guard
code): device d may take part in round r iff it never took part, or took part last in round q
with r - q - 1 >= MinS, and (MaxP = 0 or it took part fewer than MaxP times). Histories are
random (rounds that commit random allowed subsets, empty commits, failed attempts that reopen
the same round) and at random points the guard is rebuilt from the logged rounds alone, as
`serve` does from its SQLite participation log on restart (resume.replay -> record)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.engine.participation import ParticipationGuard
from dpfleet.service.rounds import allowed_waiting


def _oracle(history: list[tuple[int, list[int]]], size: int, r: int, mins: int, maxp: int
            ) -> np.ndarray:
    ok = np.ones(size, dtype=bool)
    for d in range(size):
        rounds = [q for q, devices in history if d in devices]
        if rounds and r - max(rounds) - 1 < mins:
            ok[d] = False
        if maxp and len(rounds) >= maxp:
            ok[d] = False
    return ok


def _rebuilt(history, size, mins, maxp) -> ParticipationGuard:
    guard = ParticipationGuard(size, mins, maxp)
    for q, devices in history:
        guard.record(devices, q)
    return guard


@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 40), mins=st.integers(0, 5), maxp=st.integers(0, 4),
       rounds=st.integers(1, 14), seed=st.integers(0, 2**32 - 1),
       restarts=st.sets(st.integers(0, 13)), fails=st.sets(st.integers(0, 13)))
def test_service_decisions_equal_the_mask_rule_across_restarts(size, mins, maxp, rounds, seed,
                                                               restarts, fails):
    rng = np.random.default_rng(seed)
    guard = ParticipationGuard(size, mins, maxp)
    history: list[tuple[int, list[int]]] = []
    for r in range(rounds):
        if r in restarts:  # kill -9 and `serve` again: only the logged rounds survive
            guard = _rebuilt(history, size, mins, maxp)
        for _attempt in range(2 if r in fails else 1):  # a failed attempt records nothing
            mask = _oracle(history, size, r, mins, maxp)
            checkins = [guard.admits(d, r) for d in range(size)]
            assert checkins == mask.tolist()
            waiting = {int(d): 0.0 for d in rng.choice(size, rng.integers(0, size + 1),
                                                       replace=False)}
            avail, total = allowed_waiting(guard, waiting, r)
            assert avail == sorted(d for d in waiting if mask[d])
            assert total == int(mask.sum())
        allowed = np.flatnonzero(mask)
        took = sorted(rng.choice(allowed, rng.integers(0, allowed.size + 1), replace=False)
                      .tolist()) if allowed.size else []
        guard.record(took, r)
        history.append((r, took))


def test_a_large_population_round_open_never_scans_it():
    """The refused set stays the recent participants: 10^6 devices, MinS 3, 100 per round."""
    size, mins = 1_000_000, 3
    guard = ParticipationGuard(size, mins, 2)
    for r in range(10):
        guard.record(list(range(r * 100, r * 100 + 100)), r)
    waiting = {d: 0.0 for d in range(600, 1200)}  # rounds 6..9 took 600..999; 1000.. never
    avail, total = allowed_waiting(guard, waiting, 10)
    assert avail == list(range(600, 700)) + list(range(1000, 1200))  # round 6 is 3 back
    assert total == size - 300
    assert guard.blocked(10).size == 300
    assert not guard.admits(950, 10) and guard.admits(650, 10) and guard.admits(999_999, 10)
