"""BLT / banded strategies: streaming noise equals the dense C^{-1} Z, inverses, honest optimiser losses."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.mechanisms.blt import (
    BLT,
    BandedNoise,
    banded_toeplitz_matrix,
    dense_prefix_error_per_round,
    prefix_error_per_round,
    tree_prefix_error_per_round,
)
from dpfleet.coordinator.mechanisms.mf_optimize import (
    banded_loss,
    blt_inverse_coefs,
    blt_loss,
    optimize_banded,
    optimize_blt,
    tree_loss,
)
from dpfleet.coordinator.mechanisms.mf_sensitivity import brute_force_sensitivity_squared
from dpfleet.coordinator.mechanisms.tree_noise import prefix_nodes
from dpfleet.errors import DpfleetError

SETTINGS = settings(max_examples=40, deadline=None)

# strategies in the regime the sensitivity formulas and the optimiser use: theta in (0, 1),
# omega > 0 with c_1 = sum(omega) <= 1 = c_0 (non-increasing coefficients)
blts = st.integers(1, 4).flatmap(lambda d: st.builds(
    lambda theta, omega: BLT(np.array(theta), np.array(omega) / max(1.0, sum(omega))),
    st.lists(st.floats(0.01, 0.99), min_size=d, max_size=d),
    st.lists(st.floats(0.001, 1.0), min_size=d, max_size=d)))


@SETTINGS
@given(blts, st.integers(1, 30), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_streaming_blt_noise_equals_dense(blt, n, dim, seed):
    z = np.random.default_rng(seed).normal(size=(n, dim))
    stream = blt.noise(dim)
    got = np.array([stream.next(row) for row in z])
    assert stream.state.shape == (blt.buffers, dim)  # the whole state: buffers x dim
    np.testing.assert_allclose(got, np.linalg.solve(blt.matrix(n), z), rtol=1e-9, atol=1e-9)


@SETTINGS
@given(blts, st.integers(1, 40))
def test_inverse_is_a_blt_with_the_dense_inverse_coefficients(blt, n):
    dense = np.linalg.inv(blt.matrix(n))[:, 0]
    inverse = blt.inverse()
    assert inverse.buffers == blt.buffers and np.all(inverse.omega <= 0)
    np.testing.assert_allclose(inverse.coefs(n), dense, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(blt_inverse_coefs(blt, n), dense, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(blt.inverse_coefs(n), dense, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(inverse.matrix(n) @ blt.matrix(n), np.eye(n), atol=1e-9)


def test_blt_coefficients_follow_the_parametrisation():
    blt = BLT(np.array([0.5, 0.25]), np.array([0.2, 0.4]))
    np.testing.assert_allclose(blt.coefs(4), [1.0, 0.6, 0.2 * 0.5 + 0.4 * 0.25,
                                              0.2 * 0.25 + 0.4 * 0.0625])


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 25), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_streaming_banded_noise_equals_dense(bands, n, dim, seed):
    rng = np.random.default_rng(seed)
    coef = np.concatenate([[1.0], rng.uniform(-0.6, 0.6, bands - 1)])
    z = rng.normal(size=(n, dim))
    stream = BandedNoise(coef, dim)
    got = np.array([stream.next(row) for row in z])
    assert len(stream.past) <= bands - 1  # the whole state: bands - 1 vectors
    np.testing.assert_allclose(got, np.linalg.solve(banded_toeplitz_matrix(coef, n), z),
                               rtol=1e-8, atol=1e-8)
    # a general (non-Toeplitz, e.g. column-normalised) banded C streams the same way
    mask = np.subtract.outer(np.arange(n), np.arange(n))
    dense = np.tril(rng.uniform(-1, 1, (n, n))) * (mask < bands)
    dense[np.diag_indices(n)] = rng.uniform(0.5, 2.0, n)
    stream = BandedNoise(dense, dim)
    got = np.array([stream.next(row) for row in z])
    np.testing.assert_allclose(got, np.linalg.solve(dense, z), rtol=1e-8, atol=1e-8)
    with pytest.raises(DpfleetError, match="covers"):
        stream.next(z[0])


@SETTINGS
@given(blts, st.integers(1, 30))
def test_toeplitz_prefix_error_equals_dense(blt, n):
    np.testing.assert_allclose(prefix_error_per_round(blt.inverse_coefs(n)),
                               dense_prefix_error_per_round(blt.matrix(n)), rtol=1e-9)


def test_tree_prefix_error_counts_the_streaming_trees_nodes():
    assert tree_prefix_error_per_round(20).tolist() == [len(prefix_nodes(t)) for t in range(1, 21)]


@pytest.mark.parametrize("n,gap,k", [(12, 3, 4), (14, 2, 3), (10, 10, 1)])
def test_optimised_losses_are_honest(n, gap, k):
    """The optimiser's reported loss is recomputed from the dense matrices and brute force."""
    for reduction in ("max", "mean"):
        blt = optimize_blt(n, gap, k, buffers=2, reduction=reduction, starts=2)
        c = BLT(np.array(blt.params["theta"]), np.array(blt.params["omega"])).matrix(n)
        err = dense_prefix_error_per_round(c)
        dense = (err.max() if reduction == "max" else err.mean()) * brute_force_sensitivity_squared(
            c, gap, k, upper_bound=True)
        assert blt.loss == pytest.approx(dense, rel=1e-7)
        band = optimize_banded(n, gap, k, reduction=reduction)
        c = banded_toeplitz_matrix(np.array(band.params["coef"]), n)
        err = dense_prefix_error_per_round(c)
        dense = (err.max() if reduction == "max" else err.mean()) * brute_force_sensitivity_squared(
            c, gap, k, upper_bound=True)
        assert band.loss == pytest.approx(dense, rel=1e-7)


def test_optimised_strategies_beat_the_tree_and_the_trivial_strategies():
    n, gap, k = 60, 3, 15  # the planner's MinS 2 (gap 3), MaxP 15 over 60 rounds from issue 23
    tree = tree_loss(n, gap, k)
    identity = banded_loss(np.ones(1), n, gap, k)  # C = I: independent noise per round
    prefix = blt_loss(BLT(np.array([1e-12]), np.array([1.0 - 1e-12])), n, gap, k)  # ~C = A
    blt = optimize_blt(n, gap, k).loss
    band = optimize_banded(n, gap, k).loss
    assert max(blt, band) < 0.5 * min(tree, identity, prefix)


def test_optimised_blt_streams_stably_over_a_long_run():
    """Decays near 1 from the optimiser: 2,000 streamed rounds still equal the dense solve."""
    from scipy.linalg import solve_triangular
    opt = optimize_blt(2000, 10, 20, buffers=2)
    blt = BLT(np.array(opt.params["theta"]), np.array(opt.params["omega"]))
    assert blt.theta.max() > 0.9
    z = np.random.default_rng(1).normal(size=(2000, 3))
    stream = blt.noise(3)
    got = np.array([stream.next(row) for row in z])
    np.testing.assert_allclose(got, solve_triangular(blt.matrix(2000), z, lower=True), rtol=1e-9,
                               atol=1e-9)
