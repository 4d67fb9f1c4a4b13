"""Adaptive clipping inside DP-FTRL (paper 002 Alg. 1 and App. A; Andrew et al. 2021).

Each device also reports one bit, b = [||delta|| <= C^t], whether its update norm is below the
current quantile estimate C^t. The coordinator sums the bits with the tree mechanism, like the
model deltas: b~^t is the tree-noised *prefix* sum over the rounds k <= t of the current tree
(PrivateSum in Alg. 1), as a fraction of the report goal m, and

    C^{t+1} = C_0 * exp(-eta * (b~^t - n * gamma)),     n = rounds summed into b~^t,

which is exactly Andrew et al.'s geometric update C <- C * exp(-eta * (b^t - gamma)) unrolled,
except that the noise of the unrolled sum is the tree's (O(log n) node variances), not n
independent draws. (Alg. 1 writes "t * gamma" next to a prefix over k in [0, t], i.e. t + 1
rounds; n counts the rounds actually summed, which is the unrolled update.) The estimate is
tracked every round but becomes the clip norm only when a tree restarts (the tree's sensitivity
assumes one clip norm); both trees restart together and C_0 becomes the estimate at the restart.

Under secure aggregation the bit never leaves a device in the clear: it is masked with the
update as one more exact ring coordinate, and the coordinator gets only the survivors' count
(`update_count`, `secagg/count_bit.py`); the count noise is added here in either case.

With matrix-factorization noise (dp.mechanism banded / blt, `mechanism`) the counts get the same
strategy's noise sigma_b (C^-1 z')_t (z' under its own domain `MF_COUNT_DOMAIN`), so the prefix
sum b~^t carries B z' instead of the tree's nodes, and the clip norm becomes the estimate EVERY
round: the MF mechanism is private for adaptively chosen inputs (C lower-triangular; Denisov et
al. 2022), so the model's release x_t / C_t + z_delta (C^-1 z)_t has sensitivity 1 per
participation whatever C_t earlier releases chose (`dp_ftrl` scales the noise by C_t). The pair
(model, count) is then one MF Gaussian mechanism of multiplier z on the same strategy, exactly as
Thm. 1 pairs them on the tree: sens_C^2 / (2 z_delta^2) + sens_C^2 / (2 (2 sigma_b)^2) = sens_C^2 /
(2 z^2), so the MF accountant keeps z.

Privacy (App. A, Thm. 1): the bits are summed centred, b - 1/2, so one device moves the count by
at most 1/2 and count noise sigma_b is a noise multiplier of 2 sigma_b. Model noise z_delta with
1 / z^2 = 1 / z_delta^2 + 1 / (2 sigma_b)^2 makes the pair one Gaussian mechanism of noise
multiplier z on the same tree, so the accountant keeps z (the config's noise multiplier).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dpfleet.coordinator.accounting.zcdp import default_count_stddev
from dpfleet.coordinator.mechanisms.matrix import as_mechanism
from dpfleet.coordinator.mechanisms.noise_stream import new_noise_key
from dpfleet.errors import DpfleetError

if TYPE_CHECKING:
    from dpfleet.coordinator.mechanisms.base import Mechanism
    from dpfleet.coordinator.mechanisms.spec import MechanismSpec

FIRST_RESTART, RESTART_EVERY = 128, 1024  # paper 002 Alg. 1: R = {128 + 1024 i}


def default_restart_rounds(rounds: int) -> list[int]:
    """Rounds (0-based, where a fresh tree starts) 128 + 1024 i below `rounds`.

    A tree restarting at the start of round 128 spans rounds 0..127, then 1024 rounds each:
    complete binary trees, the cheapest shape for the accountant.
    """
    return list(range(FIRST_RESTART, rounds, RESTART_EVERY))


def clipped_bit(norm: float, threshold: float) -> int:
    """A device's b = [||delta|| <= C^t] on its unclipped norm, in float64 as `update` compares
    (what a device masks into its SecAgg input, `secagg.count_bit`)."""
    return int(np.float64(norm) <= np.float64(threshold))


class QuantileClipEstimator:
    """Private estimate of the gamma-quantile of update norms, with tree-noised clipped counts."""

    def __init__(self, initial_clip: float, report_goal: int, *, target_quantile: float = 0.5,
                 learning_rate: float = 0.2, count_stddev: float | None = None,
                 noise_key: bytes | None = None, mechanism: Mechanism | MechanismSpec | None = None):
        if not initial_clip > 0:
            raise DpfleetError(f"initial clip norm must be > 0, got {initial_clip}")
        if not 0.0 < target_quantile < 1.0:
            raise DpfleetError(f"target quantile must be in (0, 1), got {target_quantile}")
        if not learning_rate > 0:
            raise DpfleetError(f"clip learning rate must be > 0, got {learning_rate}")
        sigma_b = default_count_stddev(report_goal) if count_stddev is None else count_stddev
        if sigma_b < 0:
            raise DpfleetError(f"clipped-count stddev must be >= 0, got {sigma_b}")
        self.report_goal, self.gamma, self.eta = report_goal, target_quantile, learning_rate
        self.count_stddev = float(sigma_b)
        # the run's secret key; the mechanism draws the counts' noise under its own "count"
        # purpose (never the model noise's keystream)
        self.key = new_noise_key() if noise_key is None else noise_key
        self.estimate = self.base = float(initial_clip)
        self.noised_prefix = 0.0  # noised sum of (b - 1/2) over the current segment's rounds
        self.mechanism = as_mechanism(mechanism)  # the counts share the model's strategy
        self.tree = self.mechanism.stream(1, self.count_stddev, self.key, 0, "count")

    def load_tree(self, state: dict) -> None:
        """The count noise from a resume point's segment state."""
        self.tree = self.mechanism.resume(state, 1, self.count_stddev, self.key, "count")

    def update(self, norms: Sequence[float]) -> float:
        """Add one round's bits (from the contributing devices' unclipped norms); new estimate."""
        bits = np.asarray(norms, dtype=np.float64) <= self.estimate
        return self.update_count(int(bits.sum()), int(bits.size))

    def update_count(self, below: int, reported: int) -> float:
        """Add one round's count of bits set (`below` of the `reported` devices in the sum had
        ||delta|| <= the estimate): the form in which secure aggregation delivers them."""
        if not 0 <= below <= reported:
            raise ValueError(f"clipped count {below} is not in [0, {reported}]")
        noise = np.asarray(self.tree.next_residual(), dtype=np.float64)
        if noise.shape != (1,) or not np.isfinite(noise).all():
            raise DpfleetError(f"noise mechanism {self.mechanism.name!r}: a clipped count's noise must "
                               f"be one finite number, got shape {noise.shape}")
        self.noised_prefix += float(below - 0.5 * reported) + float(noise[0])
        n = self.tree.t
        below = self.noised_prefix / self.report_goal + 0.5 * n  # b~: prefix sum of fractions
        self.estimate = self.base * math.exp(-self.eta * (below - n * self.gamma))
        return self.estimate

    def restart(self, tree_id: int | None = None) -> None:
        """A new tree (`tree_id`, default the next) starts: the current estimate becomes the base
        of the next prefix sums."""
        self.base = self.estimate
        self.noised_prefix = 0.0
        segment = self.tree.tree_id + 1 if tree_id is None else tree_id
        self.tree = self.mechanism.stream(1, self.count_stddev, self.key, segment, "count")

    def state_dict(self) -> dict:
        """The estimate and the count stream's position (its `state_dict`: never a noise value,
        which with `noised_prefix` would give the clipped counts away; a resume rebuilds it)."""
        return {"estimate": self.estimate, "base": self.base, "noised_prefix": self.noised_prefix,
                "tree": self.tree.state_dict()}
