"""Optimise BLT and banded-Toeplitz strategies for (n rounds, min separation gap, k participations).

At equal zCDP the noise std needed is proportional to the sensitivity, so the quantity to
minimise is error(B) * sens^2(C), B = A C^{-1} the prefix-sum decoder (McKenna 2024, "Scaling up
the Banded Matrix Factorization Mechanism", arXiv:2405.15913; McMahan et al. 2024,
arXiv:2408.08868, Sec. 4): `reduction` "max" takes the worst round's prefix-sum variance (for
Toeplitz C the last round's), "mean" the average (RMSE^2). Sensitivities come from
`mf_sensitivity` (exact min-sep formulas; a valid upper bound where their assumptions fail), so
every optimised loss is an honest number. Gradients are finite differences (L-BFGS-B): the
parameter counts are small (2 x buffers, bands - 1).

`tree_loss` is the same figure of merit for dpfleet's online binary tree (prefix error =
popcount(t) node noises, sens^2 = `tree_sensitivity_squared`), so sqrt(loss_mf / loss_tree) is the
ratio of the noise multipliers (noise std on the prefix sums) the two mechanisms need for one rho.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter

from dpfleet.coordinator.mechanisms.blt import BLT, prefix_error_per_round, tree_prefix_error_per_round
from dpfleet.coordinator.mechanisms.mf_sensitivity import (
    max_over_patterns,
    toeplitz_minsep_sensitivity_squared,
    true_max_participations,
)
from dpfleet.coordinator.mechanisms.tree_sensitivity import check_int, tree_sensitivity_squared
from dpfleet.errors import DpfleetError

REDUCTIONS = ("max", "mean")


def _reduce(err: np.ndarray, reduction: str) -> float:
    if reduction not in REDUCTIONS:
        raise DpfleetError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    return float(err.max() if reduction == "max" else err.mean())


def blt_polynomials(blt: BLT) -> tuple[np.ndarray, np.ndarray]:
    """(N, P), ascending powers of z, with C(z) = 1 + sum_i omega_i z / (1 - theta_i z) = N / P."""
    p = np.poly(blt.theta)  # prod(1 - theta_i z) in ascending powers of z
    n = p.copy()
    for i in range(blt.buffers):
        others = np.poly(np.delete(blt.theta, i))
        n[1:] += blt.omega[i] * others
    return n, p


def blt_inverse_coefs(blt: BLT, n: int) -> np.ndarray:
    """First n coefficients of C^{-1} = P / N, in O(n x buffers) (any signs of omega)."""
    num, den = blt_polynomials(blt)
    return lfilter(den, num, np.eye(1, n)[0])


def blt_loss(blt: BLT, n: int, gap: int, k: int | None = None, reduction: str = "max") -> float:
    """error(A C^{-1}) * sens^2(C) for a BLT C under (gap, k) participation."""
    sens2 = toeplitz_minsep_sensitivity_squared(blt.coefs(n), n, gap, k)
    return _reduce(prefix_error_per_round(blt_inverse_coefs(blt, n)), reduction) * sens2


def banded_sensitivity_squared_toeplitz(coef: np.ndarray, n: int, gap: int,
                                        k: int | None = None) -> float:
    """sens^2 of a banded Toeplitz C: exact (column-norm DP) if bands <= gap, else the majorant bound."""
    coef = np.asarray(coef, dtype=np.float64)
    if coef.size <= gap:
        sq = coef * coef
        full = np.cumsum(sq)
        # column j keeps its first min(bands, n - j) entries
        col = full[np.minimum(coef.size, n - np.arange(n)) - 1]
        return max_over_patterns(col, gap, k)
    return toeplitz_minsep_sensitivity_squared(coef, n, gap, k)


def banded_loss(coef: np.ndarray, n: int, gap: int, k: int | None = None,
                reduction: str = "max") -> float:
    coef = np.asarray(coef, dtype=np.float64)
    inv = lfilter([1.0], coef, np.eye(1, n)[0])
    sens2 = banded_sensitivity_squared_toeplitz(coef, n, gap, k)
    return _reduce(prefix_error_per_round(inv), reduction) * sens2


def tree_loss(n: int, gap: int, k: int | None = None, reduction: str = "max",
              nodes: str = "all") -> float:
    """The online binary tree's figure of merit (dpfleet's MinS = gap - 1)."""
    k = true_max_participations(n, gap, k)
    s = tree_sensitivity_squared(n, k, gap - 1, nodes=nodes)
    return _reduce(tree_prefix_error_per_round(n), reduction) * s


@dataclass(frozen=True)
class Optimized:
    kind: str  # "blt" or "banded"
    loss: float
    params: dict
    n: int
    gap: int
    k: int
    reduction: str


def _blt_from(x: np.ndarray) -> BLT:
    d = x.size // 2
    return BLT(1.0 / (1.0 + np.exp(-x[:d])), np.exp(x[d:]))


def optimize_blt(n: int, gap: int, k: int | None = None, buffers: int = 3, reduction: str = "max",
                 starts: int = 4, seed: int = 0) -> Optimized:
    """Best BLT (theta in (0,1), omega > 0) with `buffers` buffers, multi-start L-BFGS-B on log loss."""
    n, gap = check_int(n, "n", 1), check_int(gap, "gap", 1)
    buffers = check_int(buffers, "buffers", 1)
    k = true_max_participations(n, gap, k)
    rng = np.random.default_rng(seed)

    def objective(x: np.ndarray) -> float:
        with np.errstate(all="ignore"):  # an unstable candidate scores 1e6, not a warning
            value = blt_loss(_blt_from(x), n, gap, k, reduction)
        return math.log(value) if value > 0 and math.isfinite(value) else 1e6

    best = None
    for s in range(starts):
        # decays spread over time scales 1 .. n (theta = 1 - 1/scale), small output scales
        scales = np.geomspace(2.0, max(4.0, float(n)), buffers) * np.exp(rng.normal(0, 0.3 * (s > 0),
                                                                                    buffers))
        theta = np.clip(1.0 - 1.0 / scales, 1e-3, 1 - 1e-6)
        omega = np.full(buffers, 0.5 / buffers) * np.exp(rng.normal(0, 0.5 * (s > 0), buffers))
        x0 = np.concatenate([np.log(theta / (1 - theta)), np.log(omega)])
        res = minimize(objective, x0, method="L-BFGS-B",
                       bounds=[(-12, 16)] * buffers + [(-20, 3)] * buffers,
                       options={"maxiter": 400})
        if best is None or res.fun < best.fun:
            best = res
    blt = _blt_from(best.x)
    return Optimized("blt", blt_loss(blt, n, gap, k, reduction),
                     {"theta": blt.theta.tolist(), "omega": blt.omega.tolist()},
                     n, gap, k, reduction)


def optimize_banded(n: int, gap: int, k: int | None = None, bands: int | None = None,
                    reduction: str = "max") -> Optimized:
    """Best banded Toeplitz C = Toeplitz(1, c_1, ..., c_{bands-1}); bands defaults to min(gap, n).

    With bands <= gap the sensitivity is exact for any signs (column-norm DP); more bands fall back
    to the Toeplitz majorant bound. Started from the 1/sqrt(1-z) (square-root) coefficients.
    """
    n, gap = check_int(n, "n", 1), check_int(gap, "gap", 1)
    k = true_max_participations(n, gap, k)
    bands = min(gap, n) if bands is None else min(check_int(bands, "bands", 1), n)
    if bands == 1:
        coef = np.ones(1)
    else:
        sqrt_coefs = np.cumprod(np.concatenate([[1.0], (np.arange(1, bands) - 0.5) / np.arange(1, bands)]))

        def objective(x: np.ndarray) -> float:
            with np.errstate(all="ignore"):
                value = banded_loss(np.concatenate([[1.0], x]), n, gap, k, reduction)
            return math.log(value) if value > 0 and math.isfinite(value) else 1e6

        res = minimize(objective, sqrt_coefs[1:], method="L-BFGS-B", options={"maxiter": 400})
        coef = np.concatenate([[1.0], res.x])
    return Optimized("banded", banded_loss(coef, n, gap, k, reduction), {"coef": coef.tolist()},
                     n, gap, k, reduction)
