"""Float32 parity with a tolerance scaled to the values compared.

Why: float32 rounding error grows with the magnitude of what is computed (an ulp at 30 is 30 times
one at 1), so a bare absolute tolerance is a statement about the model's scale as much as about
the program, and a trained model's logits can exceed it on another CPU's kernels with no bug.
The bound is rtol * max(1, max |reference|): absolute for values of order 1, relative beyond. At
rtol 1e-5 it is still far below what a real bug gives (a state dropped or carried wrong between
steps moves logits by > 1e-2; see test_streaming / test_kv_step's "really differs" checks).
"""

from __future__ import annotations

import numpy as np

RTOL = 1e-5


def scaled_bound(reference, rtol: float = RTOL) -> float:
    """rtol * max(1, max |reference|); the reference must be finite (else no bound means anything)."""
    ref = np.asarray(reference, dtype=np.float64)
    assert np.isfinite(ref).all(), "non-finite reference values"
    return rtol * max(1.0, float(np.abs(ref).max(initial=0.0)))


def assert_scaled_close(got, reference, rtol: float = RTOL) -> None:
    """max |got - reference| <= scaled_bound(reference, rtol), with the numbers in the message."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    assert got.shape == ref.shape, f"shape {got.shape} != {ref.shape}"
    bound = scaled_bound(ref, rtol)
    err = float(np.abs(got - ref).max(initial=0.0))
    assert err <= bound, (f"max |got - ref| = {err:.3g} > {bound:.3g} "
                          f"(rtol {rtol:g} x max(1, max |ref| = {np.abs(ref).max():.3g}))")
