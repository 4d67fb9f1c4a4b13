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

Headroom: the ring level L (per-client coordinate bound) is sized for `ring_clients` >= the
report goal n, so that n L plus the largest residual noise never wraps. A residual sums at most
j = 1 + floor(log2 T) independent nodes; the discrete Gaussian is sigma-subgaussian (CKS 2020,
Sec. 2: E exp(lambda X) <= exp(lambda^2 sigma^2 / 2)), so P(|residual coordinate| >= x) <=
2 exp(-x^2 / (2 j sigma^2)), and over d' coordinates and T rounds the run wraps with
probability <= WRAP_PROBABILITY when n L + sigma sqrt(2 j ln(2 d' T / WRAP_PROBABILITY))
<= 2^(b-1) - 1. A config that cannot meet this is refused. (A wrap would only spoil utility:
privacy is that of the ring value.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpfleet.coordinator.aggregation import RingSum
from dpfleet.coordinator.config import SimulationConfig
from dpfleet.coordinator.discrete_gaussian import DiscreteGaussianNodes, integer_sigma_sq
from dpfleet.coordinator.noise_stream import NodeStream
from dpfleet.errors import DpfleetError
from dpfleet.secagg.encoding import Discretizer

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


def plan_ring(dim: int, clip_norm: float, bits: int, clients: int, noise_multiplier: float,
              rounds: int, block_size: int = 1 << 14) -> RingPlan:
    """The smallest ring_clients >= clients whose ring holds the noise; DpfleetError if none."""
    if noise_multiplier <= 0:
        raise DpfleetError("dp.noise = 'discrete' needs dp.noise_multiplier > 0")
    half = (1 << (bits - 1)) - 1
    depth = 1 + max(rounds, 1).bit_length() - 1  # nodes in one residual: 1 + floor(log2 T)
    ring = clients
    for _ in range(64):
        try:
            disc = Discretizer(dim, clip_norm, bits, ring, seed=0, block_size=block_size)
        except ValueError:
            break
        sigma_sq, t = integer_sigma_sq(noise_multiplier**2 * disc.rounding_bound**2
                                       * (1 + SIGMA_MARGIN))
        tails = 2 * depth * math.log(2 * disc.padded_length * rounds / WRAP_PROBABILITY)
        bound = math.sqrt(float(sigma_sq) * tails)
        if clients * disc.level + bound <= half:
            return RingPlan(ring, disc.padded_length, disc.level, disc.scale, disc.rounding_bound,
                            sigma_sq, t, bound, WRAP_PROBABILITY)
        ring = max(ring + 1, math.ceil(ring * (clients * disc.level + bound) / half))
    raise DpfleetError(
        f"a {bits}-bit ring has no room for {clients} clients plus discrete noise with z = "
        f"{noise_multiplier:g} (it would wrap with probability > {WRAP_PROBABILITY:g}); "
        f"raise aggregation.bits or lower dp.noise_multiplier")


def discrete_plan(cfg: SimulationConfig, dim: int) -> RingPlan:
    """The run's ring layout and discrete noise scale (`dp.noise = "discrete"`). With adaptive
    clipping the model's share of the noise is z_delta (the clipped counts take the rest, as
    Gaussian noise added by the coordinator: `adaptive_clipping`, Thm. 1)."""
    z = cfg.dp.noise_multiplier
    if cfg.dp.adaptive_clipping:
        from dpfleet.coordinator.adaptive_clipping import model_noise_multiplier
        from dpfleet.coordinator.config import clip_count_stddev

        z = model_noise_multiplier(z, clip_count_stddev(cfg))
    return plan_ring(dim, cfg.dp.clip_norm, cfg.aggregation.bits, cfg.dp.report_goal, z, cfg.rounds)


def ring_nodes(plan: RingPlan, key: bytes) -> DiscreteGaussianNodes:
    """The tree's int64 node noise: AES-256-CTR under the run's secret noise key, domain b"dgauss"
    (so it never shares keystream with the Gaussian or clip-count nodes of the same key)."""
    return DiscreteGaussianNodes(
        plan.sigma_sq, plan.length,
        lambda tree_id, level, index: NodeStream(key, tree_id, level, index, domain=b"dgauss"),
        t=plan.t)


def release(ring: RingSum, residual: np.ndarray) -> np.ndarray:
    """decode((ring sum + integer residual) mod 2^b): the round's noised sum, as float64."""
    values = np.asarray(ring.values)
    if values.size != residual.size:
        raise ValueError(f"ring sum has {values.size} entries, the noise tree {residual.size}")
    noisy = values.astype(np.int64) + residual
    noisy &= np.int64((1 << ring.bits) - 1)  # the ring's modular sum, in [0, 2^b)
    return ring.decode(noisy)
