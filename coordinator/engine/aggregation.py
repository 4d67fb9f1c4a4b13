"""How a round's clipped client deltas become one sum.

The round engine only ever asks an `Aggregator` for the *sum* of a round's flattened,
already-clipped deltas; it never needs one device's delta afterwards. The plain aggregator
adds them in the clear (fast simulation); `dpfleet.secagg` provides one that runs the
pairwise-mask protocol so that the server side only learns the sum. DP-FTRL noise is added
by the coordinator to whatever sum comes back: to the decoded float `total`, or (discrete
noise, `ring_noise`) to the integer `ring` sum before it is decoded. The sums themselves, and
SecAgg's decode, are `dpfleet.secagg.round_sum`'s, which the coordinator service uses as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dpfleet.secagg.round_sum import plain_sum
from dpfleet.secagg.sums import AggregateResult


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
    """Adds the deltas in the clear: the fast path for research simulations (`round_sum.plain_sum`,
    the coordinator service's plain sum too)."""

    def aggregate(self, deltas: Sequence[np.ndarray], round_seed: int, *,
                  bits: Sequence[int] | None = None, clip_norm: float | None = None,
                  dim: int | None = None) -> AggregateResult:
        return plain_sum(deltas, bits=bits, dim=dim)
