"""Adaptive clipping with matrix-factorization noise (dp.mechanism banded / blt, `adaptive_clipping`).

On the value: the noise a real run added to each round's sum is C_t / C_0 times the dense
C^-1 Z of the key (the release is x_t / C_t + z_delta (C^-1 z)_t, times C_t), every round's clip
norm is the estimate after the previous round, the clip estimates are rebuilt exactly from the
true counts and the count domain's MF noise, the accounting equals the MF Gaussian at z_delta
composed with the count mechanism at 2 sigma_b on the same strategy (= MF at z), resume continues
bit for bit, and the estimator tracks the quantile of a known norm distribution.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from crashes import Crash
from test_mf_simulate import QUIET, ROUNDS, M, config, crash_before, fresh_z, released_theta, strategy

import dpfleet.coordinator.engine.adaptive_clipping as adaptive_clipping
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, model_noise_multiplier, zcdp_from_noise
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine import simulation
from dpfleet.coordinator.engine.adaptive_clipping import QuantileClipEstimator
from dpfleet.coordinator.engine.dp_ftrl import DPFTRLServer
from dpfleet.coordinator.mechanisms.matrix import MatrixMechanism
from dpfleet.coordinator.mechanisms.mf_noise import MF_COUNT_DOMAIN
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes, seeded_noise_key
from dpfleet.coordinator.mechanisms.spec import (
    MechanismSpec,
    optimize_mechanism,
    sensitivity_squared,
)

SIGMA_B, CLIP0, Z = 1.0, 0.5, 1.0


def adaptive(kind="blt", **dp):
    return config(kind, adaptive_clipping=True, clip_count_stddev=SIGMA_B, **dp)


def spied(tmp_path, monkeypatch, name, values, **kwargs):
    """The run, each round's (true sum, added noise, clip norm) and each round's true count."""
    rounds, counts = [], []
    real_step, real_count = DPFTRLServer.step, QuantileClipEstimator.update_count

    def step(self, delta_sum):
        before = self.theta.astype(np.float64)
        total = np.asarray(delta_sum, dtype=np.float64).copy()
        theta = real_step(self, delta_sum)
        rounds.append((total, (theta.astype(np.float64) - before) * M - total, self.clip_norm))
        return theta

    def update_count(self, below, reported):
        counts.append((below, reported))
        return real_count(self, below, reported)

    monkeypatch.setattr(DPFTRLServer, "step", step)
    monkeypatch.setattr(adaptive_clipping.QuantileClipEstimator, "update_count", update_count)
    try:
        result = simulation.run_simulation(parse_config(values), tmp_path / name, **QUIET, **kwargs)
    finally:
        monkeypatch.setattr(DPFTRLServer, "step", real_step)
        monkeypatch.setattr(adaptive_clipping.QuantileClipEstimator, "update_count", real_count)
    return result, rounds, counts


def read_json(path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("kind", ["blt", "banded"])
def test_noise_is_scaled_by_each_rounds_clip_norm_and_the_clip_follows_the_estimate(tmp_path, monkeypatch,
                                                                                    kind):
    result, rounds, counts = spied(tmp_path, monkeypatch, kind, adaptive(kind, noise_seed=11))
    key, path = seeded_noise_key(11), result.run_dir
    spec = MechanismSpec.from_json(read_json(path / "mechanism.json")["spec"])
    z_delta = model_noise_multiplier(Z, SIGMA_B)
    dim = rounds[0][0].size
    unit = np.linalg.inv(strategy(spec, ROUNDS)) @ fresh_z(key, z_delta * CLIP0, dim, 0,
                                                           range(1, ROUNDS + 1))
    clips = np.array([c for _, _, c in rounds])
    for t, (total, noise, clip) in enumerate(rounds):
        expected = unit[t] * clip / CLIP0  # C_t (x_t / C_t + z_delta (C^-1 z)_t) - x_t
        assert np.abs(noise - expected).max() < 1e-4 * np.abs(expected).max() + 1e-6, t
        assert np.linalg.norm(total) <= M * clip * (1 + 1e-5)  # each delta clipped to C_t
    assert clips[0] == CLIP0 and len(set(clips.round(9))) == ROUNDS  # a new clip norm every round
    estimates = [m["clip_estimate"] for m in result.metrics]
    np.testing.assert_allclose(clips[1:], estimates[:-1], rtol=1e-12)  # C_t = estimate after t-1
    # the estimates: Andrew et al.'s unrolled update over the count domain's MF prefix noise
    z_count = GaussianNodes(key, SIGMA_B, 1, MF_COUNT_DOMAIN)
    count_noise = np.linalg.inv(strategy(spec, ROUNDS)) @ np.array(
        [z_count(0, 0, t) for t in range(1, ROUNDS + 1)], dtype=np.float64)
    prefix, gamma, eta = 0.0, 0.5, 0.2
    for t, ((below, reported), est) in enumerate(zip(counts, estimates, strict=True)):
        prefix += below - 0.5 * reported + float(count_noise[t, 0])
        n = t + 1
        rebuilt = CLIP0 * math.exp(-eta * (prefix / M + 0.5 * n - n * gamma))
        assert est == pytest.approx(rebuilt, rel=1e-5), t
    # accounting: MF at z_delta composed with the count mechanism (sensitivity 1/2, noise sigma_b)
    privacy = read_json(path / "privacy.json")
    mins, maxp = privacy["min_separation"], privacy["max_participation"]
    sens = sensitivity_squared(spec, mins if maxp > 1 else ROUNDS - 1, maxp)
    composed = sens / (2 * z_delta**2) + sens * 0.25 / (2 * SIGMA_B**2)
    assert privacy["zcdp"] == pytest.approx(composed, rel=1e-9)
    assert composed == pytest.approx(zcdp_from_noise(Z, ROUNDS, maxp, mins if maxp > 1 else ROUNDS - 1,
                                                     mechanism=MatrixMechanism(spec)))
    assert privacy["epsilon"] == pytest.approx(epsilon_from_zcdp(composed, 1e-6, "pld"), rel=1e-9)
    assert privacy["model_noise_multiplier"] == pytest.approx(z_delta)
    assert "adaptive clipping" in privacy["accounting"] and privacy["restarts"] == []


@pytest.mark.slow
def test_resume_continues_the_model_and_count_streams_bit_for_bit(tmp_path, monkeypatch):
    values = adaptive("blt", noise_seed=4)
    reference = simulation.run_simulation(parse_config(values), tmp_path / "ref", **QUIET)
    out = tmp_path / "run"
    with pytest.raises(Crash):
        simulation.run_simulation(parse_config(values), out, before_round=crash_before(4), **QUIET)
    state = read_json(next(out.glob("resume*")) / "server_state.json")
    assert state["clip_estimator"]["tree"]["mechanism"] == "blt"  # position only, replayed
    assert state["clip_estimator"]["tree"] == {"dim": 1, "tree_id": 0, "t": 4, "mechanism": "blt"}
    resumed = simulation.run_simulation(parse_config(values), out, resume=True, **QUIET)
    np.testing.assert_array_equal(released_theta(resumed.run_dir), released_theta(reference.run_dir))
    assert [m["clip_estimate"] for m in resumed.metrics] == [m["clip_estimate"] for m in reference.metrics]


def test_estimator_on_mf_noise_tracks_the_quantile():
    """With counts noised by a BLT strategy, the clip norm moves from 0.1 to the median (2.0) of
    the devices' norms and stays near it (the fraction below it ~ the target quantile)."""
    rounds, m = 200, 100
    spec = optimize_mechanism("blt", rounds, 9, 20)
    est = QuantileClipEstimator(0.1, m, target_quantile=0.5, learning_rate=0.2, count_stddev=m / 20,
                                noise_key=bytes(range(32)), mechanism=spec)
    rng = np.random.default_rng(5)
    history = []
    for _ in range(rounds):
        history.append(est.update(np.exp(rng.normal(math.log(2.0), 0.5, size=m))))
    late = np.array(history[100:])
    assert 1.6 < float(np.median(late)) < 2.5
    below = float(np.mean([np.mean(np.exp(rng.normal(math.log(2.0), 0.5, 10_000)) <= c) for c in late]))
    assert abs(below - 0.5) < 0.1
    assert history[0] < 0.2 and est.tree.t == rounds  # one MF count stream, never restarted
