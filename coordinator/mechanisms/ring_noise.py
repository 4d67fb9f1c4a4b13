"""DP-FTRL tree noise as a discrete Gaussian added to secure aggregation's ring sum.

`dp.noise = "discrete"` (requires `aggregation.kind = "secagg"`): each round the DP-FTRL server
adds the integer tree residual (its `TreeNoise` over `ring_nodes`, int64 discrete Gaussian
nodes under the run's secret noise key) to the ring sum in Z_(2^b) and only then decodes; the
release log, resume and fresh-tree restarts treat these nodes exactly like Gaussian ones.
The released quantity is sum + noise in Z_(2^b); the float
decode (unscale, unrotate) and the server optimizer are post-processing, so no floating-point
sampler touches a release. (As with Gaussian noise, the coordinator that adds the noise sees the
un-noised ring sum: this is central DP on top of SecAgg, not distributed noise.)

Calibration, in integer (scaled) units: one client's rounded vector has L2 norm <= Delta_s
(`Discretizer.rounding_bound`, a hard bound by conditional rounding); the rotation differs per
round but is public and data-independent, so the tree over the integer round sums has the
usual sensitivity and sigma = z * Delta_s gives rho = S / (2 z^2) exactly as the continuous
Gaussian (Canonne, Kamath, Steinke 2020, Thm. 14). sigma^2 is rounded *up* to an integer t * c.

Dishonest participants: nobody range-checks a device's masked input, so a malicious device can
park the sum at the signed wrap 2^(b-1), where one honest device's update q flips the *decoded*
sum by ~2^b / s per coordinate it carries across. Noise added after decoding (`dp.noise =
"gaussian"`) is then calibrated for the wrong sensitivity. Here the released value is
(sum + noise) mod 2^b: whatever the others put in, with an integer lift M of their sum it is
(M + q + N) mod 2^b, so one device's data shifts a discrete Gaussian on Z by q, ||q|| <= Delta_s,
and the modular reduction and decoding are post-processing. Hence the default with SecAgg
(`config.resolve_noise`; attack and property test: tests/test_ring_wrap_attack.py).

Headroom: the ring level L (per-client coordinate bound) is sized for `ring_clients` >= the
round's most clients n (`round_size`: the report goal plus over-selection), so that n L plus the
largest residual noise never wraps. A residual sums at most
j = 1 + floor(log2 T) independent nodes; the discrete Gaussian is sigma-subgaussian (CKS 2020,
Sec. 2: E exp(lambda X) <= exp(lambda^2 sigma^2 / 2)), so P(|residual coordinate| >= x) <=
2 exp(-x^2 / (2 j sigma^2)), and over d' coordinates and T rounds the run wraps with
probability <= WRAP_PROBABILITY when n L + sigma sqrt(2 j ln(2 d' T / WRAP_PROBABILITY))
<= 2^(b-1) - 1. A config that cannot meet this is refused. (A wrap, honest or forced by a
malicious input, only spoils utility: privacy is that of the ring value.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpfleet.coordinator.mechanisms.discrete_gaussian import DiscreteGaussianNodes, integer_sigma_sq
from dpfleet.coordinator.mechanisms.noise_stream import NodeStream
from dpfleet.errors import DpfleetError
from dpfleet.secagg.encoding import Discretizer
from dpfleet.secagg.sums import RingSum

WRAP_PROBABILITY = 1e-12  # per run: some coordinate of some round leaves the signed ring
SIGMA_MARGIN = 1e-9  # relative: sigma^2 >= z^2 Delta_s^2 despite float rounding of Delta_s


@dataclass(frozen=True)
class RingPlan:
    """The ring layout and noise scale of a discrete-noise run (fixed for the whole run)."""

    ring_clients: int  # the Discretizer's client count: level L = (2^(b-1) - 1) // ring_clients
    length: int  # d': ring vector length (the model dimension padded to the rotation block)
    level: int
    scale: float  # s: integer units per unit of the (rotated) float sum
    delta_s: float  # Delta_s: one client's L2 bound in integer units
    sigma_sq: Fraction  # per-node discrete Gaussian variance parameter, integer units
    t: int  # the sampler's discrete Laplace scale (sigma^2 = t * c)
    noise_bound: float  # |residual coordinate| bound that holds w.p. 1 - WRAP_PROBABILITY
    wrap_probability: float

    @property
    def sigma(self) -> float:
        return math.sqrt(self.sigma_sq)

    @property
    def noise_std(self) -> float:
        """Per-node noise in decoded (float) units, the analogue of the Gaussian's z * sensitivity."""
        return self.sigma / self.scale


