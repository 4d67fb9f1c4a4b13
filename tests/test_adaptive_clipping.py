"""Adaptive clipping inside DP-FTRL: quantile estimation, tree-noised counts, noise transformation."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpfleet.coordinator.accounting.zcdp import model_noise_multiplier
from dpfleet.coordinator.config import clip_count_stddev, parse_config
from dpfleet.coordinator.engine.adaptive_clipping import QuantileClipEstimator, default_restart_rounds
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.coordinator.mechanisms.tree_noise import TreeNoise
from dpfleet.errors import DpfleetError

NORMAL_QUANTILE = {0.5: 0.0, 0.8: 0.8416212335729143, 0.2: -0.8416212335729143}


def lognormal_run(gamma: float, rounds: int, m: int = 100, restart_every: int = 0,
                  initial: float = 0.05, seed: int = 0) -> list[float]:
    est = QuantileClipEstimator(initial, m, target_quantile=gamma, learning_rate=0.2,
                                count_stddev=0.0)
    rng = np.random.default_rng(seed)
    trace = []
    for t in range(rounds):
        if restart_every and t and t % restart_every == 0:
            est.restart()
        trace.append(est.update(rng.lognormal(mean=0.0, sigma=0.5, size=m)))
    return trace


@pytest.mark.parametrize("gamma", [0.5, 0.8, 0.2])
def test_noiseless_estimate_converges_to_the_true_quantile(gamma):
    true = math.exp(0.5 * NORMAL_QUANTILE[gamma])  # lognormal(0, 0.5) quantile
    trace = lognormal_run(gamma, 400)  # starts 20x too small
    assert abs(trace[20] / true - 1) > 0.3  # ... so it has to travel
    tail = np.array(trace[-100:])
    assert abs(np.exp(np.log(tail).mean()) / true - 1) < 0.05
    assert np.abs(np.log(tail / true)).max() < 0.25


def test_restarts_rebase_without_changing_the_noiseless_trajectory():
    np.testing.assert_allclose(lognormal_run(0.5, 300, restart_every=37), lognormal_run(0.5, 300),
                               rtol=1e-9)


def test_closed_form_is_the_unrolled_geometric_update():
    # Andrew et al.: C <- C exp(-eta (fraction below C - gamma)), one round at a time
    rng = np.random.default_rng(3)
    est = QuantileClipEstimator(1.0, 20, target_quantile=0.6, learning_rate=0.3, count_stddev=0.0)
    c = 1.0
    for _ in range(50):
        norms = rng.exponential(2.0, 20)
        below = float(np.mean(norms <= c))
        c *= math.exp(-0.3 * (below - 0.6))
        assert est.update(norms) == pytest.approx(c, rel=1e-9)


def test_count_noise_is_the_trees_prefix_noise_not_a_sum_of_fresh_draws():
    # every norm is below the estimate, so the bits are known and only the noise moves C
    m, eta, gamma, sigma_b = 10, 0.2, 0.5, 3.0
    est = QuantileClipEstimator(1e9, m, target_quantile=gamma, learning_rate=eta,
                                count_stddev=sigma_b, noise_key=bytes(32))
    reference = TreeNoise(1, GaussianNodes(bytes(32), sigma_b, 1, domain=b"count"), 0)
    for n in range(1, 40):
        c = est.update(np.zeros(m))
        noise = float(reference.prefix_noise(n)[0])
        expected = 1e9 * math.exp(-eta * ((n * m / 2 + noise) / m + n / 2 - n * gamma))
        assert c == pytest.approx(expected, rel=1e-7)  # the tree's noise is float32


@given(z=st.floats(0.05, 50), slack=st.floats(1.01, 100))
def test_noise_transformation_keeps_the_accounted_noise_multiplier(z, slack):
    sigma_b = slack * z / 2  # 2 sigma_b > z
    z_delta = model_noise_multiplier(z, sigma_b)
    assert z_delta > z
    # model (sensitivity C, std z_delta C) and centred counts (sensitivity 1/2, std sigma_b)
    # together are one Gaussian mechanism of noise multiplier z (paper 002 Thm. 1)
    assert (z_delta**-2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z, rel=1e-9)


def test_noise_transformation_edge_cases():
    assert model_noise_multiplier(0.0, 0.0) == 0.0  # no DP: no noise anywhere
    assert model_noise_multiplier(7.0, 6500 / 20) == pytest.approx(7.0004, abs=1e-4)  # paper 002
    with pytest.raises(DpfleetError, match="2 \\* clip_count_stddev > noise_multiplier"):
        model_noise_multiplier(1.0, 0.5)


def test_default_restart_rounds_are_128_plus_1024_i():
    assert default_restart_rounds(3000) == [128, 1152, 2176]
    assert default_restart_rounds(128) == [] and default_restart_rounds(129) == [128]


def test_config_keys_and_errors():
    cfg = parse_config({"dp": {"adaptive_clipping": True, "report_goal": 40, "noise_multiplier": 1.0}})
    assert clip_count_stddev(cfg) == 2.0 and cfg.dp.target_quantile == 0.5 and cfg.dp.clip_lr == 0.2
    with pytest.raises(DpfleetError, match="clip_count_stddev > noise_multiplier"):
        parse_config({"dp": {"adaptive_clipping": True, "report_goal": 20, "noise_multiplier": 2.0}})
    # with secure aggregation the clipped bit is masked with the update (test_secagg_adaptive)
    both = parse_config({"dp": {"adaptive_clipping": True}, "aggregation": {"kind": "secagg"}})
    assert both.dp.adaptive_clipping and both.aggregation.kind == "secagg"
    with pytest.raises(DpfleetError, match="target_quantile"):
        parse_config({"dp": {"target_quantile": 1.0}})
