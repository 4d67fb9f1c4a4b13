"""The `word` vocabulary is private (DP partition selection) or explicitly refused as such.

Attacks: plant a canary word in one client and look for it in the released vocabulary; the DP
build must (almost) never release it, at the probability the report states."""

import json
import math
from statistics import NormalDist

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import make_tokenizer, run_simulation
from dpfleet.coordinator.engine.vocabulary import build_dp_vocabulary, words_by_user
from dpfleet.coordinator.mechanisms.dp_vocabulary import (
    VocabularyDP,
    dp_word_weights,
    select_words,
    user_words,
)
from dpfleet.edge.tokenizer import load_tokenizer
from dpfleet.errors import DpfleetError

CANARY = "zqxjcanary"
COMMON = ["thee", "thou", "lord", "love", "sweet", "night", "king", "good"]


def population(n: int = 300, seed: int = 0, borderline: int = 0) -> list[list[str]]:
    """n users who each say a few common words and some words of their own; with `borderline`,
    that many words each held by 11 users (the first 11 * borderline), whose weight (11 / sqrt(8)
    = 3.89) is about the threshold at k = 8, sigma 1, delta_vocab 1e-3 (4.01): each passes about
    half the time, so two builds with fresh noise differ."""
    rng = np.random.default_rng(seed)
    users = []
    for u in range(n):
        words = list(rng.choice(COMMON, size=5)) + [f"own{u}x{j}" for j in range(3)]
        if u < 11 * borderline:
            words += [f"edge{u // 11}"] * 2
        users.append([" ".join(words)])
    return users


def with_canary(users: list[list[str]]) -> list[list[str]]:
    return users[:-1] + [users[-1] + [f"{CANARY} {CANARY} {CANARY}"]]


def test_threshold_releases_a_single_users_words_with_probability_delta():
    for k, noise, delta in [(1, 1.0, 1e-7), (16, 2.0, 1e-6), (128, 1.0, 1e-7)]:
        p = VocabularyDP(noise=noise, words_per_user=k, delta=delta)
        one_word = 1 - NormalDist().cdf((p.threshold - p.weight) / noise)
        assert 1 - (1 - one_word) ** k == pytest.approx(delta, rel=1e-6)


def test_canary_word_of_one_client_is_never_released():
    """200 DP builds with fresh noise: the canary is not in any (stated chance <= 1e-7 each)."""
    users = with_canary(population())
    params = VocabularyDP(noise=1.0, words_per_user=8, delta=1e-7)
    hits = common_kept = 0
    for trial in range(200):
        words, info = select_words(words_by_user(users), 64, params, trial.to_bytes(32, "little"))
        hits += CANARY in words
        common_kept += all(w in words for w in COMMON)
        assert not any(w.startswith("own") for w in words)  # nobody else's own words either
    assert hits == 0
    assert common_kept == 200  # each said by ~140 of 300 users: far above the threshold


def test_canary_release_rate_matches_the_stated_probability():
    """With a large delta the canary's release rate is measurable and equals what the
    threshold promises (binomial 4-sigma band), so the threshold is not merely huge."""
    users = with_canary(population(100))
    params = VocabularyDP(noise=1.0, words_per_user=1, delta=0.2)  # k = 1: the stated rate
    trials = 2000
    words = list(words_by_user(users))
    hits = sum(CANARY in select_words(words, 64, params, (7 + i).to_bytes(32, "little"))[0]
               for i in range(trials))
    band = 4 * math.sqrt(trials * 0.2 * 0.8)
    assert abs(hits - 0.2 * trials) < band


def test_the_old_build_leaks_the_canary_and_the_dp_build_does_not(tmp_path):
    """The attack on a whole run: read the shipped tokenizer.json and look for the canary."""
    data = tmp_path / "users.jsonl"
    lines = [{"user": f"u{i}", "text": " ".join(u)} for i, u in enumerate(with_canary(population()))]
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    values = {"data": {"dataset": "jsonl", "path": str(data), "test_fraction": 0.0},
              "tokenizer": {"kind": "word", "vocab_size": 64, "dp_words_per_user": 8}}
    dp = make_tokenizer(parse_config(values), [u for u in with_canary(population())])
    assert CANARY not in dp.words
    values["tokenizer"]["allow_nonprivate_vocabulary"] = True
    old = make_tokenizer(parse_config(values), [u for u in with_canary(population())])
    assert CANARY in old.words  # what this replaces: the canary ships


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from(COMMON + ["a", "b", "c", "d", "e"]), max_size=30),
                min_size=1, max_size=8),
       st.integers(1, 6))
