"""The DP-FTRL server update of federated learning (paper 002, Alg. 1; Kairouz et al. 2021).

Each round: the (secure) sum of clipped client deltas gets the tree's residual noise
(std = z * C per node; times M_train / M_noise in a projection, `noise_scale`), is divided by the
report goal m (a fixed denominator, so the
sensitivity of the average is C / m), fed to server SGD with momentum:
    mbar_t = beta * mbar_{t-1} + noisy_avg_t,   theta_{t+1} = theta_t + eta_s * mbar_t.
Because the released prefix sums are the tree-noised ones, this is post-processing of the tree
mechanism. At a restart round the tree is replaced by a fresh one (the old tree's noise stays in
the model); the clip norm may change only there (adaptive clipping). Matrix-
factorization noise (`mechanism`) takes a new clip norm C_t every round instead: its noise is
scaled by C_t / C_0, i.e. x_t / C_t + z (C^-1 z)_t is released (`adaptive_clipping`).

Noise: node vectors come from `noise_stream.GaussianNodes` under the run's secret 256-bit noise
key (`noise_key`; a fresh one from the OS CSPRNG when none is given), never from `seed`.
With a `ring` plan (`dp.noise = "discrete"`, `ring_noise.py`) the nodes are int64 discrete
Gaussians under the same key, and `step` takes secure aggregation's `RingSum`: the integer
residual is added in Z_(2^b) before decoding, so no floating-point sampler touches a release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dpfleet.coordinator.mechanisms.matrix import as_mechanism
from dpfleet.coordinator.mechanisms.noise_stream import new_noise_key
from dpfleet.errors import DpfleetError
from dpfleet.secagg.sums import RingSum

if TYPE_CHECKING:
    from dpfleet.coordinator.mechanisms.base import Mechanism
    from dpfleet.coordinator.mechanisms.ring_noise import RingPlan
    from dpfleet.coordinator.mechanisms.spec import MechanismSpec


@dataclass
class DPFTRLConfig:
    noise_multiplier: float
    clip_norm: float
    report_goal: int
    server_lr: float = 1.0
    momentum: float = 0.9
    restart_rounds: tuple[int, ...] = ()  # 0-based rounds at whose start a new tree begins
    # One client's L2 contribution to the sum is at most clip_norm * sensitivity_factor; > 1 when
    # secure aggregation's discretization inflates norms, so the noise must grow with it.
    sensitivity_factor: float = 1.0
    # a projection (`[projection]`, pfl's noise_scale): the noise on the sum times M_train / M_noise,
    # so the average (divided by report_goal = M_train) carries std z C / M_noise; 1: none. The
    # run's own guarantee is accounted at z * noise_scale (`config.projection_factor`)
    noise_scale: float = 1.0
    # the noise mechanism (`mechanisms.base.Mechanism`, or a banded / BLT `MechanismSpec`);
    # None: the tree
    mechanism: Mechanism | MechanismSpec | None = None


class DPFTRLServer:
    """Holds theta, the momentum buffer and the noise tree; applies one round at a time."""

    def __init__(self, theta0: np.ndarray, cfg: DPFTRLConfig, noise_key: bytes | None = None,
                 ring: RingPlan | None = None):
        if ring is not None and cfg.noise_scale != 1.0:  # a ring plan is sized for the real noise
            raise DpfleetError("a projection (noise_scale != 1) runs on plain sums only, not SecAgg's ring")
        self.cfg, self.ring = cfg, ring
        self.mechanism = as_mechanism(cfg.mechanism)
        self.noise_key = new_noise_key() if noise_key is None else noise_key
        self.theta = theta0.astype(np.float32).copy()
        self.momentum = np.zeros_like(self.theta)
        self.round = 0
        self.clip_norm = cfg.clip_norm
        self.tree = self._new_tree(0)
        # `dpfleet audit --debug-nonprivate / --break noise-div-10` only (coordinator/audit/canaries.py):
        # the added noise times this, while the accountant keeps the configured z; no config key
        # or simulate flag reaches it, so a normal run always adds its full noise
        self.audit_noise_scale = 1.0

    @property
    def noise_std(self) -> float:
        """Per-node noise std on the *sum* of clipped deltas (in decoded units for a ring)."""
        if self.ring is not None:  # decoded units scale with the round's clip norm (s C fixed)
            return self.ring.noise_std * self.clip_norm / self.cfg.clip_norm
        return self.cfg.noise_multiplier * self.clip_norm * self.cfg.sensitivity_factor * self.cfg.noise_scale

    @property
    def stream_std(self) -> float:
        """The float stream's std: at the round's clip norm, or, for a mechanism whose clip norm
        may change every round, at the configured one (`step` rescales each round's noise)."""
        if self.mechanism.adapts_every_round:
            return (self.cfg.noise_multiplier * self.cfg.clip_norm * self.cfg.sensitivity_factor
                    * self.cfg.noise_scale)
        return self.noise_std

    def _new_tree(self, tree_id: int):
        """A fresh noise segment of the run's mechanism (in ring units with a ring plan)."""
        if self.ring is not None:
            return self.mechanism.ring_stream(self.ring, self.noise_key, tree_id)
        return self.mechanism.stream(self.theta.size, self.stream_std, self.noise_key, tree_id)

    @property
    def restart_due(self) -> bool:
        """The next round is a restart round whose fresh tree has not been started yet."""
        return self.round in self.cfg.restart_rounds and self.tree.t > 0

    def restart(self, clip_norm: float | None = None, tree_id: int | None = None) -> None:
        """Start a new tree (`tree_id`, default the next one), optionally with a new clip norm
        (only allowed here).

        Call it before a restart round's clients clip (adaptive clipping); otherwise `step`
        restarts with the same clip norm.
        """
        if clip_norm is not None:
            self.clip_norm = clip_norm
        self.tree = self._new_tree(self.tree.tree_id + 1 if tree_id is None else tree_id)

    def _checked(self, residual: np.ndarray) -> np.ndarray:
        """A mechanism's round noise has exactly the sum's shape and is finite (a broadcast
        vector, or a NaN, would void the noise the accountant assumes)."""
        length = self.ring.length if self.ring is not None else self.theta.size
        residual = np.asarray(residual)
        kind = "i" if self.ring is not None else "f"
        if residual.shape != (length,) or residual.dtype.kind != kind or (
                kind == "f" and not np.isfinite(residual).all()):
            raise DpfleetError(f"noise mechanism {self.mechanism.name!r}: round {self.round + 1}'s noise "
                               f"must be a finite {'integer' if kind == 'i' else 'float'} vector of shape "
                               f"({length},), got {residual.dtype} of shape {residual.shape}")
        return residual

    def step(self, delta_sum: np.ndarray | RingSum) -> np.ndarray:
        """Apply one round's sum of clipped deltas (float, or a ring sum with a `ring` plan);
        returns the new theta."""
        if self.restart_due:
            self.restart()
        residual = self._checked(self.tree.next_residual())
        if self.audit_noise_scale != 1.0:  # a deliberately broken audit run (see __init__)
            scaled = residual.astype(np.float64) * self.audit_noise_scale
            residual = (np.rint(scaled) if residual.dtype.kind == "i" else scaled).astype(residual.dtype)
        if isinstance(delta_sum, RingSum) != (self.ring is not None):
            raise TypeError("a discrete-noise server steps on ring sums, a Gaussian one on floats")
        if self.ring is not None:
            from dpfleet.coordinator.mechanisms.ring_noise import release

            noisy_sum = release(delta_sum, residual).astype(np.float32)
        else:
            if self.mechanism.adapts_every_round and self.clip_norm != self.cfg.clip_norm:
                # adaptive clipping every round: x_t / C_t + z (C^-1 z)_t released, times C_t
                residual = residual * np.float32(self.clip_norm / self.cfg.clip_norm)
            noisy_sum = delta_sum.astype(np.float32) + residual
        noisy_avg = noisy_sum / np.float32(self.cfg.report_goal)
        self.momentum *= np.float32(self.cfg.momentum)
        self.momentum += noisy_avg
        self.theta += np.float32(self.cfg.server_lr) * self.momentum
        self.round += 1
        return self.theta

    def state_dict(self) -> dict:
        """Everything but the noise key; "tree" holds live node vectors (noise secrets)."""
        return {
            "theta": self.theta, "momentum": self.momentum, "round": self.round,
            "clip_norm": self.clip_norm, "tree": self.tree.state_dict(),
        }

    def load_state(self, state: dict) -> None:
        self.theta = state["theta"].astype(np.float32).copy()
        self.momentum = state["momentum"].astype(np.float32).copy()
        self.round = int(state["round"])
        self.clip_norm = float(state["clip_norm"])
        if self.ring is not None:
            self.tree = self.mechanism.resume_ring(state["tree"], self.ring, self.noise_key)
        else:
            self.tree = self.mechanism.resume(state["tree"], self.theta.size, self.stream_std, self.noise_key)
