"""How a round's clipped client deltas become one sum.

The round engine only ever asks an `Aggregator` for the *sum* of a round's flattened,
already-clipped deltas; it never needs one device's delta afterwards. The plain aggregator
adds them in the clear (fast simulation); `dpfleet.secagg` provides one that runs the
pairwise-mask protocol so that the server side only learns the sum. DP-FTRL noise is added
by the coordinator to whatever sum comes back: to the decoded float `total`, or (discrete
noise, `ring_noise`) to the integer `ring` sum before it is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dpfleet.secagg.sums import AggregateResult, check_shapes


class Aggregator(Protocol):
    def aggregate(self, deltas: Sequence[np.ndarray], round_seed: int, *,
                  bits: Sequence[int] | None = None, clip_norm: float | None = None,
                  dim: int | None = None) -> AggregateResult:
        """Sum flattened float deltas (each already clipped to the round's `clip_norm`, None:
        the configured one, and each of shape (`dim`,), the model's length, None: the first
        delta's: `check_shapes`) and, with adaptive clipping, the devices' clipped bits
        (`clipped_count`, over the same survivors)."""
        ...


class PlainAggregator:
    """Adds the deltas in the clear: the fast path for research simulations."""

    def aggregate(self, deltas: Sequence[np.ndarray], round_seed: int, *,
                  bits: Sequence[int] | None = None, clip_norm: float | None = None,
                  dim: int | None = None) -> AggregateResult:
        total = np.zeros(check_shapes(deltas, dim), dtype=np.float64)
        for d in deltas:
            total += d
        return AggregateResult(total=total, survivors=list(range(len(deltas))),
                               clipped_count=None if bits is None else int(sum(bits)))
