"""`simulate` reads its clients through the memory-mapped store: the same run, byte for byte, as
the engine driven with the Python lists; the store is built once and reused; a generated
population runs at 10^5 clients and every output says its epsilon protects nobody real."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from test_edge_client_store import make_clients

from dpfleet.cli import main
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.backends import make_trainer, trainer_precision
from dpfleet.coordinator.engine.evaluation import split_held_out
from dpfleet.coordinator.engine.population import open_population
from dpfleet.coordinator.engine.round_engine import RoundEngine, Stop
from dpfleet.coordinator.engine.simulation import (
    derive_seed,
    make_aggregator,
    make_runtime,
    prepare_data,
    run_simulation,
    train_plan,
)
from dpfleet.coordinator.state.resume import data_fingerprint, fingerprint_secret
from dpfleet.coordinator.state.run_dir import RunDir
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.errors import DpfleetError
from dpfleet.export.models import build_model

CFG = {
    "rounds": 5, "eval_every": 5, "seed": 4, "checkpoint_every": 0,
    "data": {"dataset": "shakespeare", "max_clients": 40, "eval_examples": 40, "max_examples": 8,
             "keyboard_words": 0},  # no keyboard metrics: seconds a run, read by none
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8},
    "client": {"lr": 1.0, "batch_size": 8},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 6, "noise_seed": 5},
    "participation": {"mode": "uniform", "min_separation": 2, "max_participation": 2},
}
QUIET = {"progress": False, "log": lambda s: None}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A private populations/ folder; every other cache entry (trained tokenizers, wheels) is the
    user's own, linked in, so a test does not retrain a SentencePiece model for a minute."""
    shared, own = cache_dir(), tmp_path / "cache"
    own.mkdir()
    (shared / "tokenizers").mkdir(parents=True, exist_ok=True)
    for entry in shared.iterdir():
        if entry.name != "populations":
            (own / entry.name).symlink_to(entry)
    monkeypatch.setenv("DPFLEET_CACHE", str(own))
    return own


