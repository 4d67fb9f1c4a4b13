"""Vocabularies the field's way: top words of a public word-count file or list with TFF's OOV
buckets, and TFF Shakespeare's character set; where the vocabulary came from in privacy.json."""

import json

import pytest

from dpfleet.coordinator.accounting.privacy_report import _vocabulary_source_line
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.field_metrics import TFF_ACCURACIES
from dpfleet.coordinator.engine.simulation import make_tokenizer, run_simulation
from dpfleet.coordinator.run_privacy.not_covered import nonprivate_vocabulary, vocabulary_source
from dpfleet.edge.tokenizer import (
    UNK,
    CharTokenizer,
    WordTokenizer,
    load_tokenizer,
    oov_bucket,
)
from dpfleet.errors import DpfleetError
from dpfleet.fleet.emulate import needs_coordinator_vocabulary


def test_oov_buckets_hash_as_tensorflow_does():
    # tf.strings.to_hash_bucket_fast(["Hello", "TensorFlow", "2.x"], 3) -> [0, 2, 2] (TF's docs);
    # StaticVocabularyTable hashes unknown keys with it
    assert [oov_bucket(w, 3) for w in ("Hello", "TensorFlow", "2.x")] == [0, 2, 2]
    assert oov_bucket("anything", 1) == 0


@pytest.fixture
def counts(tmp_path):
    path = tmp_path / "stackoverflow.word_count"
    path.write_text("the 50\nof 30\nto 40\nand 30\n")
    return path


def test_word_counts_top_words_buckets_and_tff_split(counts, tmp_path):
    # vocab_size 8 = pad, bos, eos + 2 OOV buckets + the 3 most frequent words (ties: file order)
    tok = WordTokenizer.from_word_counts(counts, vocab_size=8, oov_buckets=2)
    assert tok.words[5:] == ["the", "to", "of"] and tok.oov_ids == (3, 4) and tok.vocab_size == 8
    # TFF's split: lower-cased, single spaces; two spaces make an empty (OOV) word
    hello = UNK + oov_bucket("hello", 2)
    assert tok.encode("The  to Hello of") == [5, UNK + oov_bucket("", 2), 6, hello, 7]
    again = load_tokenizer(tok.save(tmp_path / "tok"))
    assert (again.words, again.oov_ids, again.split, again.source) == (
        tok.words, (3, 4), "tff", "public word counts stackoverflow.word_count")
    assert again.encode("The  to Hello of") == tok.encode("The  to Hello of")


def test_word_list_and_bad_files_are_one_line(counts, tmp_path):
    words = tmp_path / "words.txt"
    words.write_text("zeta\nalpha\n\nzeta\nbeta\n")
    assert WordTokenizer.from_word_list(words, vocab_size=6).words[4:] == ["zeta", "alpha"]
    counts.write_text("the 50\nof thirty\n")
    with pytest.raises(DpfleetError, match=r"word_count, line 2: expected 'word count'"):
        WordTokenizer.from_word_counts(counts, 10)
    with pytest.raises(DpfleetError, match="no room for words"):
        WordTokenizer.from_word_list(words, vocab_size=5, oov_buckets=2)
    with pytest.raises(DpfleetError, match="not found"):
        WordTokenizer.from_word_list(tmp_path / "missing.txt", 10)


def test_char_vocabulary_is_tffs():
    tok = CharTokenizer()
    assert tok.vocab_size == 90  # TFF: 86 characters + pad, oov, bos, eos
    # 'd' and 'h' are TFF's first two characters, ' ' its 14th; 'é' is two bytes, two OOVs
    assert tok.encode("dh é") == [4, 5, 17, UNK, UNK]
    assert tok.decode([4, 5, 17, UNK]) == "dh \ufffd"


def test_char_round_trip(tmp_path):
    again = load_tokenizer(CharTokenizer().save(tmp_path / "c"))
    assert again.kind == "char" and again.encode("To be,\n") == CharTokenizer().encode("To be,\n")