def test_one_user_moves_the_weights_by_at_most_one_in_l2(texts, k):
    """Contribution bounding: adding any user changes the weight vector by L2 norm <= 1."""
    others = list(words_by_user([" ".join(t)] for t in texts[:-1]))
    (added,) = words_by_user([[" ".join(texts[-1])]])
    before, after = dp_word_weights(others, k), dp_word_weights(others + [added], k)
    diff = [after.get(w, 0.0) - before.get(w, 0.0) for w in set(before) | set(after)]
    assert math.sqrt(sum(d * d for d in diff)) <= 1.0 + 1e-12
    assert len(user_words(added, k)) <= k


def test_make_tokenizer_releases_once_and_reloads_on_resume(tmp_path):
    cfg = parse_config({"tokenizer": {"kind": "word", "vocab_size": 64, "dp_words_per_user": 8,
                                      "dp_delta": 1e-3}})  # below 1/300, with words at the threshold
    users = population(borderline=10)
    first = make_tokenizer(cfg, users, tmp_path / "vocabulary")
    again = make_tokenizer(cfg, users, tmp_path / "vocabulary")
    assert again.words == first.words
    assert load_tokenizer(tmp_path / "vocabulary").words == first.words
    fresh = [make_tokenizer(cfg, users).words for _ in range(5)]  # no folder: fresh noise
    assert any(words != first.words for words in fresh)


def test_a_vocabulary_delta_not_below_one_over_n_is_refused_before_any_release(tmp_path):
    """At delta_vocab >= 1/N a word only one user holds may be released and the promise kept, as
    for dp.delta: the build is refused in one line and nothing is written."""
    users = with_canary(population(300))
    loose = parse_config({"tokenizer": {"kind": "word", "vocab_size": 64, "dp_delta": 1 / 300}})
    with pytest.raises(DpfleetError, match=r"^tokenizer.dp_delta = 0.00333333 is not below 1/N = 1/300"):
        make_tokenizer(loose, users, tmp_path / "vocabulary")
    assert not (tmp_path / "vocabulary").exists()
    fine = parse_config({"tokenizer": {"kind": "word", "vocab_size": 64, "dp_delta": 1 / 301}})
    assert CANARY not in make_tokenizer(fine, users, tmp_path / "vocabulary").words


def test_a_vocabulary_and_training_delta_summing_to_one_over_n_are_refused_before_any_release(tmp_path):
    """The run's (eps, delta) is stated at dp.delta + tokenizer.dp_delta: two deltas each below
    1/N may sum past it, where publishing one random user's data keeps the promise. Refused
    before the vocabulary is written; a sum just below 1/N builds it."""
    users = with_canary(population(300))
    tokenizer = {"kind": "word", "vocab_size": 64, "dp_delta": 0.6 / 300}
    loose = parse_config({"tokenizer": tokenizer, "dp": {"delta": 0.4 / 300}})
    with pytest.raises(DpfleetError, match=r"^dp.delta \+ tokenizer.dp_delta = 0.00333333 is not below "
                                           r"1/N = 1/300"):
        make_tokenizer(loose, users, tmp_path / "vocabulary")
    assert not (tmp_path / "vocabulary").exists()
    fine = parse_config({"tokenizer": tokenizer, "dp": {"delta": 0.39 / 300}})
    make_tokenizer(fine, users, tmp_path / "vocabulary")
    assert (tmp_path / "vocabulary" / "dp_vocabulary.json").is_file()


def test_other_releases_deltas_count_towards_one_over_n(tmp_path):
    """A release handed to the run (`other_releases`, e.g. by an API caller) adds its delta to the
    run's: dp.delta + vocabulary + release at or past 1/N is refused before any round."""
    with pytest.raises(DpfleetError, match=r"^dp.delta \+ the DP vocabulary's and other releases' delta = "
                                           r"0.0105 is not below 1/N = 1/96"):
        _tiny_run(tmp_path / "a", other_releases=[{"name": "census", "zcdp": 0.1, "delta": 0.0105 - 1.1e-6}])
    run = tmp_path / "a" / "run"
    assert [(run / f).read_text() for f in ("releases.jsonl", "metrics.jsonl")] == ["", ""]
    result = _tiny_run(tmp_path / "b", other_releases=[{"name": "census", "zcdp": 0.1, "delta": 0.0103}])
    assert result.privacy["total_with_releases"]["delta"] == pytest.approx(0.0103 + 1.1e-6)


def test_nonprivate_vocabulary_is_refused_without_the_flag():
    with pytest.raises(DpfleetError, match="allow_nonprivate_vocabulary"):
        parse_config({"tokenizer": {"kind": "word", "dp_noise": 0.0}})
    parse_config({"tokenizer": {"kind": "word", "dp_noise": 0.0,
                                "allow_nonprivate_vocabulary": True}})
    with pytest.raises(DpfleetError, match="kept no word"):
        build_dp_vocabulary(population(20), 64, VocabularyDP(noise=50.0), bytes(32))


