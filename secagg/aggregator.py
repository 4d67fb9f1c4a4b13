"""`Aggregator` for the round engine: encode -> SecAgg(+) round in-process -> decode.

The coordinator builds this when its config says `aggregation = "secagg"`, hands it the round's
clipped deltas and gets back only their (decoded) sum, exactly as from `PlainAggregator`.
The differences it must account for are in `info`:

- `sensitivity` / `norm_inflation`: the L2 norm one client can contribute after discretization
  (>= clip_norm); DP-FTRL must calibrate its noise to `sensitivity`, not to the clip norm;
- `quantization_bound`: proven L2 distance between `total` and the exact sum of the surviving
  clients' clipped deltas (holds whenever `clipped_coordinates` is 0, which the scale makes a
  1e-6-per-client event);
- `clipped_count` (adaptive clipping, when `bits` are given): each device's clipped bit rides
  in the same masked vector as one exact extra coordinate, so the count covers exactly the
  survivors (`count_bit`);
- `survivors`: clients that vanish in the protocol's phases (the caller's `dropouts`: the device
  model's draws in `simulate`) are left out of the sum, as on a real fleet; DP accounting must
  count only them;
- costs: bytes sent/received per client, per-phase client and server seconds.

The decode, the count's split and the record are `round_sum.ring_sum`'s, which the coordinator
service's rounds use too, so both drivers hand the engine the same kind of result.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.errors import DpfleetError
from dpfleet.secagg.count_bit import append_bit
from dpfleet.secagg.encoding import Discretizer, rounding_seed
from dpfleet.secagg.identity_keys import load_fleet_file
from dpfleet.secagg.inprocess import PHASES, run_round
from dpfleet.secagg.params import fleet_margins, plan_round
from dpfleet.secagg.policy import ClientPolicy
from dpfleet.secagg.round_sum import RingCosts, ring_sum
from dpfleet.secagg.sums import AggregateResult, check_shapes


class SecAggAggregator:
    """Sums deltas through the secure-aggregation protocol (an `Aggregator`)."""

    def __init__(
        self,
        clip_norm: float,
        bits: int = 32,
        graph: str = "harary",
        threshold: int | None = None,
        assumed_dropout: float = 0.1,
        corruption: float = 0.05,
        signed: bool = False,
        block_size: int = 1 << 14,
        fleet_keys: str | Path | None = None,
        ring_clients: int | None = None,
        report_goal: int | None = None,
    ) -> None:
        """clip_norm: the L2 clip C of the deltas; bits: ring Z_(2^bits), at most 32;
        graph: "harary" (SecAgg+) or "complete" (SecAgg); threshold: Shamir t (derived from
        assumed_dropout and corruption when None, see `dpfleet.secagg.graph`); assumed_dropout:
        the fraction of clients k and t are planned to lose; signed: add signatures and the
        consistency round (malicious-server setting); the emulated fleet's identity keys are
        made once and pinned on every emulated device, and each device's local policy demands
        the planned n, k, t and c; fleet_keys: a fleet key
        file (`dpfleet.secagg.identity_keys`) holding those identity keys instead (signed mode);
        ring_clients: size the per-client coordinate range for this many clients instead of
        the round's count (fixed scale across rounds, and headroom for integer noise added to
        the ring sum, see `coordinator.ring_noise`); report_goal: the inputs a round must keep,
        which plans the dropout k and t absorb as the coordinator service plans them
        (`params.fleet_margins`) instead of from assumed_dropout."""
        if clip_norm <= 0:
            raise ValueError(f"clip_norm must be positive, got {clip_norm}")
        self.clip_norm, self.bits, self.graph = clip_norm, bits, graph
        self.threshold, self.assumed_dropout, self.corruption = threshold, assumed_dropout, corruption
        self.signed, self.block_size = signed, block_size
        # the emulated devices' identity keys: from the fleet key file, or made once per run
        self._fleet: dict[int, Ed25519PrivateKey] = (
            load_fleet_file(Path(fleet_keys)) if fleet_keys and signed else {})
        self._fleet_file = fleet_keys if signed else None
        self.ring_clients, self.report_goal = ring_clients, report_goal

    def aggregate(self, deltas: Sequence[np.ndarray], round_seed: int, *,
                  bits: Sequence[int] | None = None, clip_norm: float | None = None,
                  dim: int | None = None, disc: Discretizer | None = None,
                  dropouts: Mapping[str, Collection[int]] | None = None) -> AggregateResult:
        """`bits`: each device's clipped bit (adaptive clipping), masked as one more exact
        coordinate after its model part (`count_bit`); the result's `clipped_count`.
        `clip_norm`: the round's clip (adaptive clipping moves it at tree restarts); the
        discretizer is scaled to it (None: the constructor's). `dim`: the model's length, which
        every delta must have (`check_shapes`; None: the first delta's). `disc`: the round's
        discretizer (`round_engine.round_discretizer`; None: one built here). `dropouts`: the
        clients (positions) vanishing before each phase's message (`inprocess.run_round`)."""
        length = check_shapes(deltas, dim)
        if bits is not None and len(bits) != len(deltas):
            raise ValueError(f"{len(bits)} clipped bits for {len(deltas)} deltas")
        started = time.perf_counter()
        n = len(deltas)
        if self.ring_clients is not None and n > self.ring_clients:
            raise ValueError(f"{n} clients exceed the ring's {self.ring_clients}")
        if disc is None:
            disc = Discretizer(length, clip_norm or self.clip_norm, self.bits,
                               self.ring_clients or n, round_seed, block_size=self.block_size)
        if self.signed and self._fleet_file and len(self._fleet) < n:
            raise DpfleetError(f"fleet key file {self._fleet_file} holds {len(self._fleet)} "
                               f"identity keys, the round has {n} clients")
        if self.signed:
            for u in range(len(self._fleet), n):
                self._fleet[u] = Ed25519PrivateKey.generate()
        dropout, unrevealed = self._margins(n)
        setup, identities, plan = plan_round(
            n, disc.padded_length + (bits is not None), self.bits, self.graph, self.threshold,
            dropout, self.corruption, self.signed,
            identity_keys={u: self._fleet[u] for u in range(n)} if self.signed else None,
            unrevealed=unrevealed)
        gone = {p: set(d) for p, d in (dropouts or {}).items()}
        encodings = {}
        encode_seconds = 0.0

        def encode(u: int) -> np.ndarray:
            nonlocal encode_seconds
            begun = time.perf_counter()
            encodings[u] = disc.encode(deltas[u], np.random.default_rng(rounding_seed(round_seed, u)))
            encode_seconds += time.perf_counter() - begun
            values = encodings[u].values
            return values if bits is None else append_bit(values, int(bits[u]))

        report = run_round(setup, encode, identities, dropouts=gone,
                           policy=ClientPolicy.for_setup(setup))
        costs = RingCosts(
            bytes_sent=report.bytes_sent, bytes_received=report.bytes_received,
            seconds=time.perf_counter() - started, rejected_messages=len(report.rejections),
            encode_seconds=encode_seconds,
            client_seconds={p: sum(report.client_seconds[p].values()) for p in PHASES},
            server_seconds=report.server_seconds)
        return ring_sum(report.total, disc, setup, report.survivors, counted=bits is not None,
                        bounded=plan.bounded, costs=costs, encodings=encodings)

    def _margins(self, n: int) -> tuple[float, int]:
        """(dropout, d) k and t are planned for: the service's `fleet_margins` with a report
        goal, else `assumed_dropout` and no d."""
        if self.report_goal is None:
            return self.assumed_dropout, 0
        return fleet_margins(n, min(self.report_goal, n))
