"""examples/stackoverflow_nwp.toml states the DP-FTRL / matrix-factorization papers' StackOverflow
run, and without the user's TFF files `dpfleet simulate` stops with one line saying where to get them."""

import shutil
from pathlib import Path

import pytest

from dpfleet.cli import main
from dpfleet.coordinator.config import load_config
from dpfleet.edge.data_tff_sql import TFF_DOWNLOADS

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "stackoverflow_nwp.toml"


def test_config_states_the_papers_run():
    cfg = load_config(CONFIG)
    assert cfg.rounds == 1600
    assert (cfg.dp.report_goal, cfg.dp.clip_norm, cfg.dp.server_lr, cfg.dp.momentum) == (100, 1.0, 3.0, 0.9)
    assert (cfg.dp.mechanism, cfg.dp.noise_multiplier, cfg.dp.delta) == ("tree", 2.166, 1e-6)
    assert cfg.client.lr == 0.5
    assert (cfg.data.dataset, cfg.data.split, cfg.data.seq_len, cfg.data.max_examples) == (
        "tff_sqlite", "train", 20, 256)
    assert (cfg.tokenizer.kind, cfg.tokenizer.vocab_size, cfg.tokenizer.oov_buckets) == ("word", 10_004, 1)
    m = cfg.model
    assert (m.preset, m.arch, m.embedding_dim, m.hidden_dim, m.projection_dim, m.tie_embeddings) == (
        "gboard_cifg", "cifg", 96, 670, 96, True)
    assert (cfg.participation.mode, cfg.participation.max_participation) == ("uniform", 1)
    # the placeholders sit next to the config (relative paths are read from its folder)
    assert cfg.data.path == str(CONFIG.parent / "stackoverflow.sqlite")
    assert cfg.tokenizer.word_counts == str(CONFIG.parent / "stackoverflow.word_count")


def test_simulate_without_the_file_is_one_line_naming_where_to_get_it(tmp_path, capsys):
    config = tmp_path / "so.toml"
    shutil.copy(CONFIG, config)
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(config), "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1
    assert err[0].startswith(f"error: TFF SQLite file not found: {tmp_path / 'stackoverflow.sqlite'}")
    assert f"{TFF_DOWNLOADS}NAME.sqlite.lzma, e.g. stackoverflow.sqlite.lzma" in err[0]
    assert not (tmp_path / "run").exists()
