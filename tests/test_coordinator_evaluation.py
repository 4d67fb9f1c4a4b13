import numpy as np
import pytest
import torch

from dpfleet.coordinator.engine.evaluation import accuracy_counts, evaluate, unigram_baseline
from dpfleet.edge.tokenizer import BOS, EOS, PAD, UNK


def one_hot_logits(pred, vocab=10):
    return torch.nn.functional.one_hot(torch.tensor(pred), vocab).float()


def test_accuracy_counts_only_in_vocabulary_targets():
    targets = torch.tensor([[5, 6, UNK, 7, PAD], [EOS, 8, 9, PAD, PAD]])
    preds = [[5, 0, UNK, 4, PAD], [EOS, 8, UNK, 1, 1]]
    # scored: 5,6,7 | 8,9 -> 5 positions; correct: 5 and 8. UNK==UNK and EOS==EOS don't count.
    assert accuracy_counts(one_hot_logits(preds), targets) == (2, 5)


class Fixed(torch.nn.Module):
    """Stands in for a trained LM: always predicts token 5 with prob ~ e/(e+V-1)."""

    def forward(self, tokens):
        logits = torch.zeros(*tokens.shape, 10)
        logits[..., 5] = 1.0
        return logits


def test_evaluate_on_hand_made_rows():
    rows = np.array([[BOS, 5, 5, 6, PAD], [BOS, 5, 7, PAD, PAD]])
    out = evaluate(Fixed(), rows)
    assert out["accuracy"] == pytest.approx(3 / 5)
    p5 = np.e / (np.e + 9)
    p_other = 1 / (np.e + 9)
    expected_loss = -(3 * np.log(p5) + 2 * np.log(p_other)) / 5
    assert out["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert out["perplexity"] == pytest.approx(np.exp(expected_loss), rel=1e-5)


def test_unigram_baseline_predicts_most_frequent_scored_token():
    train = [np.array([[BOS, 4, 4, 4, 9], [BOS, UNK, UNK, UNK, UNK]])]
    test = np.array([[BOS, 4, 9, 9, PAD]])
    out = unigram_baseline(train, test)
    assert out["top_token"] == 4  # UNK is more frequent but never scored
    assert out["accuracy"] == pytest.approx(1 / 3)


def test_evaluate_adds_tffs_three_accuracies():
    # Fixed predicts 5 everywhere; targets 5, 5, 6, EOS | 5, UNK, 4(OOV bucket), PAD
    rows = np.array([[BOS, 5, 5, 6, EOS], [BOS, 5, UNK, 4, PAD]])
    out = evaluate(Fixed(), rows, oov_ids=(UNK, 4))
    assert out["tff_accuracy"] == pytest.approx(3 / 7)  # 7 non-PAD targets, three 5s
    assert out["tff_accuracy_without_out_of_vocab"] == pytest.approx(3 / 5)
    assert out["tff_accuracy_without_out_of_vocab_or_end_of_sentence"] == pytest.approx(3 / 4)
    assert out["accuracy"] == pytest.approx(3 / 4)  # dpfleet's own, unchanged beside them


def test_unigram_baseline_adds_tffs_constant_baselines():
    train = [np.array([[BOS, 4, 4, 4, 9], [BOS, UNK, UNK, UNK, UNK]])]
    test = np.array([[BOS, 4, 9, 9, UNK]])
    out = unigram_baseline(train, test)
    # unigram argmax: UNK (4 of 8 targets); most frequent word: 4
    assert out["tff"]["unigram"]["token"] == UNK
    assert out["tff"]["unigram"]["accuracy"] == pytest.approx(1 / 4)
    assert out["tff"]["unigram"]["accuracy_without_out_of_vocab"] == 0
    assert out["tff"]["most_frequent_word"]["accuracy_without_out_of_vocab"] == pytest.approx(1 / 3)
