"""What a run writes by default is DP or listed as not covered: no un-noised client telemetry in
metrics.jsonl, a debug file only with the flag, a unigram baseline fitted on held-out clients
that are not the evaluation rows, and a privacy report that says what it does not cover."""

import json

import numpy as np
import pytest

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.evaluation import split_held_out
from dpfleet.coordinator.engine.simulation import DATA_DEPENDENT_AGGREGATION, run_simulation
from dpfleet.edge.client_data import ClientData
from dpfleet.errors import DpfleetError

TELEMETRY = {"train_loss", "mean_update_norm", "clipped_fraction", *DATA_DEPENDENT_AGGREGATION}
WORDS = ["thee", "thou", "lord", "love", "sweet", "night", "king", "good", "fair", "heart"]


def _data(tmp_path, users: int = 60):
    rng = np.random.default_rng(0)
    path = tmp_path / "users.jsonl"
    path.write_text("".join(
        json.dumps({"user": f"u{i}", "text": " ".join(rng.choice(WORDS, 12))}) + "\n"
        for i in range(users)))
    return path


def _values(tmp_path, **top):
    return {"rounds": 2, "eval_every": 2, "checkpoint_every": 0,
            "data": {"dataset": "jsonl", "path": str(_data(tmp_path)), "seq_len": 8,
                     "max_examples": 4, "test_fraction": 0.3, "eval_examples": 8},
            "tokenizer": {"kind": "word", "vocab_size": 32, "allow_nonprivate_vocabulary": True},
            "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8,
                      "max_length": 8},
            "dp": {"noise_multiplier": 1.0, "clip_norm": 1.0, "report_goal": 4}, **top}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _all_keys(record: dict) -> set:
    return set(record) | {k for v in record.values() if isinstance(v, dict) for k in v}


@pytest.mark.parametrize("aggregation", ["plain", "secagg"])
def test_metrics_hold_no_unnoised_telemetry_by_default(tmp_path, aggregation):
    result = run_simulation(parse_config(_values(tmp_path, aggregation={"kind": aggregation})),
                            tmp_path / "run", progress=False, log=lambda s: None)
    for record in _lines(result.run_dir / "metrics.jsonl"):
        assert not _all_keys(record) & TELEMETRY, record
        assert {"clip", "noise_std", "epsilon", "zcdp", "clients"} <= set(record)
    assert not (result.run_dir / "debug_nonprivate.jsonl").exists()
    assert not result.privacy["debug_nonprivate_file"]
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert not _all_keys(summary) & TELEMETRY
    assert "debug_nonprivate" not in (result.run_dir / "privacy_report.md").read_text()


def test_debug_file_only_with_the_flag_and_the_report_says_so(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("rounds = 2\neval_every = 2\ncheckpoint_every = 0\n"
                      "[data]\ndataset = \"jsonl\"\npath = " + json.dumps(str(_data(tmp_path)))
                      + "\nseq_len = 8\nmax_examples = 4\ntest_fraction = 0.3\neval_examples = 8\n"
                      "[tokenizer]\nkind = \"word\"\nvocab_size = 32\n"
                      "allow_nonprivate_vocabulary = true\n"
                      "[model]\narch = \"cifg\"\nembedding_dim = 8\nhidden_dim = 8\n"
                      "projection_dim = 8\nmax_length = 8\n[dp]\nreport_goal = 4\n")
    out = tmp_path / "run"
    assert main(["simulate", str(config), "--out", str(out), "--quiet", "--debug-nonprivate"]) \
        in (0, None)
    debug = _lines(out / "debug_nonprivate.jsonl")
    assert [d["round"] for d in debug] == [1, 2]
    assert all({"train_loss", "mean_update_norm", "clipped_fraction"} <= set(d) for d in debug)
    assert all(d["train_loss"] > 0 for d in debug)
    for record in _lines(out / "metrics.jsonl"):
        assert not _all_keys(record) & TELEMETRY
    report = (out / "privacy_report.md").read_text()
    covered, not_covered = report.split("## Not covered by the guarantee")
    assert "`debug_nonprivate.jsonl`" in not_covered
    assert json.loads((out / "config.json").read_text())["debug_nonprivate"] is True
    with pytest.raises(DpfleetError, match="debug-nonprivate"):  # resume keeps its own config
        from dpfleet.coordinator.cli.simulate import simulate

        simulate.main(["--resume", str(out), "--debug-nonprivate"], standalone_mode=False)


def test_report_lists_what_is_not_covered(tmp_path):
    result = run_simulation(parse_config(_values(tmp_path)), tmp_path / "run", progress=False,
                            log=lambda s: None)
    report = (result.run_dir / "privacy_report.md").read_text()
    section = report.split("## Not covered by the guarantee")[1].split("\n## ")[0]
    for needle in ("Held-out evaluation data", "Hyper-parameter tuning",
                   "What a client is in this dataset (jsonl)", "**The word vocabulary**"):
        assert needle in section, needle
    assert result.privacy["not_covered"] == [
        line[2:] for line in section.strip().splitlines() if line.startswith("- ")]


def test_report_lists_public_data_and_shakespeare_clients():
    from dpfleet.coordinator.run_privacy.not_covered import not_covered

    cfg = parse_config({"data": {"dataset": "shakespeare"}})
    items = not_covered(cfg, public_data=["wikitext2, for the SentencePiece vocabulary"])
    assert any("(play, speaker) pair" in i and "several clients" in i for i in items)
    assert any(i.startswith("Public data") and "wikitext2" in i for i in items)
    assert not any("word vocabulary" in i for i in items)  # SentencePiece: nothing private


def _clients(sizes):
    return [ClientData(f"h{i}", np.full((n, 3), i + 10, dtype=np.int32)) for i, n in enumerate(sizes)]


def test_baseline_clients_are_disjoint_from_the_evaluation_rows():
    clients = _clients([3, 4, 5, 6, 7])
    rows, baseline = split_held_out(clients, 6)  # rows of the first 2 clients
    assert len(rows) == 6 and set(np.unique(rows)) == {10, 11}
    assert [c.user for c in baseline] == ["h2", "h3", "h4"]
    rows, baseline = split_held_out(clients, None)  # every client scored: split in two
    assert set(np.unique(rows)) == {10, 11, 12} and [c.user for c in baseline] == ["h3", "h4"]
    rows, baseline = split_held_out(clients, 100)
    assert set(np.unique(rows)) == {10, 11, 12} and len(baseline) == 2
    with pytest.raises(DpfleetError, match="held-out users"):
        split_held_out(_clients([3]), None)


def test_run_baseline_is_fitted_on_held_out_clients_only(tmp_path, monkeypatch):
    import dpfleet.coordinator.engine.simulation as simulation

    seen = {}
    real = simulation.unigram_baseline

    def spy(rows, test_rows, *args, **kwargs):
        rows = list(rows)
        seen["rows"], seen["test"] = rows, test_rows
        return real(rows, test_rows, *args, **kwargs)

    monkeypatch.setattr(simulation, "unigram_baseline", spy)
    result = run_simulation(parse_config(_values(tmp_path)), tmp_path / "run", progress=False,
                            log=lambda s: None)
    fitted = {r.tobytes() for rows in seen["rows"] for r in rows}
    train = {r.tobytes() for c in simulation.prepare_data(parse_config(_values(tmp_path)))[1].train
             for r in c.examples}
    scored = {r.tobytes() for r in seen["test"]}
    assert fitted and not fitted & train and not fitted & scored
    assert result.baseline["fitted_on_held_out_clients"] == len(seen["rows"]) > 0
