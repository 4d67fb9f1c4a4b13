"""A private word vocabulary, jsonl files and the service read the training file in one streaming
pass: the same vocabulary, population and baseline as the whole-file path, one client in memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine import population, simulation
from dpfleet.coordinator.engine.population import open_population
from dpfleet.coordinator.mechanisms import dp_vocabulary
from dpfleet.edge import data_files
from dpfleet.edge.client_data import group_by_user
from dpfleet.edge.datasets import load_jsonl
from tests.test_data_files import stackoverflow, write_tff_sqlite


def no_lists(*args, **kwargs):
    raise AssertionError("the whole-file path read the file")


def write_jsonl(path, lines):
    path.write_text("".join(json.dumps({"user": u, "text": t}) + "\n" for u, t in lines))
    return path


def interleaved(users: int, per_user: int) -> list[tuple[str, str]]:
    """Every user's lines spread over the whole file, users in no sorted order (the worst case)."""
    ids = [f"u{(i * 7919) % users:05d}" for i in range(users)]
    return [(u, f"line {k} of {u} says hello") for k in range(per_user) for u in ids]


@pytest.mark.parametrize("nonprivate", [False, True], ids=["dp", "nonprivate"])
@pytest.mark.parametrize("fmt", ["tff_sqlite", "jsonl"])
def test_a_private_word_vocabulary_streams_and_equals_the_whole_file_vocabulary(
        tmp_path, monkeypatch, fmt, nonprivate):
    words = {f"{i:04d}": [r["tokens"] + f" w{i % 3} w{i % 5}" for r in stackoverflow(f"{i:04d}", 1 + i % 4)]
             for i in range(60)}
    if fmt == "tff_sqlite":
        path = tmp_path / "so.sqlite"
        write_tff_sqlite(path, {u: [{"tokens": t} for t in texts] for u, texts in words.items()},
                         split="train")
    else:  # users interleaved and unsorted: the file's order is not the population's
        path = write_jsonl(tmp_path / "so.jsonl", [(u, t) for k in range(4) for u in reversed(words)
                                                   for t in words[u][k:k + 1]])
    cfg = parse_config({"data": {"dataset": fmt, "path": str(path), "seq_len": 6, "max_examples": 3,
                                 "test_fraction": 0.2},
                        "tokenizer": {"kind": "word", "vocab_size": 16, "dp_words_per_user": 4,
                                      "dp_noise": 0.5, "allow_nonprivate_vocabulary": nonprivate}})
    monkeypatch.setattr(dp_vocabulary, "new_noise_key", lambda: bytes(range(32)))  # same noise twice
    whole_tok, lists = simulation.prepare_data(cfg, tmp_path / "whole")
    by_lists = open_population(cfg, lists.train, whole_tok.vocab_size, cache=tmp_path / "lists")

    monkeypatch.setattr(simulation, "load_records", no_lists)
    monkeypatch.setattr(population, "population_cache", lambda: tmp_path / "streamed")
    tok, data, streamed = simulation.load_clients(cfg, tmp_path / "streamed_vocab", None, None, None)
    assert tok.words == whole_tok.words and len(tok.words) > 4 + 3  # PAD BOS EOS UNK + some words
    if not nonprivate:  # the same counts behind it: candidates, passed, kept
        assert (simulation.vocabulary_privacy(tmp_path / "streamed_vocab")
                == simulation.vocabulary_privacy(tmp_path / "whole"))
    assert streamed.users == by_lists.users
    assert (streamed.rows[:] == by_lists.rows[:]).all() and (streamed.offsets[:] == by_lists.offsets[:]).all()
    assert [c.user for c in data.test] == [c.user for c in lists.test]


