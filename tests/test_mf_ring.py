"""Matrix-factorization noise in secure aggregation's ring (`mf_ring`): attacks and properties.

Every test scores on the value: the rounding identity the privacy argument rests on (property
test, exact rationals), the wrap attack of tests/test_ring_wrap_attack.py against MF noise over
several rounds (the released ring values move by the target's own integer vector, <= Delta_s),
the noise a real `simulate` run added (spied in the ring) against the dense C^-1 Z of the key and
against guesses from the run directory, resume (same z at the same (segment, t), bit for bit) and
restart (fresh key), and the decoded release against the plain MF path (noise variance per round,
chi-square bounds) up to the quantization bound.
"""

from __future__ import annotations

import hashlib
import json
import math
from fractions import Fraction

import numpy as np
import pytest
from crashes import Crash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_mf_simulate import QUIET, config, crash_before, fresh_z, released_theta, strategy
from test_ring_wrap_attack import BITS, CLIP, DIM, KEY, Z, world

import dpfleet.coordinator.engine.round_engine as round_engine
import dpfleet.coordinator.mechanisms.ring_noise as ring_noise
from dpfleet.cli import main
from dpfleet.coordinator.accounting.privacy_report import RING_MF_MECHANISM
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_from_noise
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine import simulation
from dpfleet.coordinator.engine.dp_ftrl import DPFTRLConfig, DPFTRLServer
from dpfleet.coordinator.mechanisms.matrix import MatrixMechanism
from dpfleet.coordinator.mechanisms.mf_ring import RingMFNoise, inverse_variance_factor, round_half_up
from dpfleet.coordinator.mechanisms.noise_stream import seeded_noise_key
from dpfleet.coordinator.mechanisms.ring_noise import noisy_ring, plan_ring, ring_distance
from dpfleet.coordinator.mechanisms.spec import MechanismSpec, optimize_mechanism
from dpfleet.coordinator.state.release_log import check_no_reuse
from dpfleet.coordinator.state.resume import resume_point
from dpfleet.secagg.encoding import Discretizer
from dpfleet.secagg.sums import RingSum

ROUNDS = 6
REAL_NOISY_RING = ring_noise.noisy_ring
SPEC = optimize_mechanism("blt", 8, 1, 2)


def secagg(kind="blt", **dp):
    return dict(config(kind, **dp), aggregation={"kind": "secagg"})


@settings(deadline=None, max_examples=300)
@given(s=st.integers(-(2**40), 2**40), y=st.floats(-2.0**45, 2.0**45, allow_nan=False),
       bits=st.sampled_from([16, 24, 32]))
def test_adding_the_rounded_noise_to_an_integer_sum_is_rounding_the_noised_sum(s, y, bits):
    """S + round(y) == floor(S + y + 1/2) on exact rationals, so, mod 2^b, the ring release is
    post-processing of the real-valued S + y for ANY integer lift S of the ring sum."""
    m = 1 << bits
    ring = RingSum(np.array([s % m], dtype=np.uint64), bits, lambda v: v)
    released = int(noisy_ring(ring, round_half_up(np.array([y])))[0])
    assert released == math.floor(Fraction(s) + Fraction(y) + Fraction(1, 2)) % m
    for lift in (s - m, s + 3 * m):  # another lift of the same ring value: the same release
        assert math.floor(Fraction(lift) + Fraction(y) + Fraction(1, 2)) % m == released


def test_numpys_rint_would_break_the_identity_at_ties_and_float_addition_near_them():
    """Why `round_half_up`: ties-to-even does not commute with odd shifts, and fl(y + 1/2) rounds."""
    assert 1 + int(np.rint(1.5)) != int(np.rint(2.5))
    y = np.nextafter(0.5, 0.0)  # 0.49999999999999994
    assert int(np.floor(y + 0.5)) == 1 and int(round_half_up(np.array([y]))[0]) == 0
    assert [int(v) for v in round_half_up(np.array([-2.5, -0.5, 0.5, 1.5, 2.5, -1.2]))] == [
        -2, 0, 1, 2, 3, -1]


def mf_ring_server(plan) -> DPFTRLServer:
    cfg = DPFTRLConfig(noise_multiplier=Z, clip_norm=CLIP, report_goal=1, momentum=0.0,
                       mechanism=SPEC)
    return DPFTRLServer(np.zeros(DIM, np.float32), cfg, noise_key=KEY, ring=plan)


