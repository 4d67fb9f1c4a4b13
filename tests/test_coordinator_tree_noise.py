import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.coordinator.mechanisms.tree_noise import TreeNoise, prefix_nodes


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def gaussian_tree(dim: int, std: float, seed: int) -> TreeNoise:
    return TreeNoise(dim, GaussianNodes(key(seed), std, dim))


@settings(deadline=None)
@given(st.integers(1, 5000))
def test_prefix_uses_at_most_log_nodes_and_partitions_the_prefix(t):
    nodes = prefix_nodes(t)
    assert len(nodes) <= math.ceil(math.log2(t + 1))
    covered = []
    for level, index in nodes:
        covered.extend(range(index * 2**level + 1, (index + 1) * 2**level + 1))
    assert covered == list(range(1, t + 1))


@settings(max_examples=25, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.integers(1, 70), st.integers(0, 5))
def test_streaming_residuals_equal_direct_prefix_noise(noise_key, rounds, tree_id):
    tree = TreeNoise(7, GaussianNodes(noise_key, 1.5, 7), tree_id)
    released = np.zeros(7, dtype=np.float64)
    for t in range(1, rounds + 1):
        released += tree.next_residual()
        np.testing.assert_allclose(released, tree.prefix_noise(t), rtol=1e-5, atol=1e-5)
    assert len(tree.stack) == bin(rounds).count("1")  # only log-many live node vectors


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 200), st.integers(0, 2**40))
def test_integer_nodes_stream_exactly(rounds, salt):
    # the discrete Gaussian's dtype: the residual arithmetic must be exact in int64
    def nodes(tree_id, level, index):
        return np.random.default_rng([salt, tree_id, level, index]).integers(-2**40, 2**40, 5)

    tree = TreeNoise(5, nodes)
    released = np.zeros(5, dtype=np.int64)
    for t in range(1, rounds + 1):
        residual = tree.next_residual()
        assert residual.dtype == np.int64
        released += residual
        np.testing.assert_array_equal(released, tree.prefix_noise(t))


def test_released_noise_variance_matches_theory():
    # Prefix t carries popcount(t) independent N(0, std^2) nodes: variance popcount(t) * std^2.
    std, dim = 0.7, 4000
    for t in (1, 2, 3, 7, 8, 13):
        samples = np.concatenate([gaussian_tree(dim, std, seed).prefix_noise(t) for seed in range(30)])
        expected = bin(t).count("1") * std**2
        assert samples.var() == pytest.approx(expected, rel=0.03)
        assert abs(samples.mean()) < 4 * math.sqrt(expected / samples.size)


def test_residuals_are_not_independent_of_past_rounds():
    # The residual at t=2 cancels node (0,0): released prefix 2 is ONE node, not two.
    tree = gaussian_tree(20000, 1.0, 3)
    r1, r2 = tree.next_residual(), tree.next_residual()
    assert (r1 + r2).var() == pytest.approx(1.0, rel=0.05)
    assert r2.var() == pytest.approx(2.0, rel=0.05)


def test_state_round_trip_continues_identically():
    a = gaussian_tree(5, 1.0, 11)
    for _ in range(6):
        a.next_residual()
    b = TreeNoise.from_state(a.state_dict(), a.nodes)
    for _ in range(9):
        np.testing.assert_array_equal(a.next_residual(), b.next_residual())


def test_bad_prefix_rejected():
    with pytest.raises(ValueError):
        prefix_nodes(0)
