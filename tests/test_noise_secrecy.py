"""Attacks on the released model's noise, as someone holding the run directory would try them.

The test spies on the DP-FTRL server to learn the true (noise-free) sums, so that an attack's
result can be scored ON THE VALUE: the error left after subtracting the attacker's noise guess,
against the norm of the real noise. The old scheme (noise from `default_rng([seed, tree, level,
index])` with the seed in config.json) denoised to float32 rounding; now every guess built from
config / checkpoint contents leaves the full noise in, while the research mode (`dp.noise_seed`)
is still denoised exactly: the attack works whenever the key is known."""

import hashlib
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from crashes import Crash
from noise_spy import spied_noise
from safetensors.numpy import load_file

import dpfleet.coordinator.engine.round_engine as round_engine
import dpfleet.coordinator.engine.simulation as simulation
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes, seeded_noise_key
from dpfleet.coordinator.mechanisms.tree_noise import prefix_nodes
from dpfleet.coordinator.state import resume
from dpfleet.coordinator.state.resume import resume_point
from dpfleet.errors import DpfleetError

ROUNDS = 3
CFG = {
    "rounds": ROUNDS, "eval_every": ROUNDS, "seed": 7, "checkpoint_every": 2,
    # no keyboard metrics (its beam search is the costliest part of a finished run this size):
    # nothing that uses this config reads them; tests/test_keyboard_metrics.py does
    "data": {"dataset": "shakespeare", "max_clients": 40, "eval_examples": 60, "max_examples": 8,
             "keyboard_words": 0},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"lr": 1.0, "batch_size": 8},
    # momentum 0 and server lr 1: theta_T - theta_0 = (sum of the round sums + prefix noise) / m
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 4, "momentum": 0.0},
}
QUIET = {"progress": False, "log": lambda s: None}


def spied_run(tmp_path, monkeypatch, name, values=CFG):
    """A finished run, the true sums it noised, its initial model and its (captured) noise key."""
    with spied_noise(monkeypatch) as (sums, start, keys):
        result = simulation.run_simulation(parse_config(values), tmp_path / name, **QUIET)
    return result, np.sum(sums, axis=0), start[0], keys


def released_theta(run_dir):
    """What an attacker reads: the released model in checkpoint/."""
    return load_file(str(run_dir / "checkpoint" / "server_state.safetensors"))["theta"]


def old_way_noise(seed: int, std: float, dim: int) -> np.ndarray:
    """The noise as the code before issue 10 drew it, rebuilt from config.json's seed."""
    tree_seed = simulation.derive_seed(seed, "tree")
    return sum(np.random.default_rng([tree_seed, 0, lv, ix]).standard_normal(dim, dtype=np.float32)
               * np.float32(std) for lv, ix in prefix_nodes(ROUNDS))


def aes_noise(key: bytes, std: float, dim: int) -> np.ndarray:
    nodes = GaussianNodes(key, std, dim)
    return sum(nodes(0, lv, ix) for lv, ix in prefix_nodes(ROUNDS))


