"""The field's metrics on hand-computed examples: TFF's three accuracies (PAD, OOV buckets and EOS
targets), the two constant baselines, strip recall and keystroke savings."""

import numpy as np
import pytest

from dpfleet.coordinator.engine.field_metrics import (
    constant_baselines,
    keystroke_savings,
    strip_recall,
    tff_accuracies,
    tff_counts,
    word_cases,
)
from dpfleet.edge.tokenizer import split_words

OOV = (3, 4)  # two OOV buckets; EOS = 2, PAD = 0
TARGETS = np.array([[5, 6, 3, 2, 0, 0],
                    [7, 4, 5, 2, 0, 0]])
PREDICTIONS = np.array([[5, 3, 3, 2, 5, 0],  # 6 predicted as OOV: wrong; 5 at a PAD: not scored
                        [6, 4, 5, 2, 0, 0]])


def test_tff_three_accuracies_by_hand():
    # non-PAD: 8 targets, right: 5, 3(OOV), 2(EOS) | 4(OOV), 5, 2(EOS) = 6
    # without OOV: drop 3 and 4 (both right): 4 of 6; without OOV or EOS: drop both EOS: 2 of 4
    counts = tff_counts(PREDICTIONS, TARGETS, OOV)
    assert counts.tolist() == [[6, 8], [4, 6], [2, 4]]
    assert tff_accuracies(counts) == {
        "tff_accuracy": 0.75, "tff_accuracy_without_out_of_vocab": 4 / 6,
        "tff_accuracy_without_out_of_vocab_or_end_of_sentence": 0.5}
    assert tff_accuracies(np.zeros((3, 2)))["tff_accuracy"] is None


def test_constant_baselines_by_hand():
    train = [np.array([[5, 5, 2, 2, 2, 0], [3, 3, 3, 3, 6, 0]])]
    # unigram argmax over non-PAD targets: OOV bucket 3 (4 times); most frequent word: 5 (twice)
    out = constant_baselines(train, TARGETS, OOV)
    assert out["unigram"] == {"token": 3, "accuracy": 1 / 8, "accuracy_without_out_of_vocab": 0.0,
                              "accuracy_without_out_of_vocab_or_end_of_sentence": 0.0}
    assert out["most_frequent_word"] == {
        "token": 5, "accuracy": 2 / 8, "accuracy_without_out_of_vocab": 2 / 6,
        "accuracy_without_out_of_vocab_or_end_of_sentence": 2 / 4}


def test_strip_recall_by_hand():
    strips = {"": ["the", "a", "i"], "the ": ["dog", "cat", "end"], "the cat ": ["ran", "is"],
              "the cat sat ": ["on"]}
    cases = [("", "the"), ("the ", "cat"), ("the cat ", "sat"), ("the cat sat ", "On")]
    assert strip_recall(cases, lambda c: strips.get(c, [])) == {
        "top1_recall": 2 / 4, "top3_recall": 3 / 4, "words": 4}


def test_keystroke_savings_by_hand():
    strips = {"": ["the"], "the ": ["dog"], "the c": ["car", "cup", "cow"], "the ca": ["cat"],
              "the cat s": ["sun", "see", "so", "sat"]}  # "sat" in a 4th slot: not shown
    cases = [("", "the"), ("the ", "cat"), ("the cat ", "sat")]
    # "the" before any key: 3 saved; "cat" after "ca": 1 saved; "sat" never shown: 0 -> 4 of 9
    assert keystroke_savings(cases, lambda c: strips.get(c, [])) == {
        "keystroke_savings": 4 / 9, "characters": 9, "characters_saved": 4}


def test_word_cases_skip_punctuation_and_stop_at_limit():
    cases = word_cases(["The cat, sat.", "Go"], split_words, limit=5)
    assert cases == [("", "the"), ("the ", "cat"), ("the cat , ", "sat"), ("", "go")]
    assert word_cases(["a b c"], split_words, limit=2) == [("", "a"), ("a ", "b")]


@pytest.mark.parametrize("fn", [strip_recall, keystroke_savings])
def test_no_cases_is_none_not_a_division_by_zero(fn):
    assert next(iter(fn([], lambda c: []).values())) is None


def test_the_result_block_states_the_tff_accuracies_by_hand():
    """The hand-computed figures above, as the result block prints them: the model's (0.75, 4/6,
    0.5) next to the unigram's (1/8, 0, 0) and the most frequent word's (2/8, 2/6, 2/4); a run
    without them (an older summary) has no such line."""
    from dpfleet.coordinator.cli.result_block import result_lines

    train = [np.array([[5, 5, 2, 2, 2, 0], [3, 3, 3, 3, 6, 0]])]
    final = {"accuracy": 0.5, "perplexity": 3.0, **tff_accuracies(tff_counts(PREDICTIONS, TARGETS, OOV))}
    baseline = {"accuracy": 0.1, "perplexity": 9.0, "tff": constant_baselines(train, TARGETS, OOV)}
    privacy = {"min_separation": None, "epsilon": 1.0, "delta": 1e-5, "zcdp": 0.1,
               "noise_multiplier": 1.0, "max_participation": 1, "noise_mechanism": "tree"}
    common = dict(privacy=privacy, warnings=[], stopped_early=None, run_dir="run")
    lines = result_lines(final=final, baseline=baseline, **common)
    (line,) = [r for r in lines if r.startswith("TFF next-word acc.")]
    assert line.endswith("model 0.7500 / 0.6667 / 0.5000   unigram 0.1250 / 0.0000 / 0.0000   "
                         "most frequent word 0.2500 / 0.3333 / 0.5000")
    assert any(r.strip().startswith("(TFF: accuracy / without out of vocab / without out of vocab or "
                                    "end of sentence") for r in lines)
    older = result_lines(final={"accuracy": 0.5, "perplexity": 3.0},
                         baseline={"accuracy": 0.1, "perplexity": 9.0}, **common)
    assert not [r for r in older if "TFF" in r]
