"""The private half of FreD: a DP mean and a DP covariance of a cohort's embeddings (paper 003).

Not Algorithm 1 as printed. There, each *sample* gets N(0, tau1^2) before averaging, which leaves
tau1 / sqrt(n2) on the released mean (sqrt(n2) too little for Prop. 3.1); the covariance noise is
added per client and summed (sqrt(K) more than needed); the mean is calibrated for replace-one,
the covariance for add/remove, and the denominator n2 is itself private. Here:

* user level (default; dpfleet's unit is the device): each user of a cohort of exactly K users
  (K is public, the fixed denominator) contributes, in round 1, the mean of its clipped
  embeddings (norm <= c) and, in round 2, the mean of the outer products of its embeddings
  centred on the round-1 release and clipped to c (Frobenius norm <= c^2), sent as the upper
  triangle with off-diagonals times sqrt(2) so the vector's L2 norm is that Frobenius norm.
  Adding or removing a user moves the two sums by at most c and c^2.
* sample level (the paper's notion, labelled so): every sample is a contribution; round 1 also
  sums a constant coordinate, so the sample count it divides by is released with the same noise
  rather than assumed public.

The sums are formed by an `Aggregator` (plain, or SecAgg: the server sees only the sum) and one
Gaussian draw per sum is added centrally: std z1 * c and z2 * c^2, times the discretization's
norm inflation under SecAgg. Noise comes from the OS's entropy unless a seed is given (tests and
benchmarks only). The covariance is projected to PSD afterwards (post-processing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dpfleet.coordinator.engine.aggregation import Aggregator, PlainAggregator
from dpfleet.coordinator.mechanisms.noise_stream import (
    NodeStream,
    new_noise_key,
    seeded_noise_key,
    standard_normals,
)
from dpfleet.errors import DpfleetError
from dpfleet.progress import progress_bar
from dpfleet.public.fred import psd_projection

LEVELS = ("user", "sample")


def clip_rows(x: np.ndarray, c: float) -> np.ndarray:
    """Each row scaled to L2 norm at most c (Definition 2.4). A row with a NaN or inf becomes 0:
    one user's NaN would otherwise turn the whole noisy sum into NaN and reveal that user."""
    x = np.asarray(x, dtype=np.float64)
    x = np.where(np.isfinite(x).all(axis=1, keepdims=True), x, 0.0)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(1.0, norms / c)


def pack_upper(m: np.ndarray) -> np.ndarray:
    """Upper triangle of a symmetric matrix, off-diagonals x sqrt(2): L2 norm = Frobenius norm."""
    d = m.shape[0]
    i, j = np.triu_indices(d)
    return m[i, j] * np.where(i == j, 1.0, math.sqrt(2.0))


def unpack_upper(v: np.ndarray, d: int) -> np.ndarray:
    i, j = np.triu_indices(d)
    if v.size != i.size:
        raise DpfleetError(f"packed covariance has {v.size} entries, expected {i.size} for d = {d}")
    vals = v / np.where(i == j, 1.0, math.sqrt(2.0))
    m = np.zeros((d, d))
    m[i, j] = vals
    m[j, i] = vals
    return m


def mean_contribution(e: np.ndarray, c: float, level: str) -> np.ndarray:
    """Round 1 input of one user (norm <= c at user level; per-sample norm <= c at sample level)."""
    x = clip_rows(e, c)
    if level == "user":
        return x.mean(axis=0)
    counted = np.hstack([x, np.full((len(x), 1), c)]) / math.sqrt(2.0)
    return counted.sum(axis=0)


def cov_contribution(e: np.ndarray, mean: np.ndarray, c: float, level: str) -> np.ndarray:
    """Round 2 input of one user: packed (mean or sum of) outer products of clipped centred rows."""
    b = clip_rows(np.asarray(e, np.float64) - mean, c)
    outer = b.T @ b
    return pack_upper(outer / len(b) if level == "user" else outer)


@dataclass
class FredRelease:
    """The DP release: reusable for any number of candidates at no further privacy cost."""

    mean: np.ndarray
    cov: np.ndarray  # PSD projection of cov_raw
    cov_raw: np.ndarray  # the noisy second moment as released (symmetric, maybe indefinite)
    level: str
    clip: float
    cohort: int  # K (user level) or the released sample count (sample level)
    survivors: int
    z_mean: float
    z_cov: float
    noise_std_mean: float  # per coordinate of the released mean
    noise_std_cov_diag: float  # per diagonal entry of the released covariance
    info: dict = field(default_factory=dict)


def _sum(aggregator: Aggregator, vectors: list[np.ndarray], seed: int, what: str,
         secure: bool) -> tuple[np.ndarray, int, float]:
    result = aggregator.aggregate(vectors, seed)
    inflation = 1.0
    if secure:
        if "norm_inflation" not in result.info:
            raise DpfleetError(f"the secure aggregator reported no norm_inflation for the {what} "
                               "round: cannot calibrate the noise to its sensitivity")
        inflation = float(result.info["norm_inflation"])
    return np.asarray(result.total, np.float64), len(result.survivors), inflation