def peak_in_a_fresh_process(code: str, **values) -> dict:
    """Run `code` (it sets `out`) in a new interpreter and return `out`: tracemalloc traces every
    thread, so a peak measured inside a test worker also counted what a thread left by an earlier
    test allocated meanwhile (85 KB against a 35 KB bound, seen once under load)."""
    script = "import json, sys, tracemalloc\nvalues = json.loads(sys.argv[1])\n" + textwrap.dedent(code)
    script += "\nprint(json.dumps(out))"
    done = subprocess.run([sys.executable, "-c", script, json.dumps(values)], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_jsonl_streams_users_in_sorted_order_without_holding_the_file(tmp_path):
    users, per_user = 1500, 4
    path = write_jsonl(tmp_path / "mixed.jsonl", interleaved(users, per_user))
    tidy = write_jsonl(tmp_path / "tidy.jsonl", sorted(interleaved(users, per_user), key=lambda r: r[0]))
    size = path.stat().st_size  # about 0.35 MB
    expected = group_by_user(load_jsonl(path))
    got = peak_in_a_fresh_process("""
        from dpfleet.edge import data_files
        from dpfleet.edge.client_data import group_by_user
        from dpfleet.edge.datasets import load_jsonl
        expected = group_by_user(load_jsonl(values["mixed"]))
        out = {}
        tracemalloc.start()
        for name in ("mixed", "tidy"):
            tracemalloc.reset_peak()
            clients = data_files.iter_clients(values[name], "jsonl")
            seen = sum(texts == expected[user] for user, texts in clients)
            out[name] = [tracemalloc.get_traced_memory()[1], seen]
        tracemalloc.stop()
        """, mixed=str(path), tidy=str(tidy))
    peaks = {name: peak for name, (peak, _) in got.items()}
    assert {name: seen for name, (_, seen) in got.items()} == {"mixed": users, "tidy": users}
    # a whole file's records take more than its size; one client's lines are about 150 bytes
    assert peaks["mixed"] < size / 10 and peaks["tidy"] < size / 10, (peaks, size)
    assert [u for u, _ in data_files.iter_clients(path, "jsonl")] == sorted(expected)
    assert data_files.client_ids(path, "jsonl") == sorted(expected)


def test_serve_streams_the_file_and_its_unigram_baseline_masks_every_oov_bucket(tmp_path, monkeypatch):
    """The attack: with 3 OOV buckets, a served run's baseline that masks only <unk> picks an OOV
    bucket as its "most frequent word" and counts OOV targets as right, unlike simulate's."""
    from service_fleet import tiny_cfg

    from dpfleet.coordinator.engine.simulation import run_simulation
    from dpfleet.service.boot import boot

    counts = tmp_path / "word_count"
    counts.write_text("".join(f"{w} {100 - i}\n" for i, w in enumerate(["the", "cat", "sat", "on", "mat"])))
    lines = [(f"u{i:02d}", f"the cat {' '.join(f'zz{i}x{k}' for k in range(6))} sat on the mat")
             for i in range(16) for _ in range(3)]
    path = write_jsonl(tmp_path / "users.jsonl", lines)
    cfg = tiny_cfg(rounds=1, eval_every=1,
                   data={"dataset": "jsonl", "path": str(path), "max_clients": 0, "test_fraction": 0.25,
                         "seq_len": 12, "max_examples": 3, "eval_examples": 0},
                   tokenizer={"kind": "word", "word_counts": str(counts), "vocab_size": 16,
                              "oov_buckets": 3})
    monkeypatch.setattr(population, "population_cache", lambda: tmp_path / "populations")
    simulated = run_simulation(cfg, tmp_path / "run", progress=False, log=lambda s: None).baseline
    monkeypatch.setattr(simulation, "load_records", no_lists)
    booted = boot(cfg, tmp_path / "state", log=lambda s: None)
    booted.store.close()
    assert simulated["top_token"] not in (3, 4, 5)  # the buckets are UNK .. UNK + 2
    assert booted.baseline == simulated
    assert len(booted.users) == 12 and booted.users == sorted(booted.users)  # 4 of 16 held out


def test_counting_a_private_vocabulary_holds_one_client_and_the_count_table(tmp_path):
    """600 clients of ~600 bytes of text each, 8 distinct words: the streamed count stays within a
    few clients' worth, where the file's records alone take hundreds."""
    per_client = 600
    db = tmp_path / "many.sqlite"
    text = " ".join(["word"] * 30)
    clients = {f"{i:06d}": [{"tokens": f"{text} {i % 7} {k}"} for k in range(4)] for i in range(600)}
    write_tff_sqlite(db, clients, split="train")
    cfg_dict = {"data": {"dataset": "tff_sqlite", "path": str(db)},
                "tokenizer": {"kind": "word", "vocab_size": 16, "allow_nonprivate_vocabulary": True}}

    got = peak_in_a_fresh_process("""
        from dpfleet.coordinator.config import parse_config
        from dpfleet.coordinator.engine import simulation
        from dpfleet.edge import data_files

        def users():
            return (texts for _, texts in data_files.iter_clients(values["db"], "tff_sqlite", "train"))

        cfg = parse_config(values["cfg"])
        simulation.make_tokenizer(cfg, users())  # one-off import costs are not data
        tracemalloc.start()
        tok = simulation.make_tokenizer(cfg, users())
        out = {"peak": tracemalloc.get_traced_memory()[1], "words": tok.words}
        """, db=str(db), cfg=cfg_dict)
    assert got["words"][4] == "word" and len(got["words"]) == 4 + 8  # "word" and 0 .. 6
    assert got["peak"] < 20 * per_client, got["peak"]
