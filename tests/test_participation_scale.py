"""Cohort selection without O(population) masks selects exactly the devices the mask-based draw
did (existing runs keep their participation), and the guard's refused set is exact."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.config import ParticipationSection
from dpfleet.coordinator.engine.participation import (
    Participation,
    ParticipationGuard,
    RoundUnfillable,
    nth_unblocked,
)


def mask_draw(part: Participation, r: int, available=None, extra: int = 0) -> list[int]:
    """The selection as it was written before (a full allowed mask and rng.choice over the pool
    array): the reference the O(cohort) path must reproduce bit for bit."""
    allowed = part.guard.allowed(r)
    if available is not None:
        allowed &= np.isin(np.arange(part.size), available)
    pool = np.flatnonzero(allowed)
    if pool.size < part.report_goal:
        raise RoundUnfillable("reference: too few")
    tag = 0x5B if part.section.mode == "uniform" else 0x5C
    rng = np.random.default_rng([part.seed, tag, r])
    return sorted(rng.choice(pool, min(part.report_goal + extra, pool.size), replace=False).tolist())


@settings(max_examples=60, deadline=None)
@given(size=st.integers(5, 300), goal=st.integers(1, 5), mins=st.integers(0, 4),
       maxp=st.integers(0, 3), seed=st.integers(0, 2**31), rounds=st.integers(1, 25),
       sparse=st.booleans())
def test_uniform_selection_equals_the_mask_draw(size, goal, mins, maxp, seed, rounds, sparse):
    section = ParticipationSection(mode="uniform", min_separation=mins, max_participation=maxp)
    part = Participation(section, size, goal, rounds, seed)
    rng = np.random.default_rng(seed)
    for r in range(rounds):
        available = (rng.choice(size + 3, size // 2, replace=False) - 3) if sparse else None
        assert np.array_equal(part.guard.blocked(r), np.flatnonzero(~part.guard.allowed(r)))
        try:
            want = mask_draw(part, r, available, extra=r % 2)
        except RoundUnfillable:
            with pytest.raises(RoundUnfillable):
                part.propose(r, available, extra=r % 2)
            return
        got = part.propose(r, available, extra=r % 2)
        assert got.devices == want
        part.commit(got, got.devices[:goal])


def test_timer_mode_with_checked_in_devices_equals_the_mask_draw():
    section = ParticipationSection(mode="timer", min_separation=2)
    part = Participation(section, 200, 10, 30, seed=7)
    rng = np.random.default_rng(1)
    for r in range(30):
        available = rng.choice(200, 60, replace=False)
        want = mask_draw(part, r, available, extra=3)
        got = part.propose(r, available, extra=3)
        assert got.devices == want
        part.commit(got, got.devices)


@given(blocked=st.sets(st.integers(0, 60), max_size=40))
def test_nth_unblocked_indexes_the_unblocked_devices(blocked):
    b = np.array(sorted(blocked), dtype=np.int64)
    free = np.setdiff1d(np.arange(61 + len(b)), b)
    positions = np.arange(free.size)
    assert np.array_equal(nth_unblocked(b, positions), free)


def test_blocked_is_small_for_a_large_population():
    """A million devices, MinS 3: the refused set is the last 3 rounds' devices, and a pruned
    window falls back to the exact scan instead of forgetting anybody."""
    guard = ParticipationGuard(10**6, min_separation=3, max_participation=2)
    for r in range(6):
        guard.record(list(range(r * 50, r * 50 + 50)), r)
    blocked = guard.blocked(6)
    assert blocked.tolist() == list(range(150, 300))
    assert np.array_equal(guard.blocked(2), np.flatnonzero(~guard.allowed(2)))  # pruned: scan
    guard.record(list(range(50)), 9)  # second participation: at the MaxP cap from now on
    assert set(range(50)) <= set(guard.blocked(100).tolist())
    assert guard.blocked(100).size == 50


def test_selection_at_a_million_devices_is_uniform_over_the_allowed():
    """Not a bias toward low indices: the drawn devices spread over the whole population and
    never include a refused one."""
    section = ParticipationSection(mode="uniform", min_separation=1)
    part = Participation(section, 10**6, 100, 20, seed=3)
    picked = []
    for r in range(20):
        sel = part.propose(r)
        assert sel.devices == mask_draw(part, r)  # numpy's large-population (Floyd) path too
        assert not set(sel.devices) & set(part.guard.blocked(r).tolist())
        part.commit(sel, sel.devices)
        picked += sel.devices
    assert abs(np.mean(picked) / 10**6 - 0.5) < 0.05  # sd of the mean ~ 0.0065


def test_checked_in_list_with_repeats_and_unknown_ids_cannot_pass_a_refused_device():
    """Attack by a lying check-in list: every recently-seen device sent many times, plus ids past
    the population. The draw equals the mask draw and holds no refused or unknown device."""
    section = ParticipationSection(mode="timer", min_separation=3, max_participation=2)
    part = Participation(section, 120, 8, 40, seed=11)
    rng = np.random.default_rng(4)
    for r in range(40):
        recent = part.guard.blocked(r)
        available = np.concatenate([np.repeat(recent, 5), rng.choice(120, 40, replace=False),
                                    np.arange(120, 140)])
        try:
            want = mask_draw(part, r, available, extra=2)
        except RoundUnfillable:
            with pytest.raises(RoundUnfillable):
                part.propose(r, available, extra=2)
            continue
        got = part.propose(r, available, extra=2)
        assert got.devices == want
        assert not set(got.devices) & set(recent.tolist()) and max(got.devices) < 120
        part.commit(got, got.devices)
    assert part.guard.count.max() == 2  # MaxP held while the caps were reached
