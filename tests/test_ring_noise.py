"""Discrete tree noise on secure aggregation's ring sum: integer residuals telescope to the direct
prefix noise exactly, the release is (sum + noise) mod 2^b decoded, the ring has headroom (or the
config is refused), and the accounting of the discrete Gaussian checks out against dp-accounting."""

import functools
import math
from fractions import Fraction

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_from_sensitivity
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.dp_ftrl import DPFTRLConfig, DPFTRLServer
from dpfleet.coordinator.mechanisms.discrete_gaussian import DiscreteGaussianNodes, integer_sigma_sq
from dpfleet.coordinator.mechanisms.noise_stream import NodeStream
from dpfleet.coordinator.mechanisms.ring_noise import plan_ring, release, ring_nodes
from dpfleet.coordinator.mechanisms.tree_noise import TreeNoise
from dpfleet.errors import DpfleetError
from dpfleet.secagg.aggregator import SecAggAggregator


def nodes(dim=64, sigma_sq=Fraction(25), key=b"k" * 32):
    return DiscreteGaussianNodes(sigma_sq, dim,
                                 lambda t, lv, ix: NodeStream(key, t, lv, ix, domain=b"dgauss"))


@settings(deadline=None, max_examples=10)
@given(st.integers(1, 70), st.integers(0, 3))
def test_integer_residuals_telescope_to_the_direct_prefix(rounds, tree_id):
    tree = TreeNoise(64, nodes(), tree_id)
    # the direct prefixes from a second node source with the same key, each node drawn once:
    # prefix_noise(t) redraws its ~log2(t) nodes at every t, which made this test seconds long
    direct = TreeNoise(64, functools.cache(nodes()), tree_id)
    total = np.zeros(64, np.int64)
    for t in range(1, rounds + 1):
        residual = tree.next_residual()
        assert residual.dtype == np.int64
        total += residual
        np.testing.assert_array_equal(total, direct.prefix_noise(t))  # exact: integers
    resumed = TreeNoise.from_state(tree.state_dict(), nodes())  # what a resume point restores
    np.testing.assert_array_equal(resumed.next_residual(), tree.next_residual())