def ring_summary(plan: RingPlan, bits: int, clip_norm: float) -> dict:
    """What the privacy report and privacy.json say about the discretization (JSON-ready):
    Delta_s against s C (the rounding's inflation) and sigma against z Delta_s."""
    scaled_clip = plan.scale * clip_norm
    return {"bits": bits, "ring_clients": plan.ring_clients, "length": plan.length,
            "level": plan.level, "scale": plan.scale, "scaled_clip": scaled_clip,
            "delta_s": plan.delta_s, "norm_inflation": plan.delta_s / scaled_clip,
            "sigma_sq": int(plan.sigma_sq) if plan.sigma_sq.denominator == 1 else str(plan.sigma_sq),
            "effective_z": plan.sigma / plan.delta_s, "wrap_probability": plan.wrap_probability}


def plan_ring(dim: int, clip_norm: float, bits: int, clients: int, noise_multiplier: float,
              rounds: int, block_size: int = 1 << 14, variance_factor: float | None = None
              ) -> RingPlan:
    """The smallest ring_clients >= clients whose ring holds the noise; DpfleetError if none.
    `variance_factor`: a residual coordinate's variance in units of sigma^2 when it is not the
    tree's 1 + floor(log2 T) nodes (matrix-factorization noise, `mf_ring`: also rounded, + 1/2)."""
    if noise_multiplier <= 0:
        raise DpfleetError("dp.noise = 'discrete' needs dp.noise_multiplier > 0")
    half = (1 << (bits - 1)) - 1
    depth = 1 + max(rounds, 1).bit_length() - 1  # nodes in one residual: 1 + floor(log2 T)
    rounding = 0.0 if variance_factor is None else 0.5
    depth = depth if variance_factor is None else variance_factor
    ring = clients
    for _ in range(64):
        try:
            disc = Discretizer(dim, clip_norm, bits, ring, seed=0, block_size=block_size)
        except ValueError:
            break
        sigma_sq, t = integer_sigma_sq(noise_multiplier**2 * disc.rounding_bound**2
                                       * (1 + SIGMA_MARGIN))
        tails = 2 * depth * math.log(2 * disc.padded_length * rounds / WRAP_PROBABILITY)
        bound = math.sqrt(float(sigma_sq) * tails) + rounding
        if clients * disc.level + bound <= half:
            return RingPlan(ring, disc.padded_length, disc.level, disc.scale, disc.rounding_bound,
                            sigma_sq, t, bound, WRAP_PROBABILITY)
        ring = max(ring + 1, math.ceil(ring * (clients * disc.level + bound) / half))
    raise DpfleetError(
        f"a {bits}-bit ring has no room for {clients} clients plus discrete noise with z = "
        f"{noise_multiplier:g} (it would wrap with probability > {WRAP_PROBABILITY:g}); "
        f"raise aggregation.bits or lower dp.noise_multiplier")


def ring_nodes(plan: RingPlan, key: bytes) -> DiscreteGaussianNodes:
    """The tree's int64 node noise: AES-256-CTR under the run's secret noise key, domain b"dgauss"
    (so it never shares keystream with the Gaussian or clip-count nodes of the same key)."""
    return DiscreteGaussianNodes(
        plan.sigma_sq, plan.length,
        lambda tree_id, level, index: NodeStream(key, tree_id, level, index, domain=b"dgauss"),
        t=plan.t)


def noisy_ring(ring: RingSum, residual: np.ndarray) -> np.ndarray:
    """(ring sum + integer residual) mod 2^b, in [0, 2^b): the value the mechanism releases (its
    decoding is post-processing). One device moves it by at most Delta_s in `ring_distance`,
    whatever the other inputs are, also when a malicious one parks the sum at the signed wrap."""
    values = np.asarray(ring.values)
    if values.size != residual.size:
        raise ValueError(f"ring sum has {values.size} entries, the noise tree {residual.size}")
    noisy = values.astype(np.int64) + residual
    noisy &= np.int64((1 << ring.bits) - 1)  # the ring's modular sum, in [0, 2^b)
    return noisy


def release(ring: RingSum, residual: np.ndarray) -> np.ndarray:
    """decode(`noisy_ring`): the round's noised sum, as float64."""
    return ring.decode(noisy_ring(ring, residual))


def ring_distance(a: np.ndarray, b: np.ndarray, bits: int) -> float:
    """L2 norm of the shortest way round the ring from b to a, coordinate by coordinate (each
    |a_j - b_j| taken mod 2^bits, at most 2^(bits-1)): the metric of the ring's sensitivity."""
    modulus = np.int64(1 << bits)
    diff = (np.asarray(a).astype(np.int64) - np.asarray(b).astype(np.int64)) % modulus
    diff = np.minimum(diff, modulus - diff)
    return float(np.linalg.norm(diff.astype(np.float64)))
