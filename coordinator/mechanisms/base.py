"""A DP-FTRL noise mechanism as ONE object: strategy, sensitivity, noise streams, state, event.

Why one object: before it, a mechanism's noise was built in three places and its privacy
computed in about eight, and the seams leaked (a resumed run accounted as the tree for noise it
never added; a banded run's vocabulary total from the tree's zCDP). Everything that needs noise or
a sensitivity now asks a `Mechanism`: the model noise and adaptive clipping's clipped-count noise
(`stream`, float; `ring_stream`, integer, in the SecAgg ring), resume (`resume`), restarts
(`segment`), the run accountant, the planner, `dpfleet account`, the audit and the service
(`sensitivity_squared`, `event`). The built-ins are `tree.TreeMechanism` and `matrix.
MatrixMechanism` (banded, BLT); `independent.IndependentMechanism` shows what adding one takes.

Contract of a stream (`NoiseStream`): `next_residual()` is round t's noise (t = 1, 2, ... within
its segment), added to round t's sum; `t` and `tree_id` (the segment) say where it stands; a pure
function of (key, purpose, segment, t), so a resume rebuilds it and no two segments share noise.
`state_dict()` returns its position as a JSON object: at least {"t": t, "tree_id": segment}, plus
any other JSON numbers, strings or lists `resume` needs, and never a noise value (the resume
point stores it as it is, next to the model; an array is refused). `Mechanism.resume(state, ...)`
gets that dict back and rebuilds the stream from the key: the default replays t rounds, the tree
recomputes its live nodes.

Identity: `identity()` is the strategy's parameters as JSON; `fingerprint()` hashes it with the
name. The run binds it (config.json's `mechanism`, every release record, the resume point), so a
resume with another mechanism, strategy or custom part is refused (`binding`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import dp_accounting
import numpy as np

from dpfleet.errors import DpfleetError
from dpfleet.jsonio import canonical_sha256

# squared-sensitivity factor of each adjacency: replace-one moves each contribution by up to 2C
# (here, with the sensitivities: `spec` and the accountants both scale by it)
ADJACENCY = {"zero-out": 1, "replace-one": 4}
PURPOSES = ("model", "count")  # the model's noise; adaptive clipping's clipped-count noise


@runtime_checkable
class NoiseStream(Protocol):
    """One noise segment: round t's residual, its position and its resumable state."""

    t: int
    tree_id: int

    def next_residual(self) -> np.ndarray: ...

    def state_dict(self) -> dict:
        """The position, as JSON: {"t": t, "tree_id": segment, ...}, never a noise value."""
        ...


class Mechanism(abc.ABC):
    """Base of every DP-FTRL noise mechanism (module docstring). Subclass it for your own:
    `identity`, `sensitivity_squared` and `stream` are required; the rest have defaults that
    either work for any keyed stream (`resume` replays it) or refuse, naming the missing part."""

    name: str = ""
    # fresh segments at configured restart rounds, accounted exactly (the tree's restarts)
    supports_restarts: bool = False
    # the clip norm may change every round: the mechanism is private for adaptively chosen
    # inputs, so round t's noise is scaled by C_t / C_0 (matrix factorization, independent noise)
    adapts_every_round: bool = False
    # the ring form is post-processing of the continuous Gaussian (rounded), so the Gaussian PLD
    # bounds it; False (the tree's discrete Gaussian, CKS 2020): eps by RDP of its zCDP
    ring_is_rounded_gaussian: bool = False

    @abc.abstractmethod
    def identity(self) -> dict:
        """The strategy's parameters (JSON-ready); with `name`, what `fingerprint` hashes."""

    def fingerprint(self) -> str:
        return canonical_sha256({"name": self.name, "identity": self.identity()}).hexdigest()

    @abc.abstractmethod
    def sensitivity_squared(self, rounds: int, min_separation: int | None, max_participation: int,
                            restarts: Sequence[int] = ()) -> float:
        """Worst-case squared L2 sensitivity (units of the clip norm C) of the `rounds` releases
        for a device with at most `max_participation` participations, at least `min_separation`
        rounds strictly between two (None: nobody took part twice), each moving the sum by <= C;
        `restarts`: rounds where a fresh segment started. 0 when max_participation is 0."""

    @abc.abstractmethod
    def stream(self, dim: int, std: float, key: bytes, segment: int = 0,
               purpose: str = "model") -> NoiseStream:
        """Segment `segment`'s float32 noise of per-unit std `std` (z C), drawn from the run's
        secret `key`; `purpose` "count" must give noise independent of "model"'s."""

    def resume(self, state: dict, dim: int, std: float, key: bytes, purpose: str = "model") -> NoiseStream:
        """The stream a resume point's `state_dict()` describes (default: replayed from the key)."""
        stream = self.stream(dim, std, key, int(state["tree_id"]), purpose)
        for _ in range(int(state["t"])):
            stream.next_residual()
        return stream

    def ring_stream(self, plan, key: bytes, segment: int = 0) -> NoiseStream:
        """Integer noise added in the SecAgg ring (`ring_noise.RingPlan`, ring units)."""
        raise DpfleetError(f"the noise mechanism {self.name!r} has no ring form (ring_stream): run it "
                           "without secure aggregation's ring noise (dp.noise = 'gaussian')")

    def resume_ring(self, state: dict, plan, key: bytes) -> NoiseStream:
        stream = self.ring_stream(plan, key, int(state["tree_id"]))
        for _ in range(int(state["t"])):
            stream.next_residual()
        return stream

    def ring_variance_factor(self) -> float | None:
        """A ring residual coordinate's variance in units of sigma^2 when it is not the tree's
        1 + floor(log2 T) nodes (the ring's headroom, `ring_noise.plan_ring`); None: the tree's."""
        return None

    def event(self, noise_multiplier: float, rounds: int, min_separation: int | None,
              max_participation: int, restarts: Sequence[int] = ()) -> dp_accounting.DpEvent:
        """The privacy event of the releases: one Gaussian at the effective noise multiplier
        z / sqrt(sens^2) (DP-FTRL with any linear strategy is one Gaussian mechanism)."""
        s = float(self.sensitivity_squared(rounds, min_separation, max_participation, restarts))
        return gaussian_event(noise_multiplier, s)

    def prefix_error(self, rounds: int) -> float:
        """The worst round's prefix-sum noise variance over `rounds` at unit noise multiplier (how
        the planner compares mechanisms' model noise at equal zCDP)."""
        raise DpfleetError(f"the noise mechanism {self.name!r} has no prefix_error: the planner cannot "
                           "compare it")

    def describe(self) -> str:
        """One sentence on the strategy for the privacy report."""
        return f"{self.name} noise"


def gaussian_event(noise_multiplier: float, sensitivity_squared: float) -> dp_accounting.DpEvent:
    """A Gaussian release of multiplier z and squared sensitivity s as a DpEvent: the Gaussian
    at z / sqrt(s); nothing released about anyone with s = 0; no privacy with z = 0."""
    if sensitivity_squared == 0:
        return dp_accounting.NoOpDpEvent()
    if noise_multiplier == 0:
        return dp_accounting.NonPrivateDpEvent()
    return dp_accounting.GaussianDpEvent(noise_multiplier / math.sqrt(sensitivity_squared))


def check_purpose(purpose: str) -> str:
    if purpose not in PURPOSES:
        raise DpfleetError(f"unknown noise purpose {purpose!r}; use one of {', '.join(PURPOSES)}")
    return purpose

