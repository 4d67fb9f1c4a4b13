"""End to end on real Shakespeare clients: a few noiseless rounds beat the unigram baseline,
and the same seed reproduces the same metrics bit for bit."""

import json

import pytest

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import run_simulation

SMALL = {
    "rounds": 40,
    "eval_every": 20,
    "seed": 3,
    "data": {"dataset": "shakespeare", "max_clients": 400, "eval_examples": 400,
             "max_examples": 64, "keyboard_words": 0},  # no keyboard metrics: seconds, read by none
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 32, "hidden_dim": 64, "projection_dim": 32},
    "client": {"lr": 5.0, "batch_size": 16},
    "dp": {"noise_multiplier": 0.0, "clip_norm": 5.0, "report_goal": 10, "server_lr": 1.0,
           "momentum": 0.9},
}
SHORT = dict(SMALL, rounds=3, eval_every=3)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "a"
    return run_simulation(parse_config(SMALL), out, progress=False, log=lambda s: None)


def test_noiseless_rounds_beat_unigram_baseline(first_run):
    assert first_run.final["accuracy"] > first_run.baseline["accuracy"] + 0.02
    assert first_run.final["loss"] < first_run.baseline["loss"]


def test_run_directory_contents(first_run):
    run = first_run.run_dir
    for name in ("config.toml", "metrics.jsonl", "participation.jsonl", "accuracy.png",
                 "privacy.json", "checkpoint/model.safetensors", "checkpoint/model_config.json",
                 "checkpoint/tokenizer/tokenizer.json", "checkpoint/server_state.safetensors"):
        assert (run / name).is_file(), name
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == list(range(1, 41))
    assert {"round", "accuracy", "loss", "clip", "noise_std", "epsilon"} <= set(metrics[0])
    assert metrics[19]["accuracy"] is not None and metrics[0]["accuracy"] is None
    log = [json.loads(line) for line in (run / "participation.jsonl").read_text().splitlines()]
    devices = [d for entry in log for d in entry["devices"]]
    assert len(devices) == len(set(devices)) == 40 * 10  # disjoint: each device at most once
    assert json.loads((run / "privacy.json").read_text())["epsilon"] is None  # z = 0: inf -> null


@pytest.mark.slow
def test_same_seed_same_metrics(tmp_path):
    runs = [run_simulation(parse_config(SHORT), tmp_path / name, progress=False, log=lambda s: None)
            for name in ("x", "y")]
    assert runs[0].metrics == runs[1].metrics
    assert runs[0].final == runs[1].final
    other = run_simulation(parse_config(dict(SHORT, seed=4)), tmp_path / "z", progress=False,
                           log=lambda s: None)
    assert other.metrics != runs[0].metrics


def test_real_noise_changes_the_model_and_reports_finite_epsilon(tmp_path):
    noisy = dict(SHORT, dp=dict(SMALL["dp"], noise_multiplier=1.0))
    result = run_simulation(parse_config(noisy), tmp_path / "c", progress=False, log=lambda s: None)
    assert 0 < result.privacy["epsilon"] < float("inf")
    assert result.metrics[-1]["noise_std"] == pytest.approx(5.0)


@pytest.mark.slow
def test_secure_aggregation_gives_the_plain_result(tmp_path):
    """Same seed, secagg vs plain: the decoded sums differ only by quantization, so the
    per-round training losses (computed before aggregation) agree and the models stay close."""
    base = dict(SHORT, debug_nonprivate=True)  # the train losses live in the debug file
    plain = run_simulation(parse_config(base), tmp_path / "p", progress=False, log=lambda s: None)
    secure = run_simulation(parse_config(dict(base, aggregation={"kind": "secagg"})), tmp_path / "s",
                            progress=False, log=lambda s: None)
    losses = [[json.loads(line)["train_loss"] for line in (run.run_dir / "debug_nonprivate.jsonl").open()]
              for run in (plain, secure)]
    assert losses[1][0] == losses[0][0]
    assert losses[1][2] == pytest.approx(losses[0][2], abs=1e-4)
    assert secure.final["loss"] == pytest.approx(plain.final["loss"], abs=1e-4)
    info = secure.metrics[0]["aggregation"]
    assert info["sensitivity"] >= SMALL["dp"]["clip_norm"]
