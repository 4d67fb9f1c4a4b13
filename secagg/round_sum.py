"""A round's clipped updates -> the sum the engine steps with: one owner for both round drivers.

`dpfleet simulate` (in-process, `SecAggAggregator` / `PlainAggregator`) and `dpfleet service
serve` (over HTTP, `service/rounds.py`) collect a round's updates differently, but what they hand
the round engine must not differ: the plain float64 sum in position order (`plain_sum`), or the
SecAgg ring sum split into the model's part and the survivors' clipped count (`count_bit`),
mapped back to reals by the round's `Discretizer`, with one `aggregation` record (`ring_sum`).
It lives on the device side's layer, below the coordinator and the service, because the
in-process secure aggregator here needs it too.

The record's keys are the same from both drivers (`RECORD_KEYS`; metrics.jsonl's `aggregation`
block holds its scalars). Their values are of two kinds:

- protocol facts (`PROTOCOL_FACTS`): what the setup and the encoding are (graph, k, t, scale,
  sensitivity, the quantization bound of the survivors, ...) and how many survived; the same
  for the same config and the same survivors;
- costs, which differ by nature: `simulate` measures the whole emulated protocol in one process
  (every client's work included), `serve` the coordinator's side. `bytes_*_per_client` are the
  SecAgg messages each client sent / received (no HTTP framing; the same from both while every
  device stays: serve counts mail to a vanished device, simulate does not), `seconds` the wall
  time of the aggregation (serve: from the round's opening to the decoded sum, the devices'
  training included), `encode_seconds` the clients' encoding, which only the simulation sees
  (null from serve).

Data-dependent counts (`clipped_coordinates`, `inputs_scaled_down`, `count_out_of_range`) are in
`info` for the debug log, never in the metrics record (`round_engine.DATA_DEPENDENT_AGGREGATION`);
only the simulation sees the encodings, so only it has the first two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dpfleet.secagg.count_bit import split_count
from dpfleet.secagg.encoding import Discretizer, Encoded
from dpfleet.secagg.params import RoundSetup
from dpfleet.secagg.sums import AggregateResult, RingSum, check_shapes

PROTOCOL_FACTS = ("aggregation", "graph", "k", "threshold", "threshold_bounded", "assumed_corrupt",
                  "signed", "bits", "padded_length", "scale", "sensitivity", "norm_inflation",
                  "quantization_bound", "survivors", "rejected_messages")
COSTS = ("bytes_sent_per_client", "bytes_received_per_client", "encode_seconds", "seconds")
RECORD_KEYS = PROTOCOL_FACTS + COSTS


@dataclass(frozen=True)
class RingCosts:
    """What a SecAgg round cost, as its driver measured it (see the module docstring)."""

    bytes_sent: Mapping[int, int]  # client -> bytes of SecAgg messages it sent
    bytes_received: Mapping[int, int]  # client -> bytes of SecAgg messages it received
    seconds: float
    rejected_messages: int
    encode_seconds: float | None = None  # summed over clients; None: the driver cannot see it
    client_seconds: Mapping[str, float] | None = None  # phase -> summed over clients
    server_seconds: Mapping[str, float] | None = None  # phase -> seconds


def plain_sum(deltas: Sequence[np.ndarray], *, bits: Sequence[int] | None = None,
              dim: int | None = None, positions: Sequence[int] | None = None) -> AggregateResult:
    """The deltas added in the clear, in float64 and in their order (so both drivers' sums agree
    bit for bit); with adaptive clipping's `bits`, their count. `positions`: the round positions
    the deltas came from, the survivors (None: 0..n-1, every delta's)."""
    if positions is not None and len(positions) != len(deltas):
        raise ValueError(f"{len(positions)} positions for {len(deltas)} deltas")
    if bits is not None and len(bits) != len(deltas):
        raise ValueError(f"{len(bits)} clipped bits for {len(deltas)} deltas")
    total = np.zeros(check_shapes(deltas, dim), dtype=np.float64)
    for d in deltas:
        total += d
    return AggregateResult(total=total,
                           survivors=list(range(len(deltas)) if positions is None else positions),
                           clipped_count=None if bits is None else int(sum(bits)))


def ring_sum(ring: np.ndarray, disc: Discretizer, setup: RoundSetup, survivors: Sequence[int], *,
             counted: bool, bounded: bool, costs: RingCosts,
             encodings: Mapping[int, Encoded] | None = None) -> AggregateResult:
    """The decoded sum of a finished SecAgg round's unmasked `ring` (Z_(2^bits), the survivors'
    inputs): with `counted` (adaptive clipping) its last element is the survivors' clipped
    count, split off first (`count_bit.split_count`); `bounded`: the graph plan's flag;
    `encodings`: the clients' `Encoded` (in-process only) for the data-dependent counts."""
    survivors = list(survivors)
    count, info = None, record(disc, setup, survivors, bounded=bounded, costs=costs)
    if counted:
        ring, count, info["count_out_of_range"] = split_count(ring, disc.padded_length,
                                                              len(survivors), disc.bits)
    if encodings is not None:
        info["clipped_coordinates"] = sum(encodings[u].clipped_coordinates for u in survivors)
        info["inputs_scaled_down"] = sum(encodings[u].input_scaled_down for u in survivors)
    return AggregateResult(total=disc.decode(ring), survivors=survivors, info=info,
                           ring=RingSum(ring, disc.bits, disc.decode), clipped_count=count)


def record(disc: Discretizer, setup: RoundSetup, survivors: Sequence[int], *, bounded: bool,
           costs: RingCosts) -> dict:
    """The round's aggregation record: `RECORD_KEYS`, then the per-client lists and per-phase
    timings (not scalars: `info` only)."""
    n = setup.n
    info = {
        "aggregation": "secagg",
        "graph": "complete" if setup.k == n - 1 else "harary",
        "k": setup.k,
        "threshold": setup.threshold,
        "threshold_bounded": bounded,
        "assumed_corrupt": setup.corrupt,
        "signed": setup.signed,
        "bits": disc.bits,
        "padded_length": disc.padded_length,
        "scale": disc.scale,
        "sensitivity": disc.sensitivity,
        "norm_inflation": disc.norm_inflation,
        "quantization_bound": disc.quantization_bound(len(survivors)),
        "survivors": len(survivors),
        "rejected_messages": costs.rejected_messages,
        "bytes_sent_per_client": float(np.mean([costs.bytes_sent.get(u, 0) for u in range(n)])),
        "bytes_received_per_client": float(np.mean([costs.bytes_received.get(u, 0)
                                                    for u in range(n)])),
        "encode_seconds": costs.encode_seconds,
        "seconds": costs.seconds,
        "dropped": sorted(set(range(n)) - set(survivors)),
    }
    if costs.client_seconds is not None:
        info["client_seconds"] = dict(costs.client_seconds)
    if costs.server_seconds is not None:
        info["server_seconds"] = dict(costs.server_seconds)
    return info
