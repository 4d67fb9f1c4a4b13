"""`dpfleet simulate` with matrix-factorization noise (dp.mechanism "banded" / "blt", mf_noise.py).

Every test scores ON THE VALUE: a spy on the DP-FTRL server learns the true round sums and the model
before / after each step, so the noise the server added is known exactly and compared with the dense
C^{-1} Z of the strategy and the key (correctness), with guesses built from the run directory
(secrecy), across a crash and resume (no position reused), and the accounting with the observed
participation (also when the coordinator's guard is switched off: the lie is paid for)."""

import functools
import hashlib
import json
import os

import numpy as np
import pytest
from crashes import Crash
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file
from test_noise_secrecy import CFG as SECRECY_CFG
from test_noise_secrecy import QUIET

import dpfleet.coordinator.engine.round_engine as round_engine
from dpfleet.cli import main
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_from_noise
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine import simulation
from dpfleet.coordinator.engine.dp_ftrl import DPFTRLServer
from dpfleet.coordinator.engine.participation import ParticipationGuard
from dpfleet.coordinator.mechanisms.blt import banded_toeplitz_matrix
from dpfleet.coordinator.mechanisms.matrix import MatrixMechanism
from dpfleet.coordinator.mechanisms.mf_noise import MF_DOMAIN
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes, key_id, seeded_noise_key
from dpfleet.coordinator.mechanisms.spec import MechanismSpec, optimize_mechanism
from dpfleet.coordinator.serve_plan import check_service_config
from dpfleet.coordinator.state.release_log import check_no_reuse
from dpfleet.coordinator.state.resume import resume_point
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.errors import DpfleetError

ROUNDS, M = 6, 4
# the secrecy tests' tiny run (momentum 0, server lr 1: theta_t - theta_{t-1} = (round sum + round
# noise) / m), longer and with devices taking part twice, at least one round apart
CFG = {**SECRECY_CFG, "rounds": ROUNDS, "eval_every": ROUNDS,
       "participation": {"mode": "uniform", "min_separation": 1, "max_participation": 2}}
assert CFG["dp"]["report_goal"] == M and CFG["dp"]["momentum"] == 0


def mf_zcdp(spec: MechanismSpec, z: float, mins: int, maxp: int) -> float:
    """The accountant's worst-case rho of the matrix mechanism `spec` (the one zCDP rule)."""
    return zcdp_from_noise(z, spec.rounds, maxp, mins, mechanism=MatrixMechanism(spec))



def config(kind, **dp):
    return dict(CFG, dp=dict(CFG["dp"], mechanism=kind, **dp))


def spied_run(tmp_path, monkeypatch, name, values, **kwargs):
    """A run plus what only the server knew: each round's true sum and added noise, and the key."""
    sums, noises, keys = [], [], []
    real_step, real_key = DPFTRLServer.step, round_engine.new_noise_key

    def step(self, delta_sum):
        before = self.theta.astype(np.float64)
        sums.append(np.asarray(delta_sum, dtype=np.float64).copy())
        theta = real_step(self, delta_sum)
        noises.append((theta.astype(np.float64) - before) * M - sums[-1])
        return theta

    monkeypatch.setattr(DPFTRLServer, "step", step)
    monkeypatch.setattr(round_engine, "new_noise_key", lambda: keys.append(real_key()) or keys[-1])
    try:
        result = simulation.run_simulation(parse_config(values), tmp_path / name, **QUIET, **kwargs)
    finally:
        monkeypatch.setattr(DPFTRLServer, "step", real_step)
        monkeypatch.setattr(round_engine, "new_noise_key", real_key)
    return result, np.array(sums), np.array(noises), keys


def strategy(spec: MechanismSpec, n: int) -> np.ndarray:
    if spec.kind == "blt":
        return spec.blt().matrix(n)
    return banded_toeplitz_matrix(np.asarray(spec.coefficients), n)


def fresh_z(key: bytes, std: float, dim: int, segment: int, ts) -> np.ndarray:
    z = GaussianNodes(key, std, dim, MF_DOMAIN)
    return np.array([z(segment, 0, t) for t in ts], dtype=np.float64)


