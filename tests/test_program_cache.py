"""Training programs live in one user cache keyed by content: a second run never re-exports."""

from __future__ import annotations

import threading
import time

import pytest
from edge_models import SEQ_LEN, tiny_config

from dpfleet.export import training
from dpfleet.export.training import ProgramSpec, default_program_cache, training_program


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_program_cache() == tmp_path / "xdg" / "dpfleet" / "programs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_program_cache() == tmp_path / "home" / ".cache" / "dpfleet" / "programs"


def test_concurrent_requests_export_once(monkeypatch, tmp_path):
    """Two workers ask for the same program at once: one exports, the other waits and reads it.
    The exporter is replaced by a slow stand-in (real exports take seconds to minutes)."""
    calls = []

    def slow_export(spec):  # stands in for export_training_program: any bytes are a "program"
        calls.append(spec)
        time.sleep(0.5)
        return b"program bytes of " + spec.key().encode()

    monkeypatch.setattr(training, "export_training_program", slow_export)
    spec = ProgramSpec(tiny_config("cifg"), SEQ_LEN, 4, "pte")
    results = []
    workers = [threading.Thread(target=lambda: results.append(training_program(spec, tmp_path)))
               for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    assert results[0].read_verified() == b"program bytes of " + spec.key().encode()
    other = ProgramSpec(tiny_config("lstm"), SEQ_LEN, 4, "pte")
    training_program(other, tmp_path)
    assert len(calls) == 2  # a different model is a different program


@pytest.mark.slow  # ~13 s: two simulations; the cache's keying is tested by default above
def test_second_simulation_reuses_the_first_runs_program(monkeypatch, tmp_path):
    """`simulate` with an exported runtime writes its program to the user cache, not the run
    folder, so the next run (any run directory) and a bundle of its checkpoint load it without
    exporting; the bundle carries the run's privacy summary and client settings."""
    pytest.importorskip("onnxruntime")
    from dpfleet.coordinator.config import parse_config
    from dpfleet.coordinator.engine.simulation import run_simulation

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the data cache stays where it is
    cfg = parse_config({
        "rounds": 1, "eval_every": 1, "checkpoint_every": 0,
        "data": {"dataset": "shakespeare", "max_clients": 30, "eval_examples": 50, "max_examples": 8,
                 "seq_len": 4},
        "tokenizer": {"kind": "word", "allow_nonprivate_vocabulary": True, "vocab_size": 64},
        "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8},
        "client": {"runtime": "onnx", "batch_size": 4, "trainer": "sequential"},
        "dp": {"noise_multiplier": 0.0, "report_goal": 3},
    })
    run_simulation(cfg, tmp_path / "a", progress=False, log=lambda s: None)
    programs = sorted((tmp_path / "xdg" / "dpfleet" / "programs").glob("train-*.onnx"))
    assert len(programs) == 1 and not (tmp_path / "a" / "programs").exists()

    def refuse(spec):
        raise AssertionError("re-exported a cached program")

    monkeypatch.setattr(training, "export_training_program", refuse)
    run_simulation(cfg, tmp_path / "b", progress=False, log=lambda s: None)

    # the run's checkpoint bundles with the same cached program, its privacy and client settings
    import json

    from dpfleet.edge.device_client import BundleClient
    from dpfleet.export.bundle import BundleExport

    # this tiny run has caveats (no noise, a non-private vocabulary): the bundle must accept them
    summary = BundleExport(tmp_path / "a" / "checkpoint", tmp_path / "bundle", accept_caveats=True).run()
    client = BundleClient(tmp_path / "bundle", summary["public_key"])
    manifest = client.bundle.manifest
    assert manifest["privacy"] == json.loads((tmp_path / "a" / "privacy.json").read_text())
    assert (client.seq_len, client.batch_size, client.lr, client.clip_norm) == (
        4, 4, cfg.client.lr, cfg.dp.clip_norm)
    assert client.max_examples == 8
