"""Plain-aggregation reports: what a device's upload must be before it may touch the sum.

Why so strict: in plain aggregation the coordinator adds the uploads itself, so one upload of
the wrong length, a NaN, an Inf or a norm above the clip norm would change the sum by more than
the sensitivity the DP noise is calibrated to (a NaN would erase everyone's contribution). Each
refusal is decided on the bytes before anything is stored; refused uploads are never summed.

The norm bound has no slack: an upload whose float64 norm is above C by any amount is refused.
The norm is `clipping.norm64`, the very function the devices' clip (`clip_l2`) and the
simulator's `check_clipped` use, and that clip keeps stepping toward zero until norm64 <= C: an
honestly clipped float32 update always passes, bit for bit the same test on both sides.
"""

from __future__ import annotations

import numpy as np

from dpfleet.coordinator.engine.adaptive_clipping import clipped_bit
from dpfleet.edge.clipping import norm64
from dpfleet.edge.wire.messages import ReportStats, parse_stats
from dpfleet.edge.wire.protocol import WireError
from dpfleet.secagg.round_sum import plain_sum
from dpfleet.secagg.sums import AggregateResult


class UploadError(ValueError):
    """A report that is refused (400); the message says why."""


def parse_update(body: bytes, length: int, clip_norm: float) -> np.ndarray:
    """The upload as float32, or `UploadError`."""
    if len(body) != 4 * length:
        raise UploadError(f"update must be {length} little-endian float32 values "
                          f"({4 * length} bytes), got {len(body)} bytes")
    delta = np.frombuffer(body, dtype="<f4").astype(np.float32)
    if not np.isfinite(delta).all():
        raise UploadError("update holds NaN or Inf")
    norm = norm64(delta)
    if not norm <= clip_norm:  # exactly C at most: no slack
        raise UploadError(f"update norm {norm:.6g} exceeds the round's clip norm {clip_norm:.6g}")
    return delta


class PlainCollector:
    """The first `goal` valid reports of a round, summed in position order once complete (so the
    sum is exactly the in-process simulation's, bit for bit)."""

    def __init__(self, n: int, length: int, clip_norm: float, goal: int):
        self.n, self.length, self.clip_norm, self.goal = n, length, clip_norm, goal
        self.updates: dict[int, np.ndarray] = {}
        self.stats: dict[int, ReportStats] = {}

    @property
    def complete(self) -> bool:
        return len(self.updates) >= self.goal

    def accept(self, position: int, body: bytes, headers) -> None:
        if position in self.updates:
            raise UploadError("this device already reported in this round")
        if self.complete:
            raise UploadError("the round already has its report goal")
        delta = parse_update(body, self.length, self.clip_norm)
        try:
            stats = parse_stats(headers)
        except WireError as exc:
            raise UploadError(str(exc)) from None
        self.updates[position], self.stats[position] = delta, stats

    def total(self, count_threshold: float | None = None) -> AggregateResult:
        """The float64 sum over the reports, added in position order (`round_sum.plain_sum`, as
        `simulate` adds them), those positions its survivors; with adaptive clipping's threshold
        C^t, the count of reports whose norm is <= it (`clipped_bit`, as `simulate` counts)."""
        survivors = sorted(self.updates)
        bits = None if count_threshold is None else [
            clipped_bit(self.stats[u].norm, count_threshold) for u in survivors]
        return plain_sum([self.updates[u] for u in survivors], bits=bits, dim=self.length,
                         positions=survivors)