def denoising_error(run, true_sum, theta0, guess) -> tuple[float, float]:
    """(||signal left after subtracting `guess|| - true signal||, ||true noise||), on sums."""
    m = CFG["dp"]["report_goal"]
    noisy_sum = (released_theta(run.run_dir).astype(np.float64) - theta0) * m
    return (float(np.linalg.norm(noisy_sum - guess - true_sum)),
            float(np.linalg.norm(noisy_sum - true_sum)))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two finished, spied runs of CFG (`spied_run`: result, true sum, theta0, noise keys) and
    the tokenizer and training examples the first one was given: the tests below only read them."""
    root = tmp_path_factory.mktemp("secrecy")
    seen = {}
    real_prepare = simulation.prepare_data

    def prepare(cfg, *args):
        tokenizer, data = real_prepare(cfg, *args)
        if not seen:
            seen.update(tokenizer=tokenizer, examples=[c.examples.copy() for c in data.train])
        return tokenizer, data

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(simulation, "prepare_data", prepare)
        runs = [spied_run(root, mp, name) for name in ("a", "b")]
    return SimpleNamespace(runs=runs, seen=seen)


def test_noise_cannot_be_rebuilt_from_the_run_directory(two_runs):
    run, true_sum, theta0, _ = two_runs.runs[0]
    config = json.loads((run.run_dir / "config.json").read_text())
    seed, std, dim = config["seed"], run.metrics[-1]["noise_std"], theta0.size
    state = (run.run_dir / "checkpoint" / "server_state.json").read_bytes()
    guesses = {
        "old default_rng from config seed": old_way_noise(seed, std, dim),
        "research key of config seed": aes_noise(seeded_noise_key(seed), std, dim),
        "research key of the old tree seed": aes_noise(seeded_noise_key(simulation.derive_seed(seed, "tree")),
                                                       std, dim),
        "sha256 of config.toml": aes_noise(hashlib.sha256((run.run_dir / "config.toml").read_bytes())
                                           .digest(), std, dim),
        "sha256 of server_state.json": aes_noise(hashlib.sha256(state).digest(), std, dim),
        "zero key": aes_noise(bytes(32), std, dim),
    }
    for name, guess in guesses.items():
        error, noise = denoising_error(run, true_sum, theta0, guess)
        # prefix 3 = two nodes: the real noise has norm std * sqrt(2 d)
        assert noise == pytest.approx(std * np.sqrt(2 * dim), rel=0.05), name
        # a wrong guess adds an independent noise: error ~ sqrt(2) * noise, never ~1e-4
        assert error > 1.2 * noise, (name, error, noise)


def test_same_config_reruns_get_independent_noise_unless_noise_seed(two_runs, tmp_path):
    noises = []
    for run, true_sum, theta0, keys in two_runs.runs:
        noises.append((released_theta(run.run_dir) - theta0) * CFG["dp"]["report_goal"] - true_sum)
        assert len(keys) == 1  # each run drew its own key
    corr = np.corrcoef(noises[0], noises[1])[0, 1]
    assert abs(corr) < 0.05, corr  # independent (d = 37k: sd of corr ~ 0.005)
    assert (two_runs.runs[0][0].run_dir / "privacy_report.md").read_text().startswith("# Privacy report")
    research = dict(CFG, dp=dict(CFG["dp"], noise_seed=3))
    thetas = [released_theta(simulation.run_simulation(parse_config(research), tmp_path / n, **QUIET)
                             .run_dir) for n in ("c", "d")]
    np.testing.assert_array_equal(thetas[0], thetas[1])


def test_no_key_and_no_node_vector_next_to_released_artifacts(two_runs):
    run, _, theta0, keys = two_runs.runs[0]
    (key,) = keys
    std = run.metrics[-1]["noise_std"]
    releases = [json.loads(x) for x in (run.run_dir / "releases.jsonl").read_text().splitlines()]
    nodes = GaussianNodes(key, std, theta0.size)
    vectors = [nodes(r["tree_id"], lv, ix).tobytes()[:64] for r in releases for lv, ix in r["nodes"]]
    assert resume_point(run.run_dir) is None
    for path in _files(run.run_dir):  # checkpoint/, config.toml/json, logs: the whole run dir
        data = path.read_bytes()
        assert key not in data and key.hex().encode() not in data, path
        assert not any(v in data for v in vectors), path
    assert "tree_node_0" not in load_file(str(run.run_dir / "checkpoint" / "server_state.safetensors"))


def test_release_log_fingerprint_cannot_test_a_guess_of_one_clients_data(two_runs):
    """The attacker knows every training client's tokens exactly and has two guesses for one
    client's (the truth and a one-token edit). A plain hash of the data in releases.jsonl would
    tell them apart; the run's keyed fingerprint matches neither hash, under no key the run
    directory holds, and its key is gone once the run finishes."""
    run, seen = two_runs.runs[0][0], two_runs.seen
    logged = {json.loads(line)["data_sha256"] for line in (run.run_dir / "releases.jsonl").open()}
    assert len(logged) == 1

    def plain_hash(examples):  # what the release log held before: sha256 of the tokenized data
        digest = hashlib.sha256()
        for rows in examples:
            rows = np.ascontiguousarray(rows, dtype=np.int32)
            digest.update(repr(rows.shape).encode())
            digest.update(rows.tobytes())
        return digest.hexdigest()

    edited = [e.copy() for e in seen["examples"]]
    edited[0][0, 1] = (edited[0][0, 1] + 1) % seen["tokenizer"].vocab_size
    guesses = {plain_hash(seen["examples"]), plain_hash(edited)}
    for f in _files(run.run_dir):  # every file of the published run directory as a candidate key
        for guess in (seen["examples"], edited):
            guesses.add(resume.data_fingerprint(guess, seen["tokenizer"], f.read_bytes()))
    assert logged.isdisjoint(guesses)
    assert not (run.run_dir / resume.FINGERPRINT_KEY).exists()


def test_research_mode_noise_is_rebuilt_exactly_so_the_attack_is_real(tmp_path, monkeypatch):
    values = dict(CFG, dp=dict(CFG["dp"], noise_seed=7))
    run, true_sum, theta0, keys = spied_run(tmp_path, monkeypatch, "research", values)
    assert keys == []  # no fresh key was drawn: the noise comes from the seed
    std = run.metrics[-1]["noise_std"]
    error, noise = denoising_error(run, true_sum, theta0, aes_noise(seeded_noise_key(7), std, theta0.size))
    assert error < 1e-4 * noise  # float32 rounding only: the seed holder sees the clients' sum
    report = (run.run_dir / "privacy_report.md").read_text()
    opening = report[:report.index("# Privacy report")]  # the caveats, above the title
    assert report.startswith("**NOT FULLY PRIVATE: research mode (dp.noise_seed = 7)")
    assert "does NOT hold against anyone who knows the noise seed" in opening
    privacy = json.loads((run.run_dir / "privacy.json").read_text())
    assert privacy["noise_seed"] == 7 and privacy["guarantee_holds_against_seed_holders"] is False


def _files(folder):
    return [p for p in folder.rglob("*") if p.is_file()]


def test_an_unfinished_run_keeps_its_key_only_in_a_0600_file(tmp_path, monkeypatch):
    keys = []
    real_key = round_engine.new_noise_key
    monkeypatch.setattr(round_engine, "new_noise_key", lambda: keys.append(real_key()) or keys[-1])

    def crash(r, theta):
        if r == 2:
            raise Crash

    out = tmp_path / "run"
    with pytest.raises(Crash):
        simulation.run_simulation(parse_config(CFG), out, before_round=crash, **QUIET)
    key_file = resume_point(out) / "noise_key"
    assert key_file.read_bytes() == keys[0]
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    for path in _files(out):
        if path != key_file:
            assert keys[0] not in path.read_bytes(), path


def test_resume_without_the_fingerprint_key_is_refused(tmp_path):
    out = tmp_path / "run"

    def crash_before_round_3(r, theta):
        if r == 2:
            raise Crash

    with pytest.raises(Crash):
        simulation.run_simulation(parse_config(CFG), out, before_round=crash_before_round_3, **QUIET)
    key_file = out / resume.FINGERPRINT_KEY
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    key_file.unlink()
    with pytest.raises(DpfleetError, match="cannot be resumed"):
        simulation.run_simulation(parse_config(CFG), out, resume=True, **QUIET)
