"""End to end: `dp.noise = "discrete"` with secure aggregation. The released model differs from
the noiseless one by exactly the node noise's std (in the round's sum, z * sensitivity), the
privacy report converts zCDP by RDP (not the Gaussian's PLD), and a resume continues on the same
secret key without ever releasing a tree position twice."""

import json

import numpy as np
import pytest
from crashes import Crash
from safetensors.numpy import load_file

from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.state.release_log import ReleaseLog, check_no_reuse

CFG = {
    "rounds": 1, "eval_every": 1, "seed": 5, "checkpoint_every": 0,
    "data": {"dataset": "shakespeare", "max_clients": 40, "eval_examples": 100, "max_examples": 16,
             "keyboard_words": 0},  # no keyboard metrics: seconds a run, read by none
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


def test_discrete_noise_resumes_on_its_key_and_never_reuses_a_node(tmp_path):
    cfg = json.loads(json.dumps(CFG))
    cfg.update(rounds=3, eval_every=3, checkpoint_every=1)

    def crash_before_round_3(r, theta):
        if r == 2:
            raise Crash

    with pytest.raises(Crash):  # two rounds released, a resume point after each
        run_simulation(parse_config(cfg), tmp_path / "d", before_round=crash_before_round_3, **QUIET)
    key = (tmp_path / "d" / "resume" / "noise_key").read_bytes()
    resumed = run_simulation(parse_config(cfg), tmp_path / "d", resume=True, **QUIET)
    releases = ReleaseLog(tmp_path / "d" / "releases.jsonl").released_rounds()
    assert [r["round"] for r in releases] == [1, 2, 3] and len(resumed.metrics) == 3
    assert len({r["key_id"] for r in releases}) == 1  # the resumed rounds used the saved key
    check_no_reuse(releases)  # every (key, tree, position) released once
    assert key not in b"".join(p.read_bytes() for p in (tmp_path / "d").rglob("*") if p.is_file())
    # the published checkpoint holds the model and momentum, no integer noise node to subtract
    published = load_file(str(tmp_path / "d" / "checkpoint" / "server_state.safetensors"))
    assert set(published) == {"theta", "momentum"}
    assert not (tmp_path / "d" / "resume").exists()