def _tiny_run(tmp_path, mechanism="tree", other_releases=None, **tokenizer):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "users.jsonl"
    lines = [{"user": f"u{i}", "text": " ".join(u)} for i, u in enumerate(population(120, borderline=10))]
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    values = {"rounds": 2, "eval_every": 2, "checkpoint_every": 0,
              "data": {"dataset": "jsonl", "path": str(data), "seq_len": 8, "max_examples": 4,
                       "test_fraction": 0.2},
              "tokenizer": {"kind": "word", "vocab_size": 64, "dp_words_per_user": 8, **tokenizer},
              "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8,
                        "max_length": 8},
              "dp": {"noise_multiplier": 1.0, "clip_norm": 1.0, "report_goal": 4, "mechanism": mechanism}}
    return run_simulation(parse_config(values), tmp_path / "run", progress=False,
                          log=lambda s: None, other_releases=other_releases)


@pytest.mark.parametrize("mechanism", ["tree", "banded", "blt"])
def test_report_composes_the_vocabulary_with_training(tmp_path, mechanism):
    """Attack 3 of issue 31: a banded / BLT run composed the vocabulary with the TREE's zCDP
    (5.5 instead of 2.48) and its report left the vocabulary out; now the run's own mechanism."""
    result = _tiny_run(tmp_path, mechanism)
    total, vocab = result.privacy["total_with_vocabulary"], result.privacy["vocabulary"]
    assert vocab["zcdp"] == pytest.approx(0.5)  # sigma = 1, sensitivity 1
    assert total["zcdp"] == pytest.approx(result.privacy["zcdp"] + 0.5)
    assert total["epsilon"] == pytest.approx(epsilon_from_zcdp(total["zcdp"], 1e-6), rel=1e-6)
    assert total["epsilon"] > result.privacy["epsilon"] + 1.0
    assert total["delta"] == pytest.approx(1e-6 + 1e-7)
    report = (result.run_dir / "privacy_report.md").read_text()
    assert "## Vocabulary (DP partition selection)" in report
    assert f"**{total['epsilon']:.4g}**" in report and f"{result.privacy['epsilon']:.4g}" in report
    assert "without DP" not in report


def test_report_warns_about_a_nonprivate_vocabulary(tmp_path):
    result = _tiny_run(tmp_path, allow_nonprivate_vocabulary=True)
    report = (result.run_dir / "privacy_report.md").read_text()
    head = report.split("## 1.")[0]
    assert "**Warning: the word vocabulary was built from the private training clients" in head
    assert "total_with_vocabulary" not in result.privacy
    assert "**The word vocabulary**" in report.split("## Not covered by the guarantee")[1]


def test_resume_reuses_the_released_vocabulary_and_debug_log(tmp_path):
    """A crash after the vocabulary was built: the resumed run trains on that same vocabulary
    (a rebuild would be a second release with fresh noise) and the debug log is not doubled."""
    from crashes import Crash

    def crash_before_round_2(r, theta):
        if r == 2:
            raise Crash

    data = tmp_path / "users.jsonl"
    lines = [{"user": f"u{i}", "text": " ".join(u)} for i, u in enumerate(population(120, borderline=10))]
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    values = {"rounds": 3, "eval_every": 3, "checkpoint_every": 1, "debug_nonprivate": True,
              "data": {"dataset": "jsonl", "path": str(data), "seq_len": 8, "max_examples": 4,
                       "test_fraction": 0.2},
              "tokenizer": {"kind": "word", "vocab_size": 64, "dp_words_per_user": 8,
                            "dp_delta": 1e-3},  # words at the threshold: two builds would differ
              "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8,
                        "max_length": 8},
              "dp": {"noise_multiplier": 1.0, "clip_norm": 1.0, "report_goal": 4}}
    cfg, out = parse_config(values), tmp_path / "run"
    with pytest.raises(Crash):
        run_simulation(cfg, out, progress=False, log=lambda s: None, before_round=crash_before_round_2)
    released = load_tokenizer(out / "vocabulary").words
    result = run_simulation(cfg, out, resume=True, progress=False, log=lambda s: None)
    assert load_tokenizer(out / "checkpoint" / "tokenizer").words == released
    assert result.privacy["vocabulary"]["kept"] == len(released) - 4  # + pad, bos, eos, unk
    debug = [json.loads(line)["round"] for line in (out / "debug_nonprivate.jsonl").open()]
    assert debug == [1, 2, 3]


def test_budget_counts_the_vocabulary():
    """eps 5 at 1e-6 allows one round at z = 1 (rho 0.5, eps 4.89), not after a vocabulary
    that already spent rho 0.5."""
    from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant

    plain = RunAccountant(1.0, 1e-6, budget_epsilon=5.0)
    spent = RunAccountant(1.0, 1e-6, budget_epsilon=5.0,
                          vocabulary=VocabularyDP(noise=1.0, delta=1e-7).describe())
    assert spent.rho_budget == pytest.approx(plain.rho_budget - 0.5)
    assert not plain.would_exceed(["a"], False)
    assert spent.would_exceed(["a"], False)
