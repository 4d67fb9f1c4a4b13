"""BLT and banded strategies for matrix-factorization DP-FTRL, with streaming correlated noise.

A strategy C (lower-triangular, n x n) gives the matrix mechanism A = B C on the prefix-sum
workload A; round t adds the correlated noise (C^{-1} z)_t to its sum, z_t ~ N(0, sigma^2 I).
Both strategies here make that noise streaming, with memory independent of n:

- BLT, buffered linear Toeplitz (McMahan et al. 2024, "Efficient and near-optimal noise
  generation for streaming differential privacy", arXiv:2408.08868; Dvijotham et al. 2024):
  buffer decays theta_i in (0, 1) and output scales omega_i define Toeplitz coefficients
  c_0 = 1, c_j = sum_i omega_i theta_i^(j-1). C is the linear system with d buffers
  s_i <- theta_i s_i + x_t, y_t = x_t + omega^T s, so solving C w = z online is
  w_t = z_t - sum_i omega_i s_i, then s_i <- theta_i s_i + w_t: d buffers of model size.
  Its inverse is again a BLT (`BLT.inverse`).
- Banded (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization"): C has `bands`
  nonzero diagonals, so w_t = (z_t - sum_{j=1}^{bands-1} C[t, t-j] w_{t-j}) / C[t, t]:
  the last bands - 1 noise vectors are the state.

`error_per_round` / `loss` give the prefix-sum error of B = A C^{-1} the optimizers in
`coordinator/mechanisms/mf_optimize.py` minimise (times sensitivity^2, i.e. at equal zCDP).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.signal import lfilter

from dpfleet.coordinator.mechanisms.mf_sensitivity import toeplitz_matrix
from dpfleet.coordinator.mechanisms.tree_sensitivity import check_int
from dpfleet.errors import DpfleetError


@dataclass(frozen=True)
class BLT:
    """C = Toeplitz(1, omega.sum(), omega @ theta, omega @ theta^2, ...): d buffers."""

    theta: np.ndarray  # buffer decays, shape (d,); strategies keep them in (0, 1), an inverse
    # may have |theta| >= 1 (its coefficients then grow with t, still exact for finite n)
    omega: np.ndarray  # output scales, shape (d,)

    def __post_init__(self):
        theta = np.atleast_1d(np.asarray(self.theta, dtype=np.float64))
        omega = np.atleast_1d(np.asarray(self.omega, dtype=np.float64))
        if theta.ndim != 1 or theta.shape != omega.shape:
            raise DpfleetError(f"theta and omega must be 1-D of one length, got {theta.shape}, "
                               f"{omega.shape}")
        if not (np.all(np.isfinite(theta)) and np.all(np.isfinite(omega))):
            raise DpfleetError("BLT parameters must be finite")
        object.__setattr__(self, "theta", theta)
        object.__setattr__(self, "omega", omega)

    @property
    def buffers(self) -> int:
        return self.theta.size

    def coefs(self, n: int) -> np.ndarray:
        """The first n Toeplitz coefficients c_0 .. c_{n-1} of C."""
        n = check_int(n, "n", 1)
        powers = self.theta[None, :] ** np.arange(max(n - 1, 0))[:, None]  # (n-1, d)
        return np.concatenate([[1.0], powers @ self.omega])

    def matrix(self, n: int) -> np.ndarray:
        return toeplitz_matrix(self.coefs(n), n)

    def inverse(self) -> BLT:
        """C^{-1} as a BLT with the same number of buffers.

        The inverse system is w_t = z_t - omega^T s, s <- (Theta - 1 omega^T) s + z_t. With
        omega > 0 the state matrix is similar (by diag(sqrt(omega))) to the symmetric
        Theta - v v^T, v = sqrt(omega); diagonalising it, Q^T (Theta - v v^T) Q = diag(theta'),
        gives the inverse BLT theta', omega'_i = -(Q^T v)_i^2 (negative scales).
        """
        if np.any(self.omega <= 0):
            raise DpfleetError("BLT.inverse needs positive output scales")
        v = np.sqrt(self.omega)
        theta_inv, q = np.linalg.eigh(np.diag(self.theta) - np.outer(v, v))
        return BLT(theta_inv, -(q.T @ v) ** 2)

    def inverse_coefs(self, n: int) -> np.ndarray:
        """First n coefficients of C^{-1} (by the exact recursion, valid for any omega)."""
        return lfilter([1.0], self.coefs(n), np.eye(1, n)[0])

    def noise(self, dim: int) -> BLTNoise:
        return BLTNoise(self, dim)


class BLTNoise:
    """Streaming (C^{-1} z)_t for a BLT C: memory = buffers x dim, O(buffers x dim) per round."""

    def __init__(self, blt: BLT, dim: int):
        self.blt, self.dim = blt, check_int(dim, "dim", 1)
        self.state = np.zeros((blt.buffers, self.dim))
        self.t = 0

    def next(self, z_t: np.ndarray) -> np.ndarray:
        """Round t's correlated noise from round t's fresh Gaussian z_t (shape (dim,))."""
        z_t = np.asarray(z_t, dtype=np.float64)
        if z_t.shape != (self.dim,):
            raise DpfleetError(f"z_t has shape {z_t.shape}, expected ({self.dim},)")
        w = z_t - self.blt.omega @ self.state
        self.state *= self.blt.theta[:, None]
        self.state += w[None, :]
        self.t += 1
        return w


def banded_toeplitz_matrix(coef: np.ndarray, n: int) -> np.ndarray:
    """n x n lower-triangular Toeplitz C with bands = len(coef) (coef[0] != 0)."""
    coef = np.asarray(coef, dtype=np.float64)
    if coef.ndim != 1 or coef.size < 1 or coef[0] == 0:
        raise DpfleetError("banded coefficients must be a non-empty 1-D array with coef[0] != 0")
    return toeplitz_matrix(coef, n)


class BandedNoise:
    """Streaming (C^{-1} z)_t for a banded lower-triangular C: memory = (bands - 1) x dim.

    `c` is either the 1-D Toeplitz band coef[0..bands-1] or a dense banded n x n matrix (any
    banded C, e.g. column-normalised BandMF); the stream keeps only the last bands - 1 outputs.
    """

    def __init__(self, c: np.ndarray, dim: int):
        c = np.asarray(c, dtype=np.float64)
        self.dim = check_int(dim, "dim", 1)
        if c.ndim == 1:
            if c.size < 1 or c[0] == 0:
                raise DpfleetError("banded coefficients must be non-empty with coef[0] != 0")
            self.toeplitz, self.bands, self.n = c, c.size, None
        else:
            if c.ndim != 2 or c.shape[0] != c.shape[1] or np.any(np.triu(c, 1) != 0):
                raise DpfleetError("a dense banded C must be square lower-triangular")
            if np.any(np.diag(c) == 0):
                raise DpfleetError("a banded C needs a nonzero diagonal to be invertible")
            rows, cols = np.nonzero(c)
            self.toeplitz, self.bands, self.n = None, int((rows - cols).max()) + 1, c.shape[0]
            self.dense = c
        self.past: deque[np.ndarray] = deque(maxlen=max(self.bands - 1, 0))
        self.t = 0

    def _row(self, t: int) -> np.ndarray:
        """C[t, t], C[t, t-1], ..., C[t, t-bands+1] (zeros before round 0)."""
        if self.toeplitz is not None:
            return self.toeplitz
        if t >= self.n:
            raise DpfleetError(f"the banded strategy covers {self.n} rounds")
        lo = max(0, t - self.bands + 1)
        row = np.zeros(self.bands)
        row[:t - lo + 1] = self.dense[t, lo:t + 1][::-1]
        return row

    def next(self, z_t: np.ndarray) -> np.ndarray:
        z_t = np.asarray(z_t, dtype=np.float64)
        if z_t.shape != (self.dim,):
            raise DpfleetError(f"z_t has shape {z_t.shape}, expected ({self.dim},)")
        row = self._row(self.t)
        w = z_t.copy()
        for j, past in enumerate(reversed(self.past), start=1):  # past[-1] is round t-1
            w -= row[j] * past
        w /= row[0]
        if self.bands > 1:
            self.past.append(w)
        self.t += 1
        return w


def prefix_error_per_round(inverse_coef: np.ndarray) -> np.ndarray:
    """Per-round variance (unit sigma) of the prefix-sum error B z, B = A C^{-1}, C Toeplitz.

    B is Toeplitz with coefficients cumsum(C^{-1} coefs), so row t's squared norm is the
    cumulative sum of their squares.
    """
    b = np.cumsum(np.asarray(inverse_coef, dtype=np.float64))
    return np.cumsum(b * b)


def dense_prefix_error_per_round(c: np.ndarray) -> np.ndarray:
    """Same for any invertible lower-triangular C: squared row norms of A C^{-1}."""
    n = c.shape[0]
    b = np.linalg.solve(c.T, np.tril(np.ones((n, n))).T).T
    return (b * b).sum(axis=1)


def tree_prefix_error_per_round(n: int) -> np.ndarray:
    """The online binary tree: prefix t (1-based) sums popcount(t) independent node noises."""
    return np.array([bin(t).count("1") for t in range(1, check_int(n, "n", 1) + 1)], dtype=float)