def private_moments(users: Sequence[np.ndarray], *, clip: float, z_mean: float, z_cov: float,
                    level: str = "user", aggregator: Aggregator | None = None,
                    secure: bool = False, noise_seed: int | None = None, round_seed: int = 0,
                    progress: bool = False, max_samples: int = 256,
                    aggregator_for: Callable[[float], Aggregator] | None = None) -> FredRelease:
    """Two DP rounds over `users` (one float array [n_u, d] per user of the cohort).

    `aggregator_for(bound)` builds the round's aggregator for per-client L2 bound `bound`
    (SecAgg needs it to discretize); otherwise `aggregator` (default plain) serves both rounds.
    Each user contributes at most its first `max_samples` embeddings: a public bound, so the
    SecAgg range never depends on the data.
    """
    if level not in LEVELS:
        raise DpfleetError(f"level must be one of {LEVELS}, got {level!r}")
    if not users:
        raise DpfleetError("the cohort is empty")
    if not (clip > 0 and z_mean > 0 and z_cov > 0):
        raise DpfleetError("clip and both noise multipliers must be > 0")
    d = users[0].shape[1]
    if any(u.ndim != 2 or u.shape[1] != d or len(u) == 0 for u in users):
        raise DpfleetError(f"every user needs >= 1 embedding of dimension {d}")
    # the same CSPRNG noise as DP-FTRL's (AES-256-CTR under a fresh 256-bit key; research mode:
    # a key anyone who knows noise_seed can rebuild)
    key = new_noise_key() if noise_seed is None else seeded_noise_key(noise_seed)

    def gaussian(std: float, shape: tuple[int, ...], index: int) -> np.ndarray:
        size = int(np.prod(shape))
        return std * standard_normals(NodeStream(key, 0, 0, index, domain=b"fred"), size).reshape(shape)
    users = [np.asarray(u, np.float64)[:max_samples] for u in users]
    cap = 1 if level == "user" else max_samples  # per-client bound in units of c (c^2)

    def agg(bound: float) -> Aggregator:
        if aggregator_for is not None:
            return aggregator_for(bound)
        return aggregator or PlainAggregator()

    bar = progress_bar(total=2 * len(users), desc="FreD statistics", enabled=progress, terminal_only=False)
    firsts = []
    for u in users:
        firsts.append(mean_contribution(u, clip, level))
        bar.update()
    s1, survivors, infl1 = _sum(agg(clip * cap), firsts, round_seed, "mean", secure)
    s1 = s1 + gaussian(z_mean * clip * infl1, s1.shape, index=0)
    if level == "user":
        denominator = float(len(users))
        mean = s1 / denominator
    else:
        denominator = max(s1[-1] * math.sqrt(2.0) / clip, 1.0)
        mean = s1[:-1] * math.sqrt(2.0) / denominator
    seconds = []
    for u in users:
        seconds.append(cov_contribution(u, mean, clip, level))
        bar.update()
    bar.close()
    s2, survivors2, infl2 = _sum(agg(clip * clip * cap), seconds, round_seed + 1, "covariance", secure)
    s2 = s2 + gaussian(z_cov * clip * clip * infl2, s2.shape, index=1)
    cov_raw = unpack_upper(s2, d) / denominator
    return FredRelease(
        mean=mean, cov=psd_projection(cov_raw), cov_raw=cov_raw, level=level, clip=clip,
        cohort=int(round(denominator)), survivors=min(survivors, survivors2),
        z_mean=z_mean, z_cov=z_cov,
        noise_std_mean=z_mean * clip * infl1 / denominator * (math.sqrt(2.0) if level == "sample" else 1),
        noise_std_cov_diag=z_cov * clip * clip * infl2 / denominator,
        info={"norm_inflation_mean": infl1, "norm_inflation_cov": infl2},
    )


def covariance_noise_to_signal(eigenvalues: np.ndarray, cohort: int, z_cov: float,
                               clip: float) -> np.ndarray:
    """E||noise||_F / ||C_d||_F of the released covariance for d = 1..len(eigenvalues).

    The noise is sigma = z2 c^2 / K per diagonal entry, sigma / sqrt(2) off it, so
    E||N||_F^2 = sigma^2 d (d + 1) / 2; the signal is the top-d spectrum of a public proxy."""
    lam = np.sort(np.clip(np.asarray(eigenvalues, np.float64), 0, None))[::-1]
    d = np.arange(1, len(lam) + 1)
    sigma = z_cov * clip * clip / cohort
    signal = np.sqrt(np.cumsum(lam ** 2))
    return sigma * np.sqrt(d * (d + 1) / 2.0) / np.maximum(signal, 1e-300)


def supported_dim(eigenvalues: np.ndarray, cohort: int, z_cov: float, clip: float,
                  max_ratio: float = 0.5) -> int:
    """Largest d whose covariance noise-to-signal ratio is <= max_ratio (0 if none)."""
    ratio = covariance_noise_to_signal(eigenvalues, cohort, z_cov, clip)
    ok = np.nonzero(ratio <= max_ratio)[0]
    return int(ok[-1] + 1) if ok.size else 0
