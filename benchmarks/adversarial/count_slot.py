"""Earlier attack kept in the table: a malicious device amplifies one honest clipped bit through
its own count slot (adaptive clipping under SecAgg). Fixed before this table existed (the ring
distance map of `split_count`), so old main already resisted it; run live on both."""

from __future__ import annotations

import numpy as np

from dpfleet.secagg.count_bit import append_bit, input_length, split_count
from dpfleet.secagg.encoding import Discretizer
from dpfleet.secagg.inprocess import run_round
from dpfleet.secagg.params import plan_round

BITS, DIM, N = 32, 16, 10


def _count(bits: list[int], slot: int, seed: int) -> int:
    """The clipped count of one real in-process round in which device 0 writes `slot`."""
    rng = np.random.default_rng(seed)
    disc = Discretizer(DIM, 1.0, BITS, N, seed)
    setup, _, _ = plan_round(N, input_length(disc, 0.5), BITS, "complete")

    def encode(u: int) -> np.ndarray:
        x = rng.normal(size=DIM)
        values = append_bit(disc.encode(0.5 * x / np.linalg.norm(x), rng).values, 0)
        values[-1] = slot % (1 << BITS) if u == 0 else bits[u]
        return values

    return split_count(run_round(setup, encode).total, disc.padded_length, N, BITS)[1]


def run() -> list[dict]:
    rng = np.random.default_rng(7)
    moves = []
    for trial in range(4):
        known = [0] + [int(b) for b in rng.integers(0, 2, N - 1)]
        slot = -1 - sum(known[2:])  # puts the sum right on the wrap
        counts = [_count(known[:1] + [b] + known[2:], slot, 100 + trial) for b in (0, 1)]
        moves.append(abs(counts[1] - counts[0]))
    return [{
        "name": "count_slot_amplification",
        "succeeded_on_old_main": False,  # fixed in an earlier session; rerun on old main to check
        "succeeds_now": max(moves) > 1,
        "value": {"max_count_move_by_one_honest_bit": max(moves), "bound": 1, "devices": N,
                  "move_with_a_plain_clamp": N},
    }]
