"""`dpfleet simulate` with the cohort trainer gives the sequential path's run, and says which ran."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.edge.precision import resolve_precision
from dpfleet.errors import DpfleetError

SHORT = {
    "rounds": 3,
    "eval_every": 3,
    "seed": 3,
    "checkpoint_every": 0,
    "debug_nonprivate": True,  # the per-client telemetry the two trainers must agree on
    "data": {"dataset": "shakespeare", "max_clients": 120, "eval_examples": 200, "max_examples": 40,
             "keyboard_words": 0},  # no keyboard metrics: seconds a run, read by none
    # the comparison needs the same vocabulary and noise in every run: non-DP vocabulary, research mode
    "tokenizer": {"kind": "word", "vocab_size": 512, "allow_nonprivate_vocabulary": True},
    "model": {"arch": "lstm", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    # float32: the cohort run is compared with the sequential one at float32 rounding
    "client": {"lr": 1.0, "batch_size": 8, "precision": "float32"},
    "dp": {"noise_multiplier": 0.5, "clip_norm": 1.0, "report_goal": 12, "momentum": 0.5,
           "noise_seed": 0},
}


def simulate(tmp_path, name, **client):
    cfg = parse_config(dict(SHORT, client=dict(SHORT["client"], **client)))
    result = run_simulation(cfg, tmp_path / name, progress=False, log=lambda s: None)
    return result, json.loads((result.run_dir / "summary.json").read_text())


def telemetry(result):
    return [json.loads(line) for line in (result.run_dir / "debug_nonprivate.jsonl").read_text().splitlines()]


def test_cohort_run_matches_sequential_run(tmp_path):
    seq, seq_summary = simulate(tmp_path, "seq", trainer="sequential")
    auto, auto_summary = simulate(tmp_path, "auto")  # eager runtime: auto picks the cohort
    assert seq_summary["client_trainer"] == "sequential"
    assert auto_summary["client_trainer"] == "cohort"
    for a, b in zip(telemetry(seq), telemetry(auto), strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5)
        assert b["mean_update_norm"] == pytest.approx(a["mean_update_norm"], rel=1e-5)
        assert b["clipped_fraction"] == a["clipped_fraction"]
    assert auto.final["loss"] == pytest.approx(seq.final["loss"], abs=1e-4)
    # the same config again gives the cohort run bit for bit (CPU, same thread count)
    again, _ = simulate(tmp_path, "again")
    assert again.metrics == auto.metrics and again.final == auto.final


def test_bad_trainer_value_is_a_config_error():
    with pytest.raises(DpfleetError, match="client.trainer"):
        parse_config(dict(SHORT, client={"trainer": "fastest"}))
    with pytest.raises(DpfleetError, match="cohort_memory_mb"):
        parse_config(dict(SHORT, client={"cohort_memory_mb": 0}))


def test_auto_precision_is_stated_and_the_released_model_is_reproducible(tmp_path):
    """precision = "auto": bfloat16 where this CPU has native BF16 and the model is large enough,
    else float32 (the portable kernels included); summary.json says which and why, and two runs
    with dp.noise_seed give the same released model bit for bit."""
    first, summary = simulate(tmp_path, "first", precision="auto")
    second, _ = simulate(tmp_path, "second", precision="auto")
    # (this tiny LSTM is under AUTO_BF16_MIN_PARAMS: "auto" states float32 and why, BF16 or not)
    expected = resolve_precision("auto", params=sum(p.numel() for p in first.model.parameters()))
    assert summary["precision"] == {"used": expected.name, "reason": expected.reason}
    assert expected.reason.startswith("auto: ")
    a, b = (load_file(r.run_dir / "checkpoint" / "model.safetensors") for r in (first, second))
    assert a.keys() == b.keys() and all(a[k].dtype == np.float32 for k in a)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    seq, seq_summary = simulate(tmp_path, "seq", trainer="sequential", precision="auto")
    assert seq_summary["precision"] == {"used": "float32", "reason": "the sequential trainer runs float32"}


def test_bad_precision_is_a_config_error():
    with pytest.raises(DpfleetError, match="client.precision"):
        parse_config(dict(SHORT, client={"precision": "float16"}))
