"""Matrix-factorization noise in secure aggregation's ring (dp.mechanism banded / blt with secagg).

Why: with SecAgg nobody range-checks a device's masked input, so a dishonest co-participant can
park the ring sum at the signed wrap, where one honest device's small update moves the *decoded*
sum by ~2^b / s (`ring_noise`, tests/test_ring_wrap_attack.py). Noise must therefore be added in
the ring, before decoding, as the tree's discrete path does. The MF noise (C^-1 z)_t is a real
linear combination of Gaussians, not an integer, so it is rounded first:

    R_t = (S_t + round(y_t)) mod 2^b,     y_t = sigma (C^-1 z)_t,  z_t ~ N(0, I) (secret key),

S_t the integer ring sum of round t, sigma = `RingPlan.sigma` >= z * Delta_s in ring units
(Delta_s = one device's ring L2 bound after rotation and conditional rounding, `Discretizer.
rounding_bound`, the bound the tree's discrete plan already computes). Decoding R_t is
post-processing, as for the tree.

Privacy argument. (1) Lift: for neighbouring fleets (zero-out: one device's inputs removed) the
ring sums differ per round by the device's encoded vector q_t, whose smallest cyclic
representative has ||q_t|| <= Delta_s, or by 0 in rounds it skips - whatever the others (also a
malicious one parking the sum at the wrap) put in. Pick any integer lift L_t of S_t and the lift
L_t + q_t of the neighbour's sum. (2) Since L_t is an integer, L_t + round(y_t) = round(L_t + y_t)
for round(y) = floor(y + 1/2) (`round_half_up`; NOT numpy's rint: ties to even is not invariant
under odd shifts, 1 + rint(1.5) = 3 but rint(2.5) = 2, which the property test found), so
R_t = round(L_t + y_t) mod 2^b: rounding and the modular reduction are post-processing of the
continuous MF Gaussian mechanism on the real sequence L (Denisov et al. 2022: private for
adaptively chosen inputs because C is lower-triangular; the next round's model, hence L_{t+1},
depends only on earlier releases). (3) That mechanism's zero-out sensitivity is Delta_s times
the strategy's min-separation sensitivity (the per-round differences are vectors of norm <=
Delta_s placed in the device's participation pattern; vector directions as in `mf_sensitivity`),
and the noise is sigma >= z Delta_s, so
rho = sens^2 / (2 z^2): exactly the plain MF accountant with the ring's units. The Gaussian PLD
applies (the mechanism is a continuous Gaussian before the rounding). As with the tree's ring
noise, this is central DP on top of SecAgg: the coordinator that adds the noise sees S_t.
With adaptive clipping the round's encoding scale is s C_0 / C_t (s C_t fixed), so ring units are
already the normalised x_t / C_t and the same sigma serves every round (`adaptive_clipping`).

Floating point: y_t is the float64 stream (`MFNoise.next_exact`); `round_half_up` computes
floor(y + 1/2) exactly (floor(y) plus the exact comparison of y - floor(y) with 1/2, no float
addition), so (2) holds for the y_t computed; the idealisation of y_t as an exact Gaussian is the
same as on the plain MF path.

Headroom: the ring level L is sized as for the tree, with the residual's variance factor
max_t ||row_t(C^-1)||^2 (`inverse_variance_factor`) in place of the tree's 1 + floor(log2 T)
nodes, and one more unit for the rounding (`ring_noise.plan_ring`).
"""

from __future__ import annotations

import numpy as np

from dpfleet.coordinator.mechanisms.mf_noise import MFNoise, noise_generator
from dpfleet.coordinator.mechanisms.spec import MechanismSpec


def inverse_variance_factor(spec: MechanismSpec) -> float:
    """max_t ||row_t(C^-1)||^2 over the strategy's rounds: a residual coordinate's variance in
    units of sigma^2. C is Toeplitz, so C^-1 is too, and row t's squared norm is the partial sum
    of its squared impulse response: the largest is the last."""
    stream = noise_generator(spec, 1)
    total = 0.0
    for t in range(spec.rounds):
        total += float(stream.next(np.array([1.0 if t == 0 else 0.0]))[0]) ** 2
    return total


def round_half_up(y: np.ndarray) -> np.ndarray:
    """floor(y + 1/2) exactly, as int64: y - floor(y) is exact in float64, so no addition rounds
    (fl(0.49999999999999994 + 0.5) = 1.0 would). Commutes with adding integers, unlike rint."""
    y = np.asarray(y, dtype=np.float64)
    low = np.floor(y)
    return (low + (y - low >= 0.5)).astype(np.int64)


class RingMFNoise(MFNoise):
    """One segment's MF noise in ring units (`std` = the plan's sigma, `dim` = its padded length):
    round t's residual is the float64 (C^-1 z)_t rounded half up, int64, for `ring_noise.noisy_ring`."""

    def next_residual(self) -> np.ndarray:
        return round_half_up(self.next_exact())