def test_config_builds_public_vocabulary_and_reports_it(counts):
    cfg = parse_config({"tokenizer": {"kind": "word", "word_counts": str(counts), "vocab_size": 8,
                                      "oov_buckets": 2, "dp_noise": 0}})
    tok = make_tokenizer(cfg, [["private words only"]])
    assert tok.words[5:] == ["the", "to", "of"]  # nothing from the private clients
    source = vocabulary_source(cfg)
    assert source["covered"] is True and str(counts) in source["source"]
    assert "none" in source["privacy_cost"]
    assert _vocabulary_source_line({"vocabulary_source": source})[0].startswith(
        f"**Vocabulary:** the public word-count file {counts}")
    assert not needs_coordinator_vocabulary(cfg)  # no noise drawn: every device builds the same
    flagged = parse_config({"tokenizer": {"kind": "word", "word_counts": str(counts),
                                          "allow_nonprivate_vocabulary": True}})
    assert not nonprivate_vocabulary(flagged) and vocabulary_source(flagged)["covered"] is True
    private = vocabulary_source(parse_config({"tokenizer": {"kind": "word",
                                                            "allow_nonprivate_vocabulary": True}}))
    assert private["covered"] is False
    char = parse_config({"tokenizer": {"kind": "char"}})
    assert make_tokenizer(char, []).vocab_size == 90 and vocabulary_source(char)["covered"] is True


def test_config_refuses_word_file_with_another_kind(counts):
    with pytest.raises(DpfleetError, match='need tokenizer.kind = "word"'):
        parse_config({"tokenizer": {"kind": "sentencepiece", "words": str(counts)}})
    with pytest.raises(DpfleetError, match="set one"):
        parse_config({"tokenizer": {"kind": "word", "words": str(counts), "word_counts": str(counts)}})


def test_run_with_a_public_vocabulary_reports_tffs_metrics(tmp_path, counts):
    """A tiny run on a public word-count vocabulary with two OOV buckets: metrics.jsonl and the
    summary carry TFF's three accuracies, the baselines are scored the same way, privacy.json
    names the public file as the vocabulary's source, and the checkpoint carries the buckets."""
    data = tmp_path / "users.jsonl"
    words = ["the", "to", "of", "and", "cat", "dog"]
    lines = [{"user": f"u{i}", "text": " ".join(words[(i + j) % 6] for j in range(7))} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    values = {"rounds": 2, "eval_every": 1, "checkpoint_every": 0,
              "data": {"dataset": "jsonl", "path": str(data), "seq_len": 8, "max_examples": 4,
                       "test_fraction": 0.2},
              "tokenizer": {"kind": "word", "word_counts": str(counts), "vocab_size": 8,
                            "oov_buckets": 2},
              "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8,
                        "max_length": 8},
              "dp": {"noise_multiplier": 1.0, "clip_norm": 1.0, "report_goal": 4}}
    result = run_simulation(parse_config(values), tmp_path / "run", progress=False, log=lambda s: None)
    run = result.run_dir
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    summary = json.loads((run / "summary.json").read_text())
    for name in TFF_ACCURACIES:
        assert all(0 <= m[f"tff_{name}"] <= 1 for m in metrics)
        assert summary["final"][f"tff_{name}"] == metrics[-1][f"tff_{name}"]
        assert 0 <= summary["unigram_baseline"]["tff"]["most_frequent_word"][name] <= 1
    assert summary["unigram_baseline"]["tff"]["unigram"]["token"] in (2, 3, 4, 5, 6, 7)
    privacy = json.loads((run / "privacy.json").read_text())
    assert privacy["vocabulary_source"]["covered"] is True and privacy["vocabulary"] is None
    assert f"{counts}, for the word vocabulary" in privacy["public_data"]
    assert f"the public word-count file {counts}" in (run / "privacy_report.md").read_text()
    assert load_tokenizer(run / "checkpoint" / "tokenizer").oov_ids == (3, 4)
