"""L2 sensitivity of matrix-factorization DP-FTRL under min-separation participation.

The matrix mechanism factors the prefix-sum workload A (lower-triangular ones) as A = B C and
releases B (C x + z) = A (x + C^{-1} z): round t's sum gets the correlated noise (C^{-1} z)_t.
One device contributes vectors g_i (||g_i|| <= 1, after clipping) on the rounds of its
participation pattern pi, so the sensitivity of C x is

    sens^2 = max_pi max_g || sum_{i in pi} C[:, i] g_i^T ||_F^2 = max_pi max_g sum_{i,j in pi} X_ij <g_i, g_j>

with X = C^T C. When X is entrywise non-negative the inner max is at g_i all equal (unit), so
sens^2 = max_pi 1^T X[pi, pi] 1 = max_pi ||C u_pi||^2 with u_pi the 0/1 pattern vector; for any
X, max_pi 1^T |X[pi, pi]| 1 is an upper bound. This is the setting of Choquette-Choo et al. 2023,
"(Amplified) Banded Matrix Factorization" (arXiv:2306.08153), Sec. 2 / App. (X >= 0).

Participation (what the participation timers enforce): a pattern is a set of rounds in [0, n)
with any two at least `gap` apart (y - x >= gap, the literature's "min_sep b"; gap = 1 allows
consecutive rounds) and at most `k` of them. dpfleet's `min_separation` counts the rounds strictly
between two participations, so gap = min_separation + 1 (`gap_from_min_separation`).

Three computations, each checked against the brute force in tests/test_mf_sensitivity.py:
- `brute_force_sensitivity_squared`: enumerate every pattern (small n only).
- `banded_sensitivity_squared`: if C has at most `gap` bands, columns of two admissible rounds
  never overlap, so sens^2 = max_pi sum_{i in pi} ||C[:, i]||^2, a 1-D dynamic program
  (Choquette-Choo et al. 2023, banded sensitivity and Alg. 3 "VecSens"). It is at most
  k * max_i ||C[:, i]||^2, the simple form often quoted (equal when k columns of maximal norm fit;
  for banded Toeplitz C the last columns are shorter, so the DP can be smaller).
- `toeplitz_minsep_sensitivity_squared`: lower-triangular Toeplitz C with non-negative,
  non-increasing coefficients: the worst pattern is k participations exactly `gap` apart starting
  at round 0 (the theorem jax-privacy's `toeplitz.minsep_sensitivity_squared` cites,
  arXiv:2405.13763 Thm. 2; McMahan et al. 2024, arXiv:2408.08868, account BLTs with it), an O(n)
  sum. Other coefficients are first projected (absolute value, then the smallest non-increasing
  majorant), which gives an upper bound.
"""

from __future__ import annotations

import math

import numpy as np

from dpfleet.coordinator.mechanisms.tree_sensitivity import check_int
from dpfleet.errors import DpfleetError

BRUTE_FORCE_MAX_ROUNDS = 24  # 2^24 subsets bound the enumeration; the real count is far smaller


def gap_from_min_separation(min_separation: int) -> int:
    """The literature's min_sep b (y - x >= b) for dpfleet's MinS (rounds strictly between)."""
    return check_int(min_separation, "min_separation", 0) + 1