def test_wrap_attack_moves_each_rounds_ring_release_by_the_targets_vector_only():
    """A malicious co-participant parks the others' sum at the wrap in every round; with and
    without the target, each round's released ring value (sum + rint MF noise, mod 2^b) is
    exactly ||q|| <= Delta_s apart, and the server releases the decoding of that value."""
    ring_a, disc, _, q = world(True)
    ring_b, _, _, _ = world(False)
    plan = plan_ring(DIM, CLIP, BITS, 4, Z, rounds=8, block_size=DIM,
                     variance_factor=inverse_variance_factor(SPEC))
    worlds = [RingMFNoise(SPEC, plan.length, KEY, plan.sigma) for _ in range(2)]
    for _ in range(5):
        noise = [w.next_residual() for w in worlds]
        np.testing.assert_array_equal(noise[0], noise[1])  # same key, same position
        assert np.abs(noise[0]).max() > 10 * plan.delta_s / math.sqrt(plan.length)  # real noise
        released = [noisy_ring(r, n) for r, n in zip((ring_a, ring_b), noise, strict=True)]
        moved = ring_distance(released[0], released[1], BITS)
        assert moved == pytest.approx(float(np.linalg.norm(q)), rel=1e-12)
        assert moved <= plan.delta_s
    # the MF server releases exactly the decoding of that ring value (decoding: post-processing;
    # the decoded values may still jump at the wrap, which is why the noise goes in first)
    theta = mf_ring_server(plan).step(ring_a).astype(np.float64)
    first = RingMFNoise(SPEC, plan.length, KEY, plan.sigma).next_residual()
    np.testing.assert_allclose(theta, disc.decode(noisy_ring(ring_a, first)), atol=1e-5)


@settings(deadline=None, max_examples=40)
@given(malicious=hnp.arrays(np.uint32, 64, elements=st.integers(0, 2**32 - 1)),
       x=hnp.arrays(np.float64, 64, elements=st.floats(-1, 1)),
       norm=st.floats(0, 1), position=st.integers(0, 7))
def test_any_malicious_vector_leaves_one_device_within_its_bound_at_any_round(malicious, x, norm,
                                                                             position):
    dim, clip = 64, 0.3
    plan = plan_ring(dim, clip, BITS, 3, Z, rounds=8, block_size=dim,
                     variance_factor=inverse_variance_factor(SPEC))
    disc = Discretizer(dim, clip, BITS, plan.ring_clients, seed=position, block_size=dim)
    if np.linalg.norm(x) > 0:
        x = x * (norm * clip / np.linalg.norm(x))
    q = disc.encode(x, np.random.default_rng(position)).values
    noise = RingMFNoise(SPEC, plan.length, KEY, plan.sigma)
    for _ in range(position):
        noise.next_residual()
    residual = noise.next_residual()
    with_update = RingSum((malicious + q).astype(np.uint32), BITS, disc.decode)
    without = RingSum(malicious, BITS, disc.decode)
    moved = ring_distance(noisy_ring(with_update, residual), noisy_ring(without, residual), BITS)
    assert moved <= disc.rounding_bound == plan.delta_s


def test_headroom_uses_the_strategys_inverse_row_norm():
    """The plan's noise bound is sigma sqrt(2 v ln(...)) + 1/2 with v = max_t ||row_t C^-1||^2,
    which the dense inverse confirms; a larger v needs a larger ring share."""
    inv = np.linalg.inv(strategy(SPEC, SPEC.rounds))
    assert inverse_variance_factor(SPEC) == pytest.approx((inv**2).sum(axis=1).max(), rel=1e-12)
    base = plan_ring(DIM, CLIP, BITS, 4, Z, rounds=8, block_size=DIM, variance_factor=1.0)
    wide = plan_ring(DIM, CLIP, BITS, 4, Z, rounds=8, block_size=DIM, variance_factor=50.0)
    def tail(plan):  # the bound in units of the plan's sigma (its scale moves with ring_clients)
        return (plan.noise_bound - 0.5) / plan.sigma

    assert tail(wide) == pytest.approx(math.sqrt(50) * tail(base), rel=1e-9)
    assert wide.ring_clients > base.ring_clients  # the ring gives the noise more room
    half = (1 << (BITS - 1)) - 1
    for plan in (base, wide):  # 4 clients at level L plus the bound still fit the signed ring
        assert 4 * plan.level + plan.noise_bound <= half


class RingSpy:
    """Each round's ring sum and the integer noise the server added to it (what no output holds)."""

    def __init__(self, monkeypatch):
        self.sums, self.noise = [], []
        real = REAL_NOISY_RING  # never a previous spy: each run's spy sees its own rounds only

        def spy(ring, residual):
            self.sums.append(np.asarray(ring.values).astype(np.int64))
            self.noise.append(np.asarray(residual).copy())
            return real(ring, residual)

        monkeypatch.setattr(ring_noise, "noisy_ring", spy)