def deltas(n, dim, clip, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal(dim)
        out.append(x * clip * rng.uniform(0.5, 1.0) / np.linalg.norm(x))
    return out


def test_release_is_the_decoded_ring_sum_plus_integer_noise():
    dim, n, clip = 3000, 5, 0.5
    plan = plan_ring(dim, clip, 32, n, 1.0, rounds=8, block_size=1024)
    agg = SecAggAggregator(clip, bits=32, graph="complete", block_size=1024,
                           ring_clients=plan.ring_clients)
    noise = ring_nodes(plan, b"s" * 32)
    xs = deltas(n, dim, clip, 0)
    result = agg.aggregate(xs, round_seed=5)
    released = release(result.ring, TreeNoise(plan.length, noise).next_residual())
    exact = np.sum(xs, axis=0)
    assert np.linalg.norm(result.total - exact) <= result.info["quantization_bound"]
    # the release differs from the noiseless decode by the rotated-back node noise: z C per node
    diff = released - result.total
    assert diff.std() == pytest.approx(plan.noise_std, rel=0.05)
    assert plan.noise_std == pytest.approx(1.0 * clip, rel=1e-6)  # norm inflation ~ 1 + 1e-7
    # and exactly: decode is linear in the (non-wrapping) ring value
    node = noise(0, 0, 0)
    np.testing.assert_allclose(diff, result.ring.decode(node) - result.ring.decode(np.zeros_like(node)),
                               atol=1e-9)
    # an attacker who guesses the noise with another key is off by the full noise, not by rounding
    wrong = ring_nodes(plan, b"x" * 32)(0, 0, 0)
    guess = released - (result.ring.decode(wrong) - result.ring.decode(np.zeros_like(wrong)))
    assert np.linalg.norm(guess - exact) > 0.5 * math.sqrt(2 * dim) * plan.noise_std


@pytest.mark.parametrize("z,dim", [(1.0, 81_088), (7.0, 81_088), (20.0, 4_400_000)])
def test_headroom_holds_the_worst_sum_plus_noise(z, dim):
    plan = plan_ring(dim, 0.3, 32, 20, z, rounds=2000)
    half = 2**31 - 1
    assert 20 * plan.level + plan.noise_bound <= half  # n clients at +-L plus the noise bound
    depth = 1 + math.floor(math.log2(2000))
    wrap = 2 * plan.length * 2000 * math.exp(-plan.noise_bound**2 / (2 * depth * float(plan.sigma_sq)))
    assert wrap <= 1e-12 * (1 + 1e-9)
    assert float(plan.sigma_sq) >= (z * plan.delta_s) ** 2  # sigma >= z Delta_s: rho is as accounted


def test_headroom_refusal_is_a_clear_error():
    with pytest.raises(DpfleetError, match="no room"):
        plan_ring(81_088, 0.3, 16, 20, 50.0, rounds=2000)
    with pytest.raises(DpfleetError, match="noise_multiplier > 0"):
        plan_ring(81_088, 0.3, 32, 20, 0.0, rounds=10)


def test_a_ring_without_headroom_would_wrap():
    """The attack on the headroom rule: with the plain encoding (level sized for n clients only)
    the same noise wraps the ring and the decoded release is garbage, far beyond the noise."""
    dim, n, clip = 2048, 4, 0.5
    plan = plan_ring(dim, clip, 32, n, 0.5, rounds=4, block_size=1024)
    xs = deltas(n, dim, clip, 1)
    naive = SecAggAggregator(clip, bits=32, graph="complete", block_size=1024).aggregate(xs, 3)
    sized = SecAggAggregator(clip, bits=32, graph="complete", block_size=1024,
                             ring_clients=plan.ring_clients).aggregate(xs, 3)
    exact = np.sum(xs, axis=0)
    for agg, ok in ((sized, True), (naive, False)):  # each ring with noise z * its own Delta_s
        sigma_sq, t = integer_sigma_sq((0.5 * agg.info["sensitivity"] * agg.info["scale"]) ** 2)
        noise = DiscreteGaussianNodes(sigma_sq, agg.ring.values.size,
                                      lambda *node: NodeStream(b"w" * 32, *node, domain=b"dgauss"),
                                      t=t)(0, 0, 0)
        noisy = (agg.ring.values.astype(np.int64) + noise) & np.int64(2**32 - 1)
        err = np.linalg.norm(agg.ring.decode(noisy) - exact) / math.sqrt(dim)
        expected = math.sqrt(sigma_sq) / agg.info["scale"]
        assert (abs(err / expected - 1) < 0.1) == ok, (err, expected)


def test_discrete_mode_needs_secure_aggregation():
    with pytest.raises(DpfleetError, match="requires aggregation.kind = 'secagg'"):
        parse_config({"dp": {"noise": "discrete"}})
    with pytest.raises(DpfleetError, match="must be one of"):
        parse_config({"dp": {"noise": "laplace"}})
    assert parse_config({"dp": {"noise": "discrete"}, "aggregation": {"kind": "secagg"}})


def renyi_discrete_gaussian(sigma: float, shift: int, alpha: float) -> float:
    """D_alpha(N_Z(0, s^2) || N_Z(shift, s^2)) by direct summation over the integers."""
    y = np.arange(-int(60 * sigma) - 60, int(60 * sigma) + 61).astype(float)
    logp = -y**2 / (2 * sigma**2)
    logq = -(y - shift) ** 2 / (2 * sigma**2)
    lognorm = np.logaddexp.reduce(logp)  # same normaliser for both (shift is an integer)
    terms = alpha * (logp - lognorm) + (1 - alpha) * (logq - lognorm)
    return float(np.logaddexp.reduce(terms)) / (alpha - 1)


@pytest.mark.parametrize("sigma,sens", [(1.0, 1), (2.5, 1), (2.5, 3), (6.0, 2), (20.0, 5)])
def test_discrete_accounting_against_dp_accounting(sigma, sens):
    rho = zcdp_from_sensitivity(sigma / sens, 1)  # z = sigma / Delta, S = 1 (one release)
    assert rho == pytest.approx(sens**2 / (2 * sigma**2))
    for alpha in (2, 3, 8):  # CKS 2020: D_alpha = alpha * rho exactly for integer alpha
        assert renyi_discrete_gaussian(sigma, sens, alpha) == pytest.approx(alpha * rho, rel=1e-9)
    for alpha in (1.25, 1.5, 4.5):  # and <= alpha * rho in between (the zCDP statement)
        renyi = renyi_discrete_gaussian(sigma, sens, alpha)
        assert alpha * rho * (1 - 1e-6) <= renyi <= alpha * rho * (1 + 1e-12)
    for delta in (1e-5, 1e-10):
        ours = epsilon_from_zcdp(rho, delta, "rdp")
        pld = privacy_loss_distribution.from_discrete_gaussian_mechanism(
            sigma, sensitivity=sens).get_epsilon_for_delta(delta)
        assert pld <= ours  # the discrete PLD (exact) never exceeds the zCDP conversion
        assert ours < 2.5 * pld + 0.5  # and the conversion is not vacuous


def test_restart_starts_a_fresh_tree_with_fresh_nodes():
    plan = plan_ring(1500, 0.5, 32, 3, 1.0, rounds=6, block_size=512)
    server = DPFTRLServer(np.zeros(1500, np.float32), DPFTRLConfig(1.0, 0.5, 3), b"r" * 32, ring=plan)
    first = [server.tree.next_residual() for _ in range(3)]
    server.restart()
    assert server.tree.tree_id == 1 and server.tree.t == 0
    after = server.tree.next_residual()
    np.testing.assert_array_equal(after, ring_nodes(plan, b"r" * 32)(1, 0, 0))  # t = 1 of tree 1
    assert not np.array_equal(after, first[0])  # never the old tree's node again
