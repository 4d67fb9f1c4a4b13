"""How a round's clipped client deltas become one sum.

The round engine only ever asks an `Aggregator` for the *sum* of a round's flattened,
already-clipped deltas; it never needs one device's delta afterwards. The plain aggregator
adds them in the clear (fast simulation); `dpfleet.secagg` provides one that runs the
pairwise-mask protocol so that the server side only learns the sum. DP-FTRL noise is added
by the coordinator to whatever sum comes back: to the decoded float `total`, or (discrete
noise, `ring_noise`) to the integer `ring` sum before it is decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dpfleet.errors import DpfleetError


@dataclass(frozen=True)
class RingSum:
    """A secure sum still in Z_(2^bits), and the map back to reals. Decoding is
    post-processing, so integer noise added to `values` before `decode` protects the release."""

    values: np.ndarray  # unsigned ring elements, the modular sum of the encodings
    bits: int
    decode: Callable[[np.ndarray], np.ndarray]  # ring elements -> float64 sum


@dataclass
class AggregateResult:
    """The sum of a round's deltas plus what the aggregation cost or changed."""

    total: np.ndarray  # float64 vector, the (decoded) sum over surviving clients
    survivors: list[int]  # positions (into the input list) whose deltas are in the sum
    info: dict = field(default_factory=dict)  # e.g. bytes sent, timings, norm inflation
    ring: RingSum | None = None  # the integer sum before decoding (secure aggregation only)
    # adaptive clipping: how many of the survivors had ||delta|| <= C^t, summed with the deltas
    clipped_count: int | None = None


class Aggregator(Protocol):
    def aggregate(self, deltas: Sequence[np.ndarray], round_seed: int, *,
                  bits: Sequence[int] | None = None, clip_norm: float | None = None,
                  dim: int | None = None) -> AggregateResult:
        """Sum flattened float deltas (each already clipped to the round's `clip_norm`, None:
        the configured one, and each of shape (`dim`,), the model's length, None: the first
        delta's: `check_shapes`) and, with adaptive clipping, the devices' clipped bits
        (`clipped_count`, over the same survivors)."""
        ...


def check_shapes(deltas: Sequence[np.ndarray], dim: int | None) -> int:
    """Every delta must be one flat vector of the model's length `dim` (None: the first delta's);
    returns that length. Numpy would broadcast a length-1 delta into every coordinate of the sum,
    moving it by C * sqrt(D) for a delta of norm C, so any other shape is one error, before any
    sum is formed."""
    if not deltas:
        raise ValueError("no deltas to aggregate")
    want = (int(np.size(deltas[0])) if dim is None else int(dim),)
    for pos, d in enumerate(deltas):
        if np.shape(d) != want:
            raise DpfleetError(f"client {pos} of the round sent a delta of shape {np.shape(d)}, the "
                               f"model's is {want}: each device adds exactly one vector of the "
                               "model's length to the sum")
    return want[0]


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