def run(tmp_path, monkeypatch, name, values, **kwargs):
    keys = []
    real_key = round_engine.new_noise_key
    monkeypatch.setattr(round_engine, "new_noise_key", lambda: keys.append(real_key()) or keys[-1])
    spy = RingSpy(monkeypatch)
    result = simulation.run_simulation(parse_config(values), tmp_path / name, **QUIET, **kwargs)
    return result, spy, keys


def read_json(path):
    return json.loads(path.read_text())


def dense_ring_noise(key, spec, sigma, length, segment=0, ts=range(1, ROUNDS + 1)):
    return np.linalg.inv(strategy(spec, len(ts))) @ fresh_z(key, sigma, length, segment, ts)


def test_simulate_secagg_blt_adds_rounded_mf_noise_in_the_ring_and_hides_it(tmp_path, monkeypatch,
                                                                            capsys):
    result, spy, (key,) = run(tmp_path, monkeypatch, "ring", secagg())
    path = result.run_dir
    privacy = read_json(path / "privacy.json")
    ring = privacy["ring"]
    sigma = math.sqrt(int(ring["sigma_sq"]))
    assert sigma >= 1.0 * ring["delta_s"]  # z Delta_s in ring units
    spec = MechanismSpec.from_json(read_json(path / "mechanism.json")["spec"])
    noise = np.array(spy.noise, dtype=np.float64)
    assert noise.shape == (ROUNDS, ring["length"]) and spy.noise[0].dtype == np.int64
    expected = dense_ring_noise(key, spec, sigma, ring["length"])
    assert np.abs(noise - expected).max() <= 1.0  # rounded same C^-1 Z (float order aside)
    assert np.mean(noise == round_half_up(expected)) > 0.999
    # accounting: the plain MF figure (ring units cancel: sens Delta_s, noise z Delta_s), PLD
    mins, maxp = privacy["min_separation"], privacy["max_participation"]
    rho = zcdp_from_noise(1.0, ROUNDS, maxp, mins if maxp > 1 else ROUNDS - 1,
                          mechanism=MatrixMechanism(spec))
    assert privacy["zcdp"] == pytest.approx(rho, rel=1e-12)
    assert privacy["epsilon"] == pytest.approx(epsilon_from_zcdp(rho, 1e-6, "pld"), rel=1e-9)
    assert privacy["noise_mechanism"] == RING_MF_MECHANISM and not privacy["honest_participants_only"]
    capsys.readouterr()  # `dpfleet account` of the ring run's own log: the same eps
    main(["account", "-z", "1", "--delta", "1e-6", "--noise", "discrete", "--participation-log",
          str(path / "participation.jsonl"), "--json"])
    accounted = json.loads(capsys.readouterr().out)
    assert accounted["mechanism"] == "blt" and accounted["noise_mechanism"] == RING_MF_MECHANISM
    assert accounted["epsilon"] == pytest.approx(privacy["epsilon"], rel=1e-9)
    report = (path / "privacy_report.md").read_text()
    assert f"**Noise: {RING_MF_MECHANISM}" in report and f"sigma^2 = {ring['sigma_sq']}" in report
    summary = read_json(path / "summary.json")
    assert summary["noise_mechanism"] == RING_MF_MECHANISM
    releases = [json.loads(x) for x in (path / "releases.jsonl").read_text().splitlines()]
    check_no_reuse(releases)
    # secrecy: guesses of the key from the run directory do not rebuild the noise
    total = expected.sum(axis=0)
    guesses = {"research key of the seed": seeded_noise_key(read_json(path / "config.json")["seed"]),
               "sha256 of config.toml": hashlib.sha256((path / "config.toml").read_bytes()).digest(),
               "zero key": bytes(32)}
    for name, guess in guesses.items():
        guessed = dense_ring_noise(guess, spec, sigma, ring["length"]).sum(axis=0)
        assert np.linalg.norm(total - guessed) > 1.2 * np.linalg.norm(total), name
    assert resume_point(path) is None
    vectors = [n.tobytes()[:64] for n in spy.noise] + [
        v.astype(np.float32).tobytes()[:64] for v in fresh_z(key, sigma, ring["length"], 0, range(1, 4))]
    for f in (p for p in path.rglob("*") if p.is_file()):
        data = f.read_bytes()
        assert key not in data and key.hex().encode() not in data, f
        assert not any(v in data for v in vectors), f


