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
