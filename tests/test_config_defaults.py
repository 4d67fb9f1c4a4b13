"""One source of defaults (issue 33): a dict config and a TOML file get the same defaults, and they
are the main job's values, so `{"rounds": 2}` trains the main job's model at its learning rates
(before: vocabulary 4096 vs 1024, clip 0.3 vs 2.0, lr 0.5 vs 1.0, a 2.4M-parameter model).
Relative paths in a config file are read from the file's folder."""

import os
import tomllib
from pathlib import Path

import pytest

from dpfleet.coordinator.config import (
    MAIN_JOB_CHOICES,
    PATH_KEYS,
    SimulationConfig,
    load_config,
    parse_config,
)
from dpfleet.errors import DpfleetError

ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB = ROOT / "examples" / "shakespeare_cifg.toml"


def stated_keys(values: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(stated_keys(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def value_of(cfg: SimulationConfig, dotted: str) -> object:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_main_job_states_the_defaults_except_its_documented_choices():
    stated = stated_keys(tomllib.loads(MAIN_JOB.read_text()))
    defaults = SimulationConfig()
    differ = {k for k, v in stated.items() if value_of(defaults, k) != v}
    assert differ == set(MAIN_JOB_CHOICES), (
        "a key the main job sets otherwise than the default: make the default the main job's value, "
        f"or say why in MAIN_JOB_CHOICES: {sorted(differ ^ set(MAIN_JOB_CHOICES))}")


def test_a_dict_and_a_toml_file_get_the_same_defaults(tmp_path):
    partial = {"rounds": 2, "dp": {"noise_multiplier": 0.5}, "model": {"hidden_dim": 48}}
    path = tmp_path / "partial.toml"
    path.write_text("rounds = 2\n[dp]\nnoise_multiplier = 0.5\n[model]\nhidden_dim = 48\n")
    assert load_config(path).resolved() == parse_config(partial).resolved()
    # and a key left out is the main job's: its vocabulary, model, learning rates and clip
    main = load_config(MAIN_JOB)
    cfg = parse_config({"rounds": 2})
    for key in ("tokenizer.vocab_size", "tokenizer.corpus", "model.arch", "model.embedding_dim",
                "model.hidden_dim", "model.projection_dim", "client.lr", "client.batch_size",
                "dp.clip_norm", "dp.momentum", "dp.server_lr", "dp.delta", "data.seq_len",
                "data.max_examples", "eval_every", "checkpoint_every"):
        assert value_of(cfg, key) == value_of(main, key), key
    assert parse_config({}).rounds == main.rounds == 20


def test_a_partial_model_section_keeps_the_main_jobs_other_sizes():
    cfg = parse_config({"model": {"arch": "lstm"}})
    assert (cfg.model.arch, cfg.model.embedding_dim, cfg.model.hidden_dim) == ("lstm", 32, 64)
    with pytest.raises(DpfleetError, match="projection_dim == model.embedding_dim"):
        parse_config({"model": {"tie_embeddings": True, "embedding_dim": 48}})


def test_relative_paths_are_read_from_the_config_files_folder(tmp_path, monkeypatch):
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "users.jsonl").write_text('{"user": "a", "text": "hi"}\n')
    config = folder / "job.toml"
    config.write_text('[data]\ndataset = "jsonl"\npath = "users.jsonl"\n'
                      '[tokenizer]\npath = "../tok"\n[aggregation]\nkind = "secagg"\nsigned = true\n'
                      'fleet_keys = "/abs/keys.json"\n')
    monkeypatch.chdir(tmp_path)  # somewhere else: the file's folder counts, not this one
    cfg = load_config(Path("job") / "job.toml")
    assert cfg.data.path == str(folder / "users.jsonl")
    assert cfg.tokenizer.path == str(tmp_path / "tok")
    assert cfg.aggregation.fleet_keys == "/abs/keys.json"  # absolute stays
    # an override typed on the command line is the shell's: read from the working folder
    over = load_config(Path("job") / "job.toml", {"data.path": "other.jsonl"})
    assert over.data.path == "other.jsonl"
    # a dict's relative path is read from the working folder when the data loads
    assert parse_config({"data": {"dataset": "jsonl", "path": "users.jsonl"}}).data.path == "users.jsonl"
    assert {f"{s}.{k}" for s, k in PATH_KEYS} == {"data.path", "tokenizer.path", "tokenizer.word_counts",
                                                 "tokenizer.words", "aggregation.fleet_keys",
                                                 "devices.trace"}


def test_a_jsonl_config_runs_from_another_folder(tmp_path, monkeypatch):
    """The data a config names is found wherever the command runs (the run loads it)."""
    from dpfleet.edge.datasets import load_records

    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "users.jsonl").write_text('{"user": "a", "text": "hello there"}\n')
    (tmp_path / "job" / "c.toml").write_text('[data]\ndataset = "jsonl"\npath = "users.jsonl"\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(Path("job/c.toml"))
    os.chdir(tmp_path.parent)
    assert [r.text for r in load_records(cfg.data.dataset, "train", Path(cfg.data.path))] == ["hello there"]
