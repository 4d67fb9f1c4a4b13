"""Attack: a malicious device uses its clipped-bit slot to amplify one honest device's bit.

The count noise (adaptive clipping, App. A of Andrew et al.) is calibrated for one device moving
the count by at most 1. Under SecAgg nobody range-checks a device's slot, so a malicious device
that knows every bit but the target's (the DP adversary) puts v = -1 - (their sum) in its slot:
the unmasked ring value is then 2^bits - 1 when the target's bit is 0 and 0 when it is 1. A
plain clamp of the unsigned value into [0, survivors] turned that into a count of n versus 0
(the target's bit moved the count by a whole round, n times what the noise covers); the ring
distance map of `split_count` keeps the move at 1 for every slot value (real rounds and a
hypothesis property over the ring).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.secagg.count_bit import append_bit, input_length, split_count
from dpfleet.secagg.encoding import Discretizer
from dpfleet.secagg.inprocess import run_round
from dpfleet.secagg.params import plan_round

BITS, DIM = 32, 16


def _count(n: int, bits: list[int], slot: int, seed: int) -> int:
    """The clipped count of one real in-process round where device 0 puts `slot` in its slot."""
    rng = np.random.default_rng(seed)
    disc = Discretizer(DIM, 1.0, BITS, n, seed)
    setup, _, _ = plan_round(n, input_length(disc, 0.5), BITS, "complete")

    def encode(u: int) -> np.ndarray:
        x = rng.normal(size=DIM)
        values = append_bit(disc.encode(0.5 * x / np.linalg.norm(x), rng).values, 0)
        if u == 0:  # the malicious device: any ring element in its slot
            values[-1] = slot % (1 << BITS)
        else:
            values[-1] = bits[u]
        return values

    report = run_round(setup, encode)
    assert len(report.survivors) == n
    return split_count(report.total, disc.padded_length, n, BITS)[1]


def test_a_malicious_slot_cannot_amplify_one_honest_bit_beyond_one():
    n, target = 10, 1
    rng = np.random.default_rng(7)
    moves = []
    for trial in range(4):
        known = [0] + [int(b) for b in rng.integers(0, 2, n - 1)]
        slot = -1 - sum(known[u] for u in range(2, n))  # sits the sum on the wrap
        counts = [_count(n, known[:target] + [b] + known[target + 1:], slot, 100 + trial)
                  for b in (0, 1)]
        moves.append(abs(counts[1] - counts[0]))
    # a plain clamp of the unsigned ring value gave n (10) for every trial
    assert max(moves) <= 1, moves


def test_a_malicious_slot_still_lands_inside_the_survivor_range():
    n = 8
    for slot in (0, 3, 7, 10**6, -1, -(10**6), (1 << BITS) // 2):
        count = _count(n, [0] * n, slot, 3)
        assert 0 <= count <= n


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 500), honest=st.integers(0, 499), slot=st.integers(0, (1 << BITS) - 1))
def test_one_honest_bit_moves_the_count_by_at_most_one_for_any_slot(n, honest, slot):
    honest = min(honest, n - 1)  # the others' set bits (the target's bit on top)

    def count(b: int) -> int:
        total = np.array([5, 6, (honest + b + slot) % (1 << BITS)], dtype=np.uint64)
        return split_count(total, 2, n, BITS)[1]

    assert abs(count(1) - count(0)) <= 1
    assert 0 <= count(0) <= n and 0 <= count(1) <= n


def test_honest_counts_read_exactly():
    for n, c in ((1, 0), (1, 1), (100, 0), (100, 37), (100, 100)):
        total = np.array([1, 2, c], dtype=np.uint64)
        assert split_count(total, 2, n, BITS)[1:] == (c, False)
