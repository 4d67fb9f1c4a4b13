"""Earlier attack kept in the table: a malicious device amplifies one honest clipped bit through
its own count slot (adaptive clipping under SecAgg). Fixed before this table existed (the ring
distance map of `split_count`), so old main already resisted it. Runs the real in-process rounds
of `tests/test_count_slot_attack.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_count_slot_attack import _count  # noqa: E402  (the attack's real round)

N = 10


def run() -> list[dict]:
    rng = np.random.default_rng(7)
    moves = []
    for trial in range(4):
        known = [0] + [int(b) for b in rng.integers(0, 2, N - 1)]
        slot = -1 - sum(known[2:])  # puts the sum right on the wrap
        counts = [_count(N, known[:1] + [b] + known[2:], slot, 100 + trial) for b in (0, 1)]
        moves.append(abs(counts[1] - counts[0]))
    return [{
        "name": "count_slot_amplification",
        "succeeded_on_old_main": False,  # fixed in an earlier session (a plain clamp moved it by N)
        "succeeds_now": max(moves) > 1,
        "value": {"max_count_move_by_one_honest_bit": max(moves), "bound": 1, "devices": N,
                  "move_with_a_plain_clamp": N},
    }]
