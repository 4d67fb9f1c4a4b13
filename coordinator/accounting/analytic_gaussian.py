"""Exact (eps, delta) of one Gaussian mechanism: the analytic Gaussian (Balle & Wang 2018, Thm. 8).

A Gaussian mechanism with sensitivity / std = mu (mu^2 = 2 rho) is (eps, delta)-DP exactly for
    delta(eps) = Phi(mu / 2 - eps / mu) - e^eps Phi(-mu / 2 - eps / mu).
dp-accounting's PLD grid overflows when rho is in the hundreds (eps ~ 700 makes e^eps overflow
float64), so there this closed form is the fallback. Both terms are evaluated as logarithms
(`log_ndtr`), which stays finite and accurate for any eps a float can hold.
"""

from __future__ import annotations

import math

from scipy.special import log_ndtr


def log_delta(mu: float, epsilon: float) -> float:
    """log delta(eps) of the Gaussian mechanism with sensitivity / std = mu."""
    log_a = float(log_ndtr(mu / 2 - epsilon / mu))
    log_b = epsilon + float(log_ndtr(-mu / 2 - epsilon / mu))
    if log_b >= log_a:  # equal up to rounding: delta is below float resolution of the terms
        return -math.inf
    return log_a + math.log1p(-math.exp(log_b - log_a))


def analytic_gaussian_epsilon(rho: float, delta: float) -> float:
    """The smallest eps with delta(eps) <= delta for the rho-zCDP Gaussian (bisection, 1e-12 rel.)."""
    if not (rho > 0 and math.isfinite(rho)):
        raise ValueError(f"rho must be positive and finite, got {rho}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    mu, target = math.sqrt(2 * rho), math.log(delta)
    if log_delta(mu, 0.0) <= target:
        return 0.0
    lo, hi = 0.0, rho + 2 * math.sqrt(rho * math.log(1 / delta))  # the zCDP bound is an upper bound
    while log_delta(mu, hi) > target:  # never loops in theory; guards rounding
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        if log_delta(mu, mid) > target:
            lo = mid
        else:
            hi = mid
    return hi
