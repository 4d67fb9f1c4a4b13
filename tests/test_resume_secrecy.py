"""A resume point holds no noise: what an interrupted run leaves on disk, read without the run's
noise key, must not give the clipped sum of the clients' updates back.

The attack (as another local user would run it): with momentum 0 the released model after t
rounds is theta_0 + lr / n * (sum of clipped updates + tree noise of [1, t]); theta_0 is rebuilt
from config.json, and a resume point that held the live tree nodes (their sum IS the noise of
[1, t]) gave the clipped sum back to float precision. Adaptive clipping's clipped-count tree and
the noised count prefix are the same attack on the clipped counts. Now the resume point holds the
tree's positions only and a resume rebuilds the nodes from the key (bit for bit: test_resume.py).
"""

import json
import os
import stat

import numpy as np
import pytest
from crashes import Crash
from safetensors.numpy import load_file

from dpfleet.cli import main
from dpfleet.coordinator.accounting.zcdp import model_noise_multiplier
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.coordinator.mechanisms.tree import TreeMechanism
from dpfleet.coordinator.mechanisms.tree_noise import prefix_nodes
from dpfleet.coordinator.state.run_dir import to_toml

CFG = {
    "rounds": 6, "eval_every": 6, "seed": 3, "checkpoint_every": 3,
    "data": {"dataset": "shakespeare", "max_clients": 10, "eval_examples": 60, "max_examples": 8,
             "keyboard_words": 0},  # no keyboard metrics: seconds a run, read by none
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 16, "projection_dim": 8},
    "client": {"lr": 1.0, "batch_size": 8},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 3, "momentum": 0.0,
           "adaptive_clipping": True, "clip_count_stddev": 1.0},
    "participation": {"mode": "uniform", "min_separation": 0},
}
QUIET = {"progress": False, "log": lambda s: None}
DONE = 3  # rounds in the resume point


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A run stopped right after its resume point of round 3; theta_0 as the hook saw it (the
    attacker rebuilds it from config.json and the seed)."""
    out = tmp_path_factory.mktemp("secrecy") / "run"
    seen = {}

    def hook(r, theta):
        seen.setdefault(r, theta.copy())
        if r == DONE:
            raise Crash

    with pytest.raises(Crash):
        run_simulation(parse_config(CFG), out, before_round=hook, **QUIET)
    return out, seen[0], seen[DONE]


def _floats(obj):
    """Every number in a JSON document."""
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _floats(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _floats(v)]
    return [float(obj)] if isinstance(obj, (int, float)) and not isinstance(obj, bool) else []


def test_attack_the_resume_point_does_not_give_the_clipped_sum_back(crashed):
    out, theta0, theta_t = crashed
    point = out / "resume"
    arrays = load_file(str(point / "server_state.safetensors"))
    assert np.array_equal(arrays["theta"], theta_t)  # the point is the released model of round 3
    dp = CFG["dp"]
    released = (arrays["theta"].astype(np.float64) - theta0) * dp["report_goal"]  # lr 1, momentum 0
    # what the attacker subtracts: every other vector the resume point holds (the live nodes)
    attacker_noise = sum((v.astype(np.float64) for k, v in arrays.items() if k not in ("theta", "momentum")),
                         np.zeros_like(released))
    recovered = released - attacker_noise
    # the truth, with the key (the attacker does not have it): the tree noise of [1, 3]
    key = (point / "noise_key").read_bytes()
    z_model = model_noise_multiplier(dp["noise_multiplier"], dp["clip_count_stddev"])  # adaptive clipping's
    nodes = GaussianNodes(key, z_model * dp["clip_norm"], theta0.size)
    noise = sum(nodes(0, lv, ix).astype(np.float64) for lv, ix in prefix_nodes(DONE))
    clipped_sum = released - noise
    # before: |recovered - clipped_sum| was ~1e-5 against a noise norm in the tens
    assert np.linalg.norm(recovered - clipped_sum) > 0.5 * np.linalg.norm(noise)
    assert set(arrays) == {"theta", "momentum"}


def test_attack_the_resume_point_does_not_give_the_clipped_counts_back(crashed):
    out, _, _ = crashed
    state = json.loads((out / "resume" / "server_state.json").read_text())
    key = (out / "resume" / "noise_key").read_bytes()
    count_nodes = GaussianNodes(key, CFG["dp"]["clip_count_stddev"], 1, b"count")
    secrets = {float(count_nodes(0, lv, ix)[0]) for lv, ix in prefix_nodes(DONE)}
    held = set(_floats(state))
    assert not secrets & held  # before: every live count node was in clip_estimator.tree.noise
    assert state["clip_estimator"]["tree"] == {"dim": 1, "tree_id": 0, "t": DONE,
                                               "nodes": [list(n) for n in prefix_nodes(DONE)]}
    assert state["tree"]["nodes"] == [list(n) for n in prefix_nodes(DONE)]


def test_tree_resume_rebuilds_its_nodes_from_the_key():
    key = bytes(range(32))
    mechanism = TreeMechanism()
    tree = mechanism.stream(5, 1.0, key)
    for _ in range(6):
        tree.next_residual()
    state = json.loads(json.dumps(tree.state_dict()))  # what the resume point holds: JSON positions
    assert state == {"dim": 5, "tree_id": 0, "t": 6, "nodes": [[2, 0], [1, 2]]}
    resumed = mechanism.resume(state, 5, 1.0, key)
    for _ in range(5):
        assert np.array_equal(resumed.next_residual(), tree.next_residual())


def _modes(root):
    """(folder modes, file modes) of everything under `root`, root included, by relative path."""
    folders = {".": stat.S_IMODE(root.stat().st_mode)}
    files = {}
    for path in root.rglob("*"):
        where = folders if path.is_dir() else files
        where[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return folders, files


def test_an_interrupted_run_directory_is_0700_and_dpfleets_files_0600_under_any_umask(crashed):
    """Library use (no umask of ours, 022 here): the run directory and every folder in it 0700,
    every file dpfleet writes 0600 (the resume point and round logs included). A file a library
    writes itself (a tokenizer's save) may carry the umask's 0644, inside 0700 folders only."""
    out, _, _ = crashed
    folders, files = _modes(out)
    assert set(folders.values()) == {0o700}, folders
    assert {"resume/server_state.json", "resume/server_state.safetensors", "resume/noise_key",
            "config.json", "releases.jsonl", "metrics.jsonl"} <= set(files)
    by_library = {name for name in files if name.startswith("vocabulary/")}
    assert {name: m for name, m in files.items() if name not in by_library and m != 0o600} == {}


def test_a_cli_run_leaves_nothing_readable_by_others(tmp_path):
    """`dpfleet simulate` holds umask 077 while it runs (libraries' files too: the plot, the
    tokenizer, safetensors), so every folder it leaves is 0700 and every file 0600, and the
    test process's umask is back as it was afterwards."""
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(parse_config(dict(CFG, rounds=2, checkpoint_every=1)).resolved()))
    before = os.umask(0o022)
    try:
        main(["simulate", str(config), "--out", str(tmp_path / "run"), "--quiet"])
        assert os.umask(0o022) == 0o022  # put back
    finally:
        os.umask(before)
    folders, files = _modes(tmp_path / "run")
    assert set(folders.values()) == {0o700}, folders
    assert {"accuracy.png", "checkpoint/model.safetensors", "privacy.json", "summary.json"} <= set(files)
    assert {name: m for name, m in files.items() if m != 0o600} == {}
