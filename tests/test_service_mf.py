"""`dpfleet service serve` with matrix-factorization noise (dp.mechanism banded / blt), over
loopback with a tiny fleet: the served run is `simulate`'s bit for bit (plain aggregation); with
signed SecAgg and adaptive clipping each round's ring sum gets exactly the rounded MF stream of the
run's key (`mf_ring`, spied in the ring) and the clip norm follows the estimate; killed with
SIGKILL after a commit and restarted, the run continues the same noise segment (position replayed
from the key in the state store, no position released twice) and its epsilon is a fresh MF
account of the committed log."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from service_fleet import tiny_cfg
from test_service_kill import kill_and_restart
from test_service_parity import lines, run_service
from test_service_secagg import SECAGG, check_sums, secagg_cfg, serve_with_devices

import dpfleet.coordinator.mechanisms.ring_noise as ring_noise
from dpfleet.coordinator.accounting.privacy_report import RING_MF_MECHANISM
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.mechanisms.matrix import MatrixMechanism
from dpfleet.coordinator.mechanisms.mf_ring import RingMFNoise
from dpfleet.coordinator.mechanisms.noise_stream import seeded_noise_key
from dpfleet.coordinator.mechanisms.spec import MechanismSpec
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant
from dpfleet.coordinator.state.release_log import check_no_reuse
from dpfleet.coordinator.state.state_store import StateStore


def read_json(path):
    return json.loads(path.read_text())


@pytest.mark.slow
def test_a_served_blt_run_is_the_simulation_bit_for_bit(tmp_path):
    cfg = tiny_cfg(dp={"mechanism": "blt"}, service={"report_deadline_s": 60.0})
    sim = run_simulation(cfg, tmp_path / "sim", progress=False, log=lambda s: None)
    status, _ = run_service(cfg, tmp_path)
    state = tmp_path / "state"
    assert status["run_state"] == "finished" and status["rounds_committed"] == cfg.rounds
    assert read_json(state / "mechanism.json") == read_json(tmp_path / "sim" / "mechanism.json")
    assert lines(state / "participation.jsonl") == lines(tmp_path / "sim" / "participation.jsonl")
    for a, b in zip(lines(state / "metrics.jsonl"), sim.metrics, strict=True):
        for key in ("round", "clients", "noise_std", "epsilon", "zcdp", "accuracy", "loss"):
            assert a[key] == b[key], key
    ours = load_file(state / "checkpoint" / "model.safetensors")
    theirs = load_file(tmp_path / "sim" / "checkpoint" / "model.safetensors")
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
    privacy = read_json(state / "privacy.json")
    assert privacy["epsilon"] == sim.privacy["epsilon"] and privacy["mechanism"] == "blt"


def test_served_secagg_blt_with_adaptive_clipping_adds_the_rounded_stream_in_the_ring(tmp_path,
                                                                                      monkeypatch):
    residuals = []
    real = ring_noise.noisy_ring

    def spy(ring, residual):
        residuals.append(np.asarray(residual).copy())
        return real(ring, residual)

    monkeypatch.setattr(ring_noise, "noisy_ring", spy)
    cfg = secagg_cfg(rounds=2, dp={"mechanism": "blt", "adaptive_clipping": True,
                                   "clip_count_stddev": 1.0},
                     service={**SECAGG["service"], "report_deadline_s": 30.0})
    users, sums, outcomes, history, releases = serve_with_devices(cfg, tmp_path)
    state = tmp_path / "state"
    assert [h["status"] for h in history] == ["committed", "committed"]
    check_sums(sums, outcomes)  # each sum is its survivors' clipped updates (quantization bound)
    privacy = read_json(state / "privacy.json")
    ring = privacy["ring"]
    spec = MechanismSpec.from_json(read_json(state / "mechanism.json")["spec"])
    sigma = float(int(ring["sigma_sq"])) ** 0.5
    stream = RingMFNoise(spec, ring["length"], seeded_noise_key(cfg.dp.noise_seed), sigma)
    assert len(residuals) == 2
    for got in residuals:  # exactly the run's (segment 0, t) stream, in ring units
        np.testing.assert_array_equal(got, stream.next_residual())
    assert float(np.abs(residuals[0]).max()) > 3 * sigma  # ring-sized noise, not decoded units
    assert [(r["tree_id"], r["t"]) for r in releases] == [(0, 1), (0, 2)]
    metrics = lines(state / "metrics.jsonl")
    assert releases[0]["clip_norm"] == cfg.dp.clip_norm
    assert releases[1]["clip_norm"] == pytest.approx(metrics[0]["clip_estimate"], rel=1e-12)
    assert releases[1]["clip_norm"] != cfg.dp.clip_norm  # adopted every round, no restart
    assert privacy["noise_mechanism"] == RING_MF_MECHANISM and not privacy["honest_participants_only"]


@pytest.mark.slow  # ~13 s; kill -9 of the tree run stays in the default suite (test_service_kill)
def test_kill_9_after_a_commit_then_the_mf_run_continues_its_segment(tmp_path):
    cfg, codes = kill_and_restart(tmp_path, ["after_commit:1"], rounds=3,
                                  dp={"mechanism": "banded"})
    assert codes == [-9, 0]
    state = tmp_path / "state"
    store = StateStore(state, cfg.resolved())
    try:
        releases = store.releases()
    finally:
        store.close()
    check_no_reuse(releases)
    assert [(r["round"], r["tree_id"], r["t"]) for r in releases] == [(1, 0, 1), (2, 0, 2), (3, 0, 3)]
    spec = MechanismSpec.from_json(read_json(state / "mechanism.json")["spec"])
    fresh = RunAccountant(cfg.dp.noise_multiplier, cfg.dp.delta, mechanism=MatrixMechanism(spec))
    for r in releases:
        spent = fresh.record(r["participants"], r["restart"])
    assert lines(state / "metrics.jsonl")[-1]["zcdp"] == pytest.approx(spent["zcdp"], rel=1e-12)
    assert read_json(state / "privacy.json")["zcdp"] == pytest.approx(spent["zcdp"], rel=1e-12)
    assert not any(p.name == "noise_key" for p in state.rglob("*"))  # gone with the finished run

