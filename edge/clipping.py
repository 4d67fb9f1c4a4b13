"""The L2 clip of a client's delta, in numpy only (shared by the simulator and the device client).

The sensitivity is C exactly, not C up to rounding: scaling to C in float64 and rounding to float32
can land up to ~6e-8 relative above C, so while the float64 norm of the result is still > C every
coordinate moves one ulp toward zero (each then lies below its exact scaled value, so one step
suffices in practice).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def norm64(vec: np.ndarray) -> float:
    """L2 norm accumulated in float64 by numpy's pairwise sum: no thread pool is woken.

    np.linalg.norm wakes OpenBLAS's threads, which spin against torch's on a small machine (a
    profile of the peers' workload); torch.linalg.vector_norm(dtype=float64) at 2 torch threads took
    3-5 ms for an 81k vector with the other core busy, 70x its 1-thread time (the main job's profile:
    1.5 s of a 4.4 s main-job round); this takes 0.08-0.12 ms either way."""
    v = vec.astype(np.float64)
    return float(np.sqrt(np.sum(v * v)))


def clip_l2(
    vec: np.ndarray, clip_norm: float, norm: Callable[[np.ndarray], float] = norm64
) -> tuple[np.ndarray, float]:
    """Scale `vec` down to L2 norm <= clip_norm; returns (clipped vector, original norm)."""
    if not clip_norm > 0:
        raise ValueError("clip norm must be positive")
    original = norm(vec)
    if original <= clip_norm:
        return vec, original
    out = (vec.astype(np.float64) * (clip_norm / original)).astype(vec.dtype)
    while norm(out) > clip_norm:  # float32 rounding may leave it a few ulps above C
        out = np.nextafter(out, np.zeros((), out.dtype))
    return out, original
