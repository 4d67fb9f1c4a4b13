"""End to end: `dp.noise = "discrete"` with secure aggregation. The released model differs from
the noiseless one by exactly the node noise's std (in the round's sum, z * sensitivity), the
privacy report converts zCDP by RDP (not the Gaussian's PLD), and a resume is refused."""

import json

import numpy as np
import pytest
from crashes import Crash
from node_stream_standin import standin_streams
from safetensors.numpy import load_file

from dpfleet.coordinator import ring_noise
from dpfleet.coordinator.accounting import epsilon_from_zcdp
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.simulation import run_simulation
from dpfleet.errors import DpfleetError

CFG = {
    "rounds": 1, "eval_every": 1, "seed": 5, "checkpoint_every": 0,
    "data": {"dataset": "shakespeare", "max_clients": 40, "eval_examples": 100, "max_examples": 16},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"lr": 1.0, "batch_size": 16},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 5, "momentum": 0.0,
           "noise": "discrete"},
    "aggregation": {"kind": "secagg", "graph": "complete"},
}
QUIET = {"progress": False, "log": lambda s: None}


def model(run_dir):
    weights = load_file(str(run_dir / "checkpoint" / "model.safetensors"))
    return np.concatenate([weights[k].ravel().astype(np.float64) for k in sorted(weights)])


@pytest.fixture(autouse=True)
def standin_noise_key(monkeypatch):
    """noise_stream.NodeStream comes with the noise branch; until then the test-only stand-in."""
    monkeypatch.setattr(ring_noise, "node_streams", standin_streams)


def test_discrete_release_is_noiseless_model_plus_node_noise(tmp_path):
    noisy = run_simulation(parse_config(CFG), tmp_path / "d", **QUIET)
    clean_cfg = json.loads(json.dumps(CFG))
    clean_cfg["dp"].update(noise="gaussian", noise_multiplier=0.0)
    clean = run_simulation(parse_config(clean_cfg), tmp_path / "c", **QUIET)
    diff = model(noisy.run_dir) - model(clean.run_dir)
    record = noisy.metrics[0]
    assert record["noise_std"] == pytest.approx(1.0 * 0.5, rel=1e-6)  # z C, inflation ~1e-7
    expected = record["noise_std"] / 5  # server_lr 1, momentum 0: theta1 - theta0 = noisy sum / m
    assert diff.std() == pytest.approx(expected, rel=0.03)
    assert abs(diff.mean()) < 5 * expected / np.sqrt(diff.size)
    # a second run of the same config draws another key: independent noise
    again = run_simulation(parse_config(CFG), tmp_path / "e", **QUIET)
    other = model(again.run_dir) - model(clean.run_dir)
    assert np.corrcoef(diff, other)[0, 1] < 0.05

    privacy = json.loads((noisy.run_dir / "privacy.json").read_text())
    assert privacy["epsilon"] == pytest.approx(epsilon_from_zcdp(privacy["zcdp"], 1e-6, "rdp"))
    assert privacy["epsilon"] > epsilon_from_zcdp(privacy["zcdp"], 1e-6, "pld")  # no PLD shortcut
    report = (noisy.run_dir / "privacy_report.md").read_text()
    assert "discrete Gaussian" in report and "RDP" in report


def test_discrete_noise_refuses_resume(tmp_path):
    def crash(r, theta):
        raise Crash

    with pytest.raises(Crash):  # interrupted before its only round: a resumable run directory
        run_simulation(parse_config(CFG), tmp_path / "d", before_round=crash, **QUIET)
    with pytest.raises(DpfleetError, match="not supported yet"):
        run_simulation(parse_config(CFG), tmp_path / "d", resume=True, **QUIET)