def lists_run(cfg, out):
    """The engine driven with the Python lists (FederatedData.train), as simulate did before it
    read through the store."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(max(1, cfg.client.threads))
    run = RunDir(out)
    run.write_config(cfg.resolved())
    tokenizer, data = prepare_data(cfg, out / "vocabulary")
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    model = build_model(model_cfg)
    trainer = make_trainer(cfg.client.trainer, make_runtime(cfg, model_cfg, out / "programs"),
                           model_cfg, seq_len=cfg.data.seq_len, batch_size=cfg.client.batch_size,
                           device=cfg.client.device, memory_mb=cfg.client.cohort_memory_mb,
                           backend=cfg.backend, precision=cfg.client.precision)  # as simulate
    engine = RoundEngine(
        cfg, run, model=model, model_cfg=model_cfg, tokenizer=tokenizer,
        users=[c.user for c in data.train], test_rows=split_held_out(data.test, 40)[0],
        fingerprint=data_fingerprint([c.examples for c in data.train], tokenizer,
                                     fingerprint_secret(out, create=True)),
        precision=trainer_precision(trainer)["used"])
    aggregator = make_aggregator(cfg)
    while not isinstance(plan := engine.open_round(), Stop):
        updates = train_plan(cfg, trainer, data.train, plan)
        engine.close_round(plan, aggregator.aggregate([u.delta for u in updates],
                                                      derive_seed(cfg.seed, "agg", plan.round)), updates)
    return engine


def test_store_run_is_the_lists_run_byte_for_byte(tmp_path, own_cache):
    cfg = parse_config(CFG)
    sim = run_simulation(cfg, tmp_path / "store", **QUIET)
    (store,) = (own_cache / "populations").iterdir()  # simulate built its store in the cache
    assert json.loads((store / "meta.json").read_text())["clients"] == 40
    lists_run(cfg, tmp_path / "lists")
    for name in ("metrics.jsonl", "participation.jsonl"):
        assert (tmp_path / "store" / name).read_bytes() == (tmp_path / "lists" / name).read_bytes()
    log = (tmp_path / "store" / "participation.jsonl").read_text().splitlines()
    rounds = [json.loads(x) for x in log]
    assert len(rounds) == 5 and len({tuple(r["devices"]) for r in rounds}) == 5
    assert "generated_population" not in json.loads((sim.run_dir / "summary.json").read_text())
    assert "generated_population" not in sim.privacy
    assert "GENERATED" not in (sim.run_dir / "privacy_report.md").read_text()


def test_the_store_is_built_once_and_reused(tmp_path):
    tmp_path = tmp_path / "stores"
    cfg = parse_config(CFG)
    clients = make_clients([3, 1, 4, 2])
    first = open_population(cfg, clients, 300, tmp_path)
    (folder,) = tmp_path.iterdir()
    stamp = (folder / "rows.npy").stat().st_mtime_ns
    again = open_population(cfg, clients, 300, tmp_path)
    assert list(tmp_path.iterdir()) == [folder]
    assert (folder / "rows.npy").stat().st_mtime_ns == stamp  # read, not rewritten
    assert [again.user(i) for i in range(4)] == [first.user(i) for i in range(4)]
    edited = make_clients([3, 1, 4, 2])
    edited[2].examples[0, 1] += 1  # one token of one client: another store, not the stale one
    np.testing.assert_array_equal(open_population(cfg, edited, 300, tmp_path).examples(2),
                                  edited[2].examples)
    assert len(list(tmp_path.iterdir())) == 2


def test_generated_population_of_1e5_runs_and_says_it_is_no_guarantee(tmp_path, capsys):
    config = tmp_path / "gen.toml"
    config.write_text(
        "rounds = 3\neval_every = 3\nseed = 1\ncheckpoint_every = 0\n"
        "[data]\ndataset = \"shakespeare\"\nmax_clients = 30\nmax_examples = 4\neval_examples = 20\n"
        "generated_population = 100000\n"
        "[tokenizer]\nkind = \"sentencepiece\"\nvocab_size = 1024\n"
        "[model]\narch = \"cifg\"\nembedding_dim = 8\nhidden_dim = 8\nprojection_dim = 8\n"
        "[dp]\nnoise_multiplier = 1.0\nclip_norm = 0.5\nreport_goal = 20\n"
        "[participation]\nmode = \"uniform\"\nmin_separation = 1\n")
    out = tmp_path / "run"
    assert main(["simulate", str(config), "--out", str(out), "--quiet"]) in (0, None)
    printed = capsys.readouterr().out
    assert "WARNING" in printed and "NOT a guarantee for any real person" in printed
    summary = json.loads((out / "summary.json").read_text())
    notice = summary["generated_population"]
    assert notice["clients"] == 100_000 and notice["cycled_from_real_users"] == 30
    privacy = json.loads((out / "privacy.json").read_text())
    assert privacy["generated_population"]["epsilon_is_a_guarantee"] is False
    assert privacy["population"] == 100_000
    report = (out / "privacy_report.md").read_text()
    assert report.startswith("**NOT PRIVATE: generated population") and "Everyone, in fact" in report
    assert "**GENERATED POPULATION" in report[:report.index("# Privacy report")]
    assert privacy["epsilon"] is None and privacy["fully_private"] is False  # no guarantee
    devices = [d for line in (out / "participation.jsonl").read_text().splitlines()
               for d in json.loads(line)["devices"]]
    assert len(devices) == 60 and all("#" in d for d in devices)
    copies = [int(d.rsplit("#", 1)[1]) for d in devices]
    assert max(copies) > 100  # drawn from the whole cycled population, not the first copy
    assert len(summary) and summary["rounds_completed"] == 3


def test_generated_population_below_the_real_clients_is_refused(tmp_path):
    cfg = parse_config({**CFG, "data": {**CFG["data"], "generated_population": 3}})
    with pytest.raises(DpfleetError, match="below the 4 real training clients"):
        open_population(cfg, make_clients([3, 1, 4, 2]), 300, tmp_path)
    with pytest.raises(DpfleetError, match="generated_population must be >= 0"):
        parse_config({**CFG, "data": {**CFG["data"], "generated_population": -1}})


def test_a_published_run_directory_does_not_name_its_population_store(tmp_path, own_cache):
    """Attack: the store's folder name is an unkeyed hash of every user id and row, so whoever
    guesses the training data could confirm it from that name. No file of the run holds it."""
    sim = run_simulation(parse_config({**CFG, "rounds": 1, "eval_every": 1}), tmp_path / "run",
                         **QUIET)
    (store,) = (own_cache / "populations").iterdir()
    digest = store.name.removeprefix("population-").encode()
    assert len(digest) == 16
    files = [p for p in sim.run_dir.rglob("*") if p.is_file()]
    assert files and not [p for p in files if digest in p.read_bytes()]
