import numpy as np
import pytest

from dpfleet.coordinator.engine.dp_ftrl import DPFTRLConfig, DPFTRLServer


def test_noiseless_server_is_sgd_with_momentum_on_the_average():
    theta0 = np.zeros(3, dtype=np.float32)
    srv = DPFTRLServer(theta0, DPFTRLConfig(0.0, 1.0, report_goal=4, server_lr=0.5, momentum=0.9))
    sums = [np.array([4.0, 0, 0]), np.array([0, 8.0, 0]), np.array([0, 0, -4.0])]
    m = np.zeros(3)
    theta = np.zeros(3)
    for s in sums:
        m = 0.9 * m + s / 4
        theta = theta + 0.5 * m
        np.testing.assert_allclose(srv.step(s.astype(np.float32)), theta, rtol=1e-6)
    assert srv.round == 3


def test_prefix_of_noisy_averages_equals_tree_noised_prefix_sums():
    # With momentum 0 and server lr 1, theta_t - theta_0 is the released noisy prefix sum / m.
    srv = DPFTRLServer(np.zeros(1000, np.float32), DPFTRLConfig(2.0, 0.5, report_goal=10,
                                                                momentum=0.0), noise_key=bytes(32))
    total = np.zeros(1000)
    for t in range(1, 12):
        s = np.full(1000, float(t), np.float32)
        total += s
        theta = srv.step(s)
        expected = (total + srv.tree.prefix_noise(t)) / 10
        np.testing.assert_allclose(theta, expected, rtol=1e-4, atol=1e-4)
    assert srv.noise_std == pytest.approx(1.0)


def test_restart_starts_a_fresh_tree_and_keeps_old_noise():
    cfg = DPFTRLConfig(1.0, 1.0, report_goal=1, momentum=0.0, restart_rounds=(3,))
    srv = DPFTRLServer(np.zeros(50, np.float32), cfg)
    for _ in range(3):
        srv.step(np.zeros(50, np.float32))
    before = srv.theta.copy()
    np.testing.assert_allclose(before, srv.tree.prefix_noise(3), rtol=1e-5, atol=1e-5)
    srv.step(np.zeros(50, np.float32))  # round index 3 restarts
    assert srv.tree.tree_id == 1 and srv.tree.t == 1
    np.testing.assert_allclose(srv.theta - before, srv.tree.prefix_noise(1), rtol=1e-5, atol=1e-5)


def test_state_dict_round_trip():
    cfg = DPFTRLConfig(1.0, 1.0, report_goal=2)
    a = DPFTRLServer(np.ones(8, np.float32), cfg)
    for _ in range(5):
        a.step(np.ones(8, np.float32))
    b = DPFTRLServer(np.zeros(8, np.float32), cfg, noise_key=a.noise_key)
    b.load_state(a.state_dict())
    for _ in range(4):
        np.testing.assert_array_equal(a.step(np.ones(8, np.float32)), b.step(np.ones(8, np.float32)))