@pytest.mark.slow
def test_resume_replays_the_same_z_and_a_restart_draws_a_fresh_key(tmp_path, monkeypatch):
    values = secagg("banded", noise_seed=5)
    reference, ref_spy, _ = run(tmp_path, monkeypatch, "ref", values)
    out = tmp_path / "run"
    with pytest.raises(Crash):  # after round 4: the resume point holds the position only
        run(tmp_path, monkeypatch, "run", values, before_round=crash_before(4))
    assert read_json(resume_point(out) / "server_state.json")["tree"]["t"] == 4
    resumed, spy, _ = run(tmp_path, monkeypatch, "run", values, resume=True)
    np.testing.assert_array_equal(released_theta(resumed.run_dir), released_theta(reference.run_dir))
    for a, b in zip(spy.noise, ref_spy.noise[4:], strict=True):  # rounds 5, 6: the same z_t
        np.testing.assert_array_equal(a, b)
    releases = [json.loads(x) for x in (out / "releases.jsonl").read_text().splitlines()]
    check_no_reuse(releases)
    assert [(r["tree_id"], r["t"]) for r in releases] == [(0, t) for t in range(1, ROUNDS + 1)]
    # without resume (secret keys): each run its own key, so independent noise at every position
    first, a, keys_a = run(tmp_path, monkeypatch, "fresh_a", secagg("banded"))
    second, b, keys_b = run(tmp_path, monkeypatch, "fresh_b", secagg("banded"))
    assert keys_a != keys_b
    na, nb = np.array(a.noise, np.float64), np.array(b.noise, np.float64)
    corr = (na * nb).sum() / (np.linalg.norm(na) * np.linalg.norm(nb))
    assert abs(corr) < 0.01  # independent draws (~N(0, 1 / sqrt(6 * 37472)))


def test_ring_release_decodes_to_the_plain_mf_release_up_to_quantization():
    """Same sums, same key: decoded ring release minus the true sum has per-round variance
    (sigma / s)^2 ||row_t C^-1||^2 like the plain path's (z C)^2 ||row_t C^-1||^2 (chi-square
    bounds over d coordinates), and the signal decodes to the true sum within the quantization
    bound."""
    dim, clip, clients, rounds = 4096, 0.5, 4, 8
    spec = optimize_mechanism("blt", rounds, 1, 2)
    plan = plan_ring(dim, clip, BITS, clients, Z, rounds=rounds, block_size=dim,
                     variance_factor=inverse_variance_factor(spec))
    disc = Discretizer(dim, clip, BITS, plan.ring_clients, seed=1, block_size=dim)
    cfg = DPFTRLConfig(noise_multiplier=Z, clip_norm=clip, report_goal=1, momentum=0.0,
                       mechanism=spec)
    ring_server = DPFTRLServer(np.zeros(dim, np.float32), cfg, noise_key=KEY, ring=plan)
    plain_server = DPFTRLServer(np.zeros(dim, np.float32), cfg, noise_key=KEY)
    inv = np.linalg.inv(strategy(spec, rounds))
    rows = (inv**2).sum(axis=1)
    rng = np.random.default_rng(0)
    low, high = (1 - 6 / math.sqrt(dim / 2)), (1 + 6 / math.sqrt(dim / 2))  # ~6 sigma of chi^2_d / d
    for t in range(rounds):
        xs = [rng.normal(size=dim) for _ in range(clients)]
        xs = [clip * x / np.linalg.norm(x) for x in xs]
        true = np.sum(xs, axis=0)
        enc = [disc.encode(x, np.random.default_rng([t, i])).values.astype(np.int64)
               for i, x in enumerate(xs)]
        ring = RingSum((np.sum(enc, axis=0) % (1 << BITS)).astype(np.uint32), BITS, disc.decode)
        assert np.linalg.norm(disc.decode(ring.values) - true) <= disc.quantization_bound(clients)
        before = [ring_server.theta.astype(np.float64), plain_server.theta.astype(np.float64)]
        ring_noise_t = ring_server.step(ring).astype(np.float64) - before[0] - disc.decode(ring.values)
        plain_noise_t = plain_server.step(true).astype(np.float64) - before[1] - true
        for noise, std in ((ring_noise_t, plan.sigma / disc.scale), (plain_noise_t, Z * clip)):
            ratio = float(noise @ noise) / (dim * std**2 * rows[t])
            assert low < ratio < high, (t, ratio)
        # the two paths' noise scales agree up to the ring's rounding-bound inflation
        assert plan.sigma / disc.scale == pytest.approx(Z * clip, rel=1e-3)


def test_auto_mechanism_may_pick_mf_with_secagg_and_adaptive_clipping_but_not_with_restarts():
    from dpfleet.coordinator.accounting.planner import candidates

    assert candidates("auto") == ("tree", "banded", "blt")  # independent is never the least noise
    assert candidates("auto", restarts=True) == ("tree",)
    assert candidates("banded") == ("tree", "banded")
