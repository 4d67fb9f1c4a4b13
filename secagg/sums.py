"""What an aggregation returns: the sum of a round's deltas (`AggregateResult`) and, from secure
aggregation, the sum still in the ring (`RingSum`).

They live on the device side's layer, with the secure aggregator that builds them, so that
`dpfleet.secagg` needs nothing from the coordinator; the coordinator's aggregators
(`coordinator/engine/aggregation.py`) and noise code import them from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