def observed(run_dir) -> tuple[int | None, int]:
    """MinS / MaxP counted directly from participation.jsonl."""
    last, count, mins = {}, {}, None
    for line in (run_dir / "participation.jsonl").read_text().splitlines():
        entry = json.loads(line)
        for d in entry["devices"]:
            if d in last:
                gap = entry["round"] - last[d] - 1
                mins = gap if mins is None else min(mins, gap)
            last[d], count[d] = entry["round"], count.get(d, 0) + 1
    return mins, max(count.values())


def read_json(path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_noise_is_the_dense_c_inverse_z_and_eps_is_the_mechanisms_zcdp(tmp_path, monkeypatch, kind):
    run, _, noises, (key,) = spied_run(tmp_path, monkeypatch, kind, config(kind))
    path = run.run_dir
    saved = read_json(path / "mechanism.json")
    spec = MechanismSpec.from_json(saved["spec"])
    assert spec == optimize_mechanism(kind, ROUNDS, 1, 2)  # optimised for the enforced MinS / MaxP
    assert saved["optimised_for"] == {"min_separation": 1, "max_participation": 2,
                                      "participation": "uniform"}
    std = run.metrics[-1]["noise_std"]
    assert std == pytest.approx(1.0 * 0.5)
    z = fresh_z(key, std, noises.shape[1], 0, range(1, ROUNDS + 1))
    expected = np.linalg.inv(strategy(spec, ROUNDS)) @ z  # (C^{-1} Z)_t, dense
    assert np.abs(noises - expected).max() < 1e-4 * np.abs(expected).max()
    # the released prefix sums carry B z = A C^{-1} z: the model noise is its last row
    assert np.allclose(noises.sum(axis=0), expected.sum(axis=0), atol=1e-4)
    assert not np.allclose(noises, z, atol=0.1)  # correlated, not independent per-round noise

    privacy = read_json(path / "privacy.json")
    mins, maxp = observed(path)
    assert (privacy["min_separation"], privacy["max_participation"]) == (mins, maxp)
    rho = mf_zcdp(spec, 1.0, mins if maxp > 1 else ROUNDS - 1, maxp)
    assert privacy["zcdp"] == pytest.approx(rho, rel=1e-12)
    assert privacy["epsilon"] == pytest.approx(epsilon_from_zcdp(rho, 1e-6, "pld"), rel=1e-9)
    assert privacy["mechanism"] == kind and privacy["mechanism_spec"] == spec.to_json()
    assert privacy["noise_segments"] == 1
    report = (path / "privacy_report.md").read_text()
    assert f"| mechanism | {kind} |" in report and f"eps = {privacy['epsilon']:.4g}" in report
    releases = [json.loads(x) for x in (path / "releases.jsonl").read_text().splitlines()]
    check_no_reuse(releases)
    assert [(r["tree_id"], r["t"], r["mechanism"], r["nodes"]) for r in releases] == [
        (0, t, kind, []) for t in range(1, ROUNDS + 1)]


def test_disjoint_participation_is_optimised_for_one_participation(tmp_path, monkeypatch):
    values = dict(config("banded"), participation={"mode": "disjoint"})
    run, _, _, _ = spied_run(tmp_path, monkeypatch, "disjoint", values)
    saved = read_json(run.run_dir / "mechanism.json")
    assert saved["optimised_for"]["max_participation"] == 1
    assert saved["spec"]["bands"] == ROUNDS  # MaxP 1: every separation holds, all n bands usable
    privacy = read_json(run.run_dir / "privacy.json")
    spec = MechanismSpec.from_json(saved["spec"])
    assert privacy["max_participation"] == 1
    assert privacy["zcdp"] == pytest.approx(mf_zcdp(spec, 1.0, ROUNDS - 1, 1))


def released_theta(run_dir):
    return load_file(str(run_dir / "checkpoint" / "server_state.safetensors"))["theta"]


def test_noise_cannot_be_rebuilt_from_the_run_directory(tmp_path, monkeypatch):
    run, sums, noises, (key,) = spied_run(tmp_path, monkeypatch, "secret", config("blt"))
    path, dim = run.run_dir, noises.shape[1]
    spec = MechanismSpec.from_json(read_json(path / "mechanism.json")["spec"])
    std, seed = run.metrics[-1]["noise_std"], read_json(path / "config.json")["seed"]
    true_noise = noises.sum(axis=0)  # the model's noise (times m)
    inv = np.linalg.inv(strategy(spec, ROUNDS))

    def model_noise(k: bytes) -> np.ndarray:
        return (inv @ fresh_z(k, std, dim, 0, range(1, ROUNDS + 1))).sum(axis=0)

    guesses = {
        "research key of config seed": seeded_noise_key(seed),
        "sha256 of config.toml": hashlib.sha256((path / "config.toml").read_bytes()).digest(),
        "sha256 of mechanism.json": hashlib.sha256((path / "mechanism.json").read_bytes()).digest(),
        "zero key": bytes(32),
    }
    for name, guess in guesses.items():
        error = np.linalg.norm(true_noise - model_noise(guess))
        assert error > 1.2 * np.linalg.norm(true_noise), name  # an independent noise is added
    assert np.linalg.norm(true_noise - model_noise(key)) < 1e-3 * np.linalg.norm(true_noise)
    # nothing in the finished run directory holds the key or any z_t / noise vector
    assert resume_point(path) is None
    vectors = [v.astype(np.float32).tobytes()[:64] for v in fresh_z(key, std, dim, 0, range(1, ROUNDS + 1))]
    vectors += [n.astype(np.float32).tobytes()[:64] for n in noises]
    for f in (p for p in path.rglob("*") if p.is_file()):
        data = f.read_bytes()
        assert key not in data and key.hex().encode() not in data, f
        assert not any(v in data for v in vectors), f
    assert set(load_file(str(path / "checkpoint" / "server_state.safetensors"))) == {"theta", "momentum"}


def test_research_mode_rebuilds_the_noise_so_the_attack_is_real(tmp_path, monkeypatch):
    run, _, noises, keys = spied_run(tmp_path, monkeypatch, "research", config("banded", noise_seed=3))
    assert keys == []
    spec = MechanismSpec.from_json(read_json(run.run_dir / "mechanism.json")["spec"])
    z = fresh_z(seeded_noise_key(3), run.metrics[-1]["noise_std"], noises.shape[1], 0, range(1, ROUNDS + 1))
    guess = np.linalg.inv(strategy(spec, ROUNDS)) @ z
    assert np.abs(noises - guess).max() < 1e-4 * np.abs(guess).max()
    report = (run.run_dir / "privacy_report.md").read_text()
    assert report.startswith("**NOT FULLY PRIVATE: research mode (dp.noise_seed = 3)")
    assert "does NOT hold against anyone who knows the noise seed" in report[:report.index("# Privacy")]


def crash_before(round_idx):
    def hook(r, theta):
        if r == round_idx:
            raise Crash
    return hook


@pytest.mark.parametrize("kind", ["banded", "blt"])
@pytest.mark.slow
def test_resume_rebuilds_the_stream_from_the_key_bit_for_bit(tmp_path, monkeypatch, kind):
    values = config(kind, noise_seed=5)
    reference = simulation.run_simulation(parse_config(values), tmp_path / "ref", **QUIET)
    out = tmp_path / "run"
    with pytest.raises(Crash):  # after round 4: the resume point of round 4 holds everything
        simulation.run_simulation(parse_config(values), out, before_round=crash_before(4), **QUIET)
    point = resume_point(out)
    assert set(load_file(str(point / "server_state.safetensors"))) == {"theta", "momentum"}
    assert read_json(point / "server_state.json")["tree"]["t"] == 4  # position only, no vector
    assert os.stat(point / "noise_key").st_mode & 0o777 == 0o600
    resumed = simulation.run_simulation(parse_config(values), out, resume=True, **QUIET)
    np.testing.assert_array_equal(released_theta(resumed.run_dir), released_theta(reference.run_dir))
    eps = [read_json(p / "privacy.json")["epsilon"] for p in (out, tmp_path / "ref")]
    assert eps[0] == eps[1]


def test_crash_that_loses_released_rounds_goes_on_in_a_fresh_segment_and_pays_for_both(tmp_path, monkeypatch):
    values = config("blt")
    out = tmp_path / "run"
    real_step = DPFTRLServer.step
    noises, keys = [], []
    real_key = round_engine.new_noise_key
    monkeypatch.setattr(round_engine, "new_noise_key", lambda: keys.append(real_key()) or keys[-1])

    def step(self, delta_sum):  # crash right after round 3 is released (resume point: round 2)
        before = self.theta.astype(np.float64)
        theta = real_step(self, delta_sum)
        noises.append(((theta.astype(np.float64) - before) * M - np.asarray(delta_sum, np.float64),
                       self.tree.tree_id, self.tree.t))
        return theta

    monkeypatch.setattr(DPFTRLServer, "step", step)
    with pytest.raises(Crash):
        simulation.run_simulation(parse_config(values), out, before_round=crash_before(3), **QUIET)
    resumed = simulation.run_simulation(parse_config(values), out, resume=True, **QUIET)
    assert resumed.metrics[-1]["round"] == ROUNDS
    releases = [json.loads(x) for x in (out / "releases.jsonl").read_text().splitlines()]
    check_no_reuse(releases)
    assert [(r["round"], r["tree_id"], r["t"]) for r in releases] == [
        (1, 0, 1), (2, 0, 2), (3, 0, 3), (4, 1, 1), (5, 1, 2), (6, 1, 3)]
    # the noise each release carried is its own position's: segment 1 restarts from fresh z
    key = keys[0]  # the resumed engine drew a key too, then restored the run's
    assert {r["key_id"] for r in releases} == {key_id(key)}
    spec = MechanismSpec.from_json(read_json(out / "mechanism.json")["spec"])
    inv, std = np.linalg.inv(strategy(spec, 3)), resumed.metrics[-1]["noise_std"]
    dim = noises[0][0].size
    for segment, rows in ((0, noises[:3]), (1, noises[3:])):
        assert [(s, t) for _, s, t in rows] == [(segment, t) for t in (1, 2, 3)]
        expected = inv @ fresh_z(key, std, dim, segment, (1, 2, 3))
        assert np.abs(np.array([n for n, _, _ in rows]) - expected).max() < 1e-4 * np.abs(expected).max()
    privacy = read_json(out / "privacy.json")
    assert privacy["rounds"] == ROUNDS and privacy["noise_segments"] == 2
    mins, maxp = observed(out)
    rho = 2 * mf_zcdp(spec, 1.0, mins if maxp > 1 else ROUNDS - 1, maxp)
    assert privacy["zcdp"] == pytest.approx(rho, rel=1e-12)
    assert resume_point(out) is None


def test_a_coordinator_that_breaks_min_separation_is_accounted_with_the_true_one(tmp_path, monkeypatch):
    """The config claims MinS 3 / MaxP 2; a coordinator with its guard off selects anyone.
    The strategy was optimised for MinS 3, but the accounting uses what happened."""
    values = dict(config("blt"), participation={"mode": "uniform", "min_separation": 3,
                                                 "max_participation": 2})
    values["data"] = dict(CFG["data"], max_clients=6)
    monkeypatch.setattr(ParticipationGuard, "allows",
                        lambda self, devices, r: np.ones(self.last[devices].shape, dtype=bool))
    run, _, _, _ = spied_run(tmp_path, monkeypatch, "lie", values)
    spec = MechanismSpec.from_json(read_json(run.run_dir / "mechanism.json")["spec"])
    assert read_json(run.run_dir / "mechanism.json")["optimised_for"]["min_separation"] == 3
    privacy = read_json(run.run_dir / "privacy.json")
    mins, maxp = observed(run.run_dir)
    assert mins < 3 and maxp > 2  # the lie happened
    assert (privacy["min_separation"], privacy["max_participation"]) == (mins, maxp)
    assert privacy["zcdp"] == pytest.approx(mf_zcdp(spec, 1.0, mins, maxp), rel=1e-12)
    claimed = mf_zcdp(spec, 1.0, 3, 2)
    assert privacy["zcdp"] > 1.5 * claimed  # paid for, not the claimed figure
    assert privacy["timer_worst_case"]["zcdp"] == pytest.approx(claimed)


@pytest.mark.parametrize("extra, message", [
    ({"dp": {"restart_rounds": [3]}}, "dp.restart_rounds must be empty"),
])
def test_unsupported_combinations_are_refused(extra, message):
    values = config("blt")
    for section, entries in extra.items():
        values[section] = dict(values.get(section, {}), **entries)
    with pytest.raises(DpfleetError, match=message):
        parse_config(values)
    values["dp"]["mechanism"] = "tree"
    parse_config(values)  # the tree takes them


def test_unknown_mechanism_is_refused_and_the_service_takes_each():
    with pytest.raises(DpfleetError, match="dp.mechanism' must be one of"):
        parse_config(config("bandedd"))
    assert parse_config({}).dp.mechanism == "tree"
    for kind in ("tree", "banded", "blt"):  # the service runs every mechanism (test_service_mf)
        check_service_config(parse_config(config(kind)))


def test_budget_stops_before_the_round_that_would_pass_it(tmp_path, monkeypatch):
    """The budget check asks the strategy's accountant, before the round, with its devices."""
    spec = optimize_mechanism("blt", ROUNDS, 1, 2)
    eps_one = epsilon_from_zcdp(mf_zcdp(spec, 1.0, ROUNDS - 1, 1), 1e-6, "pld")
    eps_two = epsilon_from_zcdp(mf_zcdp(spec, 1.0, 1, 2), 1e-6, "pld")
    budget = (eps_one + eps_two) / 2  # every device's first round fits, no second one does
    run, _, _, _ = spied_run(tmp_path, monkeypatch, "budget", config("blt", budget_epsilon=budget))
    privacy = read_json(run.run_dir / "privacy.json")
    assert run.stopped_early and "privacy budget" in run.stopped_early
    assert privacy["max_participation"] == 1 and privacy["epsilon"] <= budget
    assert privacy["epsilon"] == pytest.approx(eps_one)


def test_cli_refusal_is_one_error_line(tmp_path, capsys):
    values = parse_config(dict(config("tree"), dp=dict(CFG["dp"], restart_rounds=[3]))).resolved()
    values["dp"]["mechanism"] = "banded"
    path = tmp_path / "restart_banded.toml"
    path.write_text(to_toml(values))
    with pytest.raises(SystemExit) as exc:
        main(["simulate", str(path), "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("error: dp.mechanism = 'banded'")
    assert not (tmp_path / "run").exists()


def test_a_run_saved_before_dp_mechanism_existed_resumes_as_the_tree():
    from dpfleet.coordinator.state.resume import differing_keys

    resolved = parse_config(config("tree")).resolved()
    saved = json.loads(json.dumps(resolved))
    del saved["dp"]["mechanism"]
    assert differing_keys(saved, resolved) == []
    assert differing_keys(saved, parse_config(config("blt")).resolved()) == ["dp"]


@functools.cache
def _optimized(kind: str, n: int) -> MechanismSpec:
    """One optimisation per (kind, rounds): BLT's was most of the property below's time, and the
    property is about the stream's position and key, which every example draws afresh."""
    return optimize_mechanism(kind, n, 1, None)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["banded", "blt"]), n=st.sampled_from([2, 7, 12]), cut=st.integers(0, 12),
       segment=st.integers(0, 3), key=st.binary(min_size=32, max_size=32))
def test_a_stream_rebuilt_from_its_position_continues_exactly(kind, n, cut, segment, key):
    """Resume keeps only (segment, t) and the key: the replayed stream must go on bit for bit, and
    its z must be its own position's (not the tree's domain, not another segment's)."""
    from dpfleet.coordinator.mechanisms.mf_noise import MFNoise

    cut = min(cut, n)
    spec = _optimized(kind, n)
    whole = MFNoise(spec, 5, key, 0.3, segment)
    outputs = [whole.next_residual() for _ in range(n)]
    part = MFNoise(spec, 5, key, 0.3, segment)
    for _ in range(cut):
        part.next_residual()
    rebuilt = MFNoise.from_state(json.loads(json.dumps(part.state_dict())), spec, key, 0.3)
    assert rebuilt.t == cut and set(rebuilt.state_dict()) == {"dim", "tree_id", "t", "mechanism"}
    for t in range(cut, n):
        np.testing.assert_array_equal(rebuilt.next_residual(), outputs[t])
    z = whole.fresh(1)
    assert not np.array_equal(z, GaussianNodes(key, 0.3, 5)(segment, 0, 1))  # the tree's domain
    assert not np.array_equal(z, MFNoise(spec, 5, key, 0.3, segment + 1).fresh(1))
    with pytest.raises(DpfleetError, match="covers"):
        whole.next_residual()  # a strategy never runs past its rounds
