"""Frechet distance between two Gaussians, computed stably from (possibly noisy) moments.

FD = ||m1 - m2||^2 + Tr(C1) + Tr(C2) - 2 Tr((C1 C2)^(1/2)).  Tr((C1 C2)^(1/2)) equals
Tr((S C2 S)^(1/2)) with S = C1^(1/2), and S C2 S is symmetric PSD, so both square roots are
eigendecompositions of symmetric matrices (negative eigenvalues, from noise or round-off,
clipped to 0): no complex sqrtm, no Schur iterations that blow up on a noisy covariance.

Everything here is post-processing of a DP release: a public candidate may be scored any
number of times at no privacy cost.
"""

from __future__ import annotations

import numpy as np

from dpfleet.errors import DpfleetError


def symmetric(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise DpfleetError(f"expected a square matrix, got shape {a.shape}")
    return (a + a.T) / 2.0


def psd_projection(a: np.ndarray) -> np.ndarray:
    """The nearest PSD matrix in Frobenius norm: symmetrize, clip eigenvalues below at 0."""
    w, v = np.linalg.eigh(symmetric(a))
    return (v * np.clip(w, 0.0, None)) @ v.T


def psd_sqrt(a: np.ndarray) -> np.ndarray:
    """Square root of a symmetric matrix's PSD part (eigendecomposition, negatives -> 0)."""
    w, v = np.linalg.eigh(symmetric(a))
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def trace_sqrt_product(c1: np.ndarray, c2: np.ndarray) -> float:
    """Tr((C1 C2)^(1/2)) for PSD C1, C2, as Tr((S C2 S)^(1/2)) with S = C1^(1/2)."""
    s = psd_sqrt(c1)
    w = np.linalg.eigvalsh(symmetric(s @ symmetric(c2) @ s))
    return float(np.sqrt(np.clip(w, 0.0, None)).sum())


def frechet_distance(m1: np.ndarray, c1: np.ndarray, m2: np.ndarray, c2: np.ndarray) -> float:
    """FD between N(m1, C1) and N(m2, C2); the covariances are projected to PSD first."""
    m1, m2 = np.asarray(m1, np.float64), np.asarray(m2, np.float64)
    if m1.shape != m2.shape or c1.shape != c2.shape or c1.shape != (m1.size, m1.size):
        raise DpfleetError(f"mismatched statistics: means {m1.shape} / {m2.shape}, "
                           f"covariances {np.shape(c1)} / {np.shape(c2)} (same embedder and d?)")
    c1, c2 = psd_projection(c1), psd_projection(c2)
    diff = m1 - m2
    value = float(diff @ diff + np.trace(c1) + np.trace(c2) - 2.0 * trace_sqrt_product(c1, c2))
    return max(value, 0.0)


def moments(embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (biased, 1/n) covariance of the rows: the public side of FD."""
    e = np.asarray(embeddings, dtype=np.float64)
    if e.ndim != 2 or len(e) < 2:
        raise DpfleetError(f"need at least 2 embeddings of one dimension, got shape {e.shape}")
    mean = e.mean(axis=0)
    centred = e - mean
    return mean, centred.T @ centred / len(e)


def gaussian_loglik(embeddings: np.ndarray, mean: np.ndarray, cov: np.ndarray,
                    ridge: float = 1e-3) -> np.ndarray:
    """log N(e; mean, PSD(cov) + ridge * mean eigenvalue * I) of each row (up to a constant).

    The ridge keeps directions the noisy covariance zeroed from dominating the score."""
    c = psd_projection(cov)
    c += ridge * max(float(np.trace(c)) / len(c), 1e-12) * np.eye(len(c))
    w, v = np.linalg.eigh(c)
    z = (np.asarray(embeddings, np.float64) - mean) @ v
    return -0.5 * ((z * z) / w).sum(axis=1) - 0.5 * float(np.log(w).sum())
