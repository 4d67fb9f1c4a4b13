"""Independent Gaussian noise every round (the DP-SGD-style baseline) as a `Mechanism`.

Why: it is the reference every DP-FTRL strategy is measured against, and the simplest: round t's
sum gets fresh noise N(0, (z C)^2 I), nothing correlated across rounds. A device that takes part k
times is in k releases of sensitivity C each, so sens^2 = k (in units of C^2) whatever the
separation or restarts, and rho = k / (2 z^2). Each round's noise is independent, so the clip norm
may change every round (adaptive clipping scales round t's noise by C_t / C_0). In the SecAgg ring
each round's noise is one discrete Gaussian node (Canonne, Kamath, Steinke 2020), so eps is by RDP.

Noise positions: segment s, round t of the segment is keystream node (s, 0, t) under its own
domains (b"indep" model, b"indepcount" counts, b"dindep" ring), so it never shares keystream with
another mechanism's noise under the same key; the stream is a pure function of (key, s, t), and a
resume replays its position (the base class's `resume`).

Added with `Mechanism` to show what a new mechanism costs: this file and its tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpfleet.coordinator.mechanisms.base import Mechanism, check_purpose
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes, NodeStream
from dpfleet.coordinator.mechanisms.registry import register

DOMAINS = {"model": b"indep", "count": b"indepcount"}
RING_DOMAIN = b"dindep"


class IndependentStream:
    """Round t's noise is node (segment, 0, t) of `nodes`: nothing carries over between rounds."""

    def __init__(self, nodes, segment: int):
        self.nodes, self.tree_id, self.t = nodes, int(segment), 0

    def next_residual(self) -> np.ndarray:
        self.t += 1
        return self.nodes(self.tree_id, 0, self.t)

    def state_dict(self) -> dict:
        """Position only (the noise is rebuilt from the key)."""
        return {"tree_id": self.tree_id, "t": self.t, "mechanism": "independent"}


class IndependentMechanism(Mechanism):
    """Fresh Gaussian noise on every round's sum."""

    name = "independent"
    supports_restarts = True  # a new segment changes nothing: the rounds are independent already
    adapts_every_round = True

    def identity(self) -> dict:
        return {"kind": "independent"}

    def sensitivity_squared(self, rounds: int, min_separation: int | None, max_participation: int,
                            restarts: Sequence[int] = ()) -> int:
        return int(max_participation)

    def stream(self, dim: int, std: float, key: bytes, segment: int = 0,
               purpose: str = "model") -> IndependentStream:
        return IndependentStream(GaussianNodes(key, std, dim, DOMAINS[check_purpose(purpose)]), segment)

    def ring_stream(self, plan, key: bytes, segment: int = 0) -> IndependentStream:
        from dpfleet.coordinator.mechanisms.discrete_gaussian import DiscreteGaussianNodes

        nodes = DiscreteGaussianNodes(
            plan.sigma_sq, plan.length,
            lambda tree_id, level, index: NodeStream(key, tree_id, level, index, domain=RING_DOMAIN),
            t=plan.t)
        return IndependentStream(nodes, segment)

    def ring_variance_factor(self) -> float:
        return 1.0  # one node per round

    def prefix_error(self, rounds: int) -> float:
        return float(rounds)  # the last prefix sums `rounds` independent unit variances

    def describe(self) -> str:
        return ("independent Gaussian noise every round (the DP-SGD-style baseline): round t's sum "
                "gets fresh N(0, (z C)^2) noise, nothing correlated across rounds")


register("independent", IndependentMechanism, lambda rounds, mins, maxp: IndependentMechanism(),
         lambda identity: IndependentMechanism(),
         "independent Gaussian noise every round (DP-SGD-style baseline):\n"
         "sens^2 = MaxP whatever the separation; the reference the others beat.", planned=False)
