"""Banded and BLT matrix-factorization DP-FTRL as a `Mechanism` (a `spec.MechanismSpec` strategy).

Noise: `mf_noise.MFNoise` ((C^-1 z)_t from the key's z_t, domains b"mf" / b"mfcount") on the float
path, `mf_ring.RingMFNoise` (the same, rounded half up, in ring units) in the SecAgg ring; a resume
point holds only the position and the stream is replayed from the key. Sensitivity: the strategy's
min-separation sensitivity over its n rounds (`spec.sensitivity_squared`: with one participation
any separation holds), an upper bound for any prefix of the rounds; a crash that lost released
rounds goes on in a fresh segment, and segments add (`restarts` counts them). The mechanism is
private for adaptively chosen inputs (C lower-triangular, Denisov et al. 2022), so adaptive
clipping adopts a new clip norm every round.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpfleet.coordinator.mechanisms.base import Mechanism, check_purpose
from dpfleet.coordinator.mechanisms.mf_noise import MF_COUNT_DOMAIN, MF_DOMAIN, MFNoise
from dpfleet.coordinator.mechanisms.registry import build, register
from dpfleet.coordinator.mechanisms.spec import (
    MechanismSpec,
    optimize_mechanism,
    prefix_error,
    sensitivity_squared,
)
from dpfleet.errors import DpfleetError

DOMAINS = {"model": MF_DOMAIN, "count": MF_COUNT_DOMAIN}


class MatrixMechanism(Mechanism):
    """A banded / BLT strategy (`MechanismSpec`, e.g. from `spec.optimize_mechanism`)."""

    adapts_every_round = True
    ring_is_rounded_gaussian = True  # `mf_ring`: round_half_up(sigma (C^-1 z)_t)

    def __init__(self, spec: MechanismSpec):
        if not isinstance(spec, MechanismSpec) or spec.kind == "tree":
            raise DpfleetError(f"a matrix mechanism needs a banded or BLT MechanismSpec, got {spec!r}")
        self.spec, self.name = spec, spec.kind

    def identity(self) -> dict:
        return self.spec.to_json()

    def sensitivity_squared(self, rounds: int, min_separation: int | None, max_participation: int,
                            restarts: Sequence[int] = ()) -> float:
        if max_participation == 0:
            return 0.0
        segments = 1 + len(restarts)
        return segments * sensitivity_squared(self.spec, min_separation or 0, max_participation)

    def stream(self, dim: int, std: float, key: bytes, segment: int = 0,
               purpose: str = "model") -> MFNoise:
        return MFNoise(self.spec, dim, key, std, segment, DOMAINS[check_purpose(purpose)])

    def resume(self, state: dict, dim: int, std: float, key: bytes, purpose: str = "model") -> MFNoise:
        return MFNoise.from_state(state, self.spec, key, std, DOMAINS[check_purpose(purpose)])

    def ring_stream(self, plan, key: bytes, segment: int = 0) -> MFNoise:
        from dpfleet.coordinator.mechanisms.mf_ring import RingMFNoise

        return RingMFNoise(self.spec, plan.length, key, plan.sigma, segment)

    def resume_ring(self, state: dict, plan, key: bytes) -> MFNoise:
        from dpfleet.coordinator.mechanisms.mf_ring import RingMFNoise

        return RingMFNoise.from_state(state, self.spec, key, plan.sigma)

    def ring_variance_factor(self) -> float:
        from dpfleet.coordinator.mechanisms.mf_ring import inverse_variance_factor

        return inverse_variance_factor(self.spec)

    def prefix_error(self, rounds: int) -> float:
        """Over the strategy's own n rounds (it is built for them)."""
        return prefix_error(self.spec)

    def describe(self) -> str:
        s = self.spec
        if s.kind == "banded":
            return (f"banded matrix factorization (BandMF, Choquette-Choo et al. 2023) over {s.rounds} "
                    f"rounds: {s.bands} bands, coefficients {', '.join(f'{c:.4g}' for c in s.coefficients)}")
        return (f"buffered linear Toeplitz matrix factorization (BLT, McMahan et al. 2024) over {s.rounds} "
                f"rounds: {len(s.theta)} buffers, theta {', '.join(f'{t:.6g}' for t in s.theta)}, omega "
                f"{', '.join(f'{w:.4g}' for w in s.omega)}")


def _rebuilt(identity: dict) -> MatrixMechanism:
    return MatrixMechanism(MechanismSpec.from_json(identity))


def _optimised(kind: str):
    return lambda rounds, mins, maxp: MatrixMechanism(optimize_mechanism(kind, rounds, mins, maxp))


register("banded", MatrixMechanism, _optimised("banded"), _rebuilt,
         "banded Toeplitz matrix factorization (BandMF, Choquette-Choo et al. 2023):\n"
         "MinS + 1 bands optimised for (n, MinS, MaxP); memory bands x model.")
register("blt", MatrixMechanism, _optimised("blt"), _rebuilt,
         "buffered linear Toeplitz (McMahan et al. 2024): a few decaying buffers\n"
         "optimised for (n, MinS, MaxP); memory buffers x model, any n.")


def as_mechanism(obj: object) -> Mechanism:
    """A `Mechanism` from itself, a `spec.MechanismSpec` or None (the tree). Here, not in
    `registry`, because it builds this module's class: the registry is below every mechanism."""
    if isinstance(obj, Mechanism):
        return obj
    if obj is None or (isinstance(obj, MechanismSpec) and obj.kind == "tree"):
        return build("tree", 1, 0, 1)
    if isinstance(obj, MechanismSpec):
        return MatrixMechanism(obj)
    raise DpfleetError(f"a noise mechanism must subclass dpfleet.extensions.Mechanism, not "
                       f"{type(obj).__name__}")