def true_max_participations(n: int, gap: int, k: int | None = None) -> int:
    """The most participations a pattern can have: min(k, ceil(n / gap))."""
    n, gap = check_int(n, "n", 1), check_int(gap, "gap", 1)
    most = -(-n // gap)
    return most if k is None else min(check_int(k, "k", 1), most)


def _lower_triangular(c: np.ndarray) -> np.ndarray:
    c = np.asarray(c, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise DpfleetError(f"C must be a square matrix, got shape {c.shape}")
    if np.any(np.triu(c, 1) != 0):
        raise DpfleetError("C must be lower-triangular (round t's noise may use only rounds <= t)")
    return c


def patterns(n: int, gap: int, k: int):
    """Every non-empty participation pattern (tuple of rounds) with separation >= gap, <= k rounds."""
    def extend(prefix: tuple[int, ...], start: int):
        for r in range(start, n):
            pattern = (*prefix, r)
            yield pattern
            if len(pattern) < k:
                yield from extend(pattern, r + gap)
    yield from extend((), 0)


def brute_force_sensitivity_squared(c: np.ndarray, gap: int, k: int | None = None, *,
                                    upper_bound: bool = False) -> float:
    """max over admissible patterns pi of 1^T X[pi, pi] 1, X = C^T C, by enumeration.

    Exact sens^2 only when X >= 0 entrywise (then all-equal contributions are worst); otherwise
    raises unless `upper_bound=True`, which uses |X| and returns a valid upper bound.
    """
    c = _lower_triangular(c)
    n = c.shape[0]
    if n > BRUTE_FORCE_MAX_ROUNDS:
        raise DpfleetError(f"brute force is for n <= {BRUTE_FORCE_MAX_ROUNDS}, got n = {n}")
    k = true_max_participations(n, gap, k)
    x = c.T @ c
    if np.any(x < -1e-12 * max(1.0, float(np.abs(x).max()))):
        if not upper_bound:
            raise DpfleetError("C^T C has negative entries: the 0/1 brute force is not exact "
                               "(pass upper_bound=True for a bound)")
        x = np.abs(x)
    best = 0.0
    for pattern in patterns(n, gap, k):
        idx = np.asarray(pattern)
        best = max(best, float(x[np.ix_(idx, idx)].sum()))
    return best


def bands_of(c: np.ndarray) -> int:
    """Number of nonzero diagonals of a lower-triangular C (1 = diagonal)."""
    c = _lower_triangular(c)
    rows, cols = np.nonzero(c)
    return int((rows - cols).max()) + 1 if rows.size else 0


def max_over_patterns(values: np.ndarray, gap: int, k: int | None = None) -> float:
    """max over admissible patterns pi of sum_{i in pi} values_i (O(n k) dynamic program).

    best[i] after m passes = the best sum of <= m picks in values[i:], any two >= gap apart.
    """
    values = np.asarray(values, dtype=np.float64)
    n = values.size
    k = true_max_participations(n, gap, k)
    best = np.zeros(n + gap)
    for _ in range(k):
        take = values + best[gap:gap + n]
        best[:n] = np.maximum.accumulate(np.maximum(take, best[:n])[::-1])[::-1]
    return float(max(best[0], 0.0))


def banded_sensitivity_squared(c: np.ndarray, gap: int, k: int | None = None) -> float:
    """Exact sens^2 of a lower-triangular C with at most `gap` bands (any signs).

    Two admissible rounds i < j have j - i >= gap >= bands, so columns i and j of C have disjoint
    supports and X[pi, pi] is diagonal: sens^2 = max_pi sum_{i in pi} ||C[:, i]||^2
    (Choquette-Choo et al. 2023). Raises if C has more bands than `gap`.
    """
    c = _lower_triangular(c)
    gap = check_int(gap, "gap", 1)
    bands = bands_of(c)
    if bands > gap:
        raise DpfleetError(f"C has {bands} bands but the minimum separation is {gap}: the banded "
                           "formula needs bands <= separation")
    return max_over_patterns((c * c).sum(axis=0), gap, k)


def banded_sensitivity_squared_bound(c: np.ndarray, gap: int, k: int | None = None) -> float:
    """k * max column norm^2: the simple form of the banded sensitivity (an upper bound)."""
    c = _lower_triangular(c)
    if bands_of(c) > check_int(gap, "gap", 1):
        raise DpfleetError("the banded bound needs bands <= separation")
    return true_max_participations(c.shape[0], gap, k) * float((c * c).sum(axis=0).max())


def monotone_majorant(coef: np.ndarray) -> np.ndarray:
    """The smallest non-negative, non-increasing sequence >= |coef| (reverse cumulative max)."""
    return np.maximum.accumulate(np.abs(np.asarray(coef, dtype=np.float64))[::-1])[::-1]


def toeplitz_matrix(coef: np.ndarray, n: int) -> np.ndarray:
    """The n x n lower-triangular Toeplitz matrix with first column coef (zero-padded/truncated)."""
    n = check_int(n, "n", 1)
    col = np.zeros(n)
    coef = np.asarray(coef, dtype=np.float64)[:n]
    col[:coef.size] = coef
    idx = np.subtract.outer(np.arange(n), np.arange(n))
    return np.where(idx >= 0, col[np.clip(idx, 0, n - 1)], 0.0)


def toeplitz_minsep_sensitivity_squared(coef: np.ndarray, n: int, gap: int,
                                        k: int | None = None) -> float:
    """sens^2 of the n x n lower-triangular Toeplitz C with first column `coef`, in O(n).

    For non-negative, non-increasing coefficients the worst pattern is 0, gap, ..., (k-1) gap
    (arXiv:2405.13763, Thm. 2): C u has entries v_i = sum_{m < k, m gap <= i} c_{i - m gap}, and
    sens^2 = ||v||^2. Any other coefficients are replaced by their monotone majorant first: every
    entry of |C| is then dominated, so the result is an upper bound on the true sens^2.
    """
    n, gap = check_int(n, "n", 1), check_int(gap, "gap", 1)
    k = true_max_participations(n, gap, k)
    c = np.zeros(n)
    coef = monotone_majorant(coef)[:n]
    c[:coef.size] = coef
    # v_i = sum over m in [0, k) with i - m*gap >= 0 of c[i - m*gap]: cumulative sums along each
    # residue class mod gap, minus the part that is more than k steps back
    rows = math.ceil(n / gap)
    grid = np.zeros(rows * gap)
    grid[:n] = c
    cum = grid.reshape(rows, gap).cumsum(axis=0).ravel()
    v = cum.copy()
    v[k * gap:] -= cum[:-k * gap] if k * gap < cum.size else 0.0
    v = v[:n]
    return float(v @ v)


def pattern_sensitivity_squared(c: np.ndarray, rounds: list[int] | tuple[int, ...]) -> float:
    """||C u||^2 for one given pattern u (all contributions equal): what that device exposes."""
    c = _lower_triangular(c)
    u = np.zeros(c.shape[0])
    u[np.asarray(rounds, dtype=int)] = 1.0
    y = c @ u
    return float(y @ y)
