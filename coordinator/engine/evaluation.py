"""Next-token accuracy and perplexity on held-out clients, and the unigram baseline.

Accuracy follows paper 000 Sec. 3.1, "in-vocabulary next token prediction accuracy":
    accuracy = #{positions whose target is a real in-vocabulary token and argmax(logits) == target}
               / #{positions whose target is a real in-vocabulary token}
where "real in-vocabulary" excludes PAD, BOS, EOS and UNK (the word baseline's OOV token, and
the other OOV buckets of a vocabulary that has several). A
prediction *of* a special token counts as wrong. With a byte-fallback SentencePiece vocabulary
there is no OOV, so every non-pad target counts. Loss / perplexity average the cross-entropy over
all non-pad targets (OOV included: the model must still assign it probability).

Beside it, additively, TFF's three next-word accuracies (`tff_accuracy`,
`tff_accuracy_without_out_of_vocab`, `tff_accuracy_without_out_of_vocab_or_end_of_sentence`:
field_metrics.py), comparable to the StackOverflow papers' numbers with a word vocabulary, and the
unigram / most-frequent-word baselines scored the same way (`unigram_baseline(...)["tff"]`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from dpfleet.coordinator.engine.field_metrics import constant_baselines, tff_accuracies, tff_counts
from dpfleet.edge.client_data import ClientData, held_out_count
from dpfleet.edge.model_output import logits_of
from dpfleet.edge.tokenizer import BOS, EOS, PAD, UNK
from dpfleet.errors import DpfleetError

SPECIAL_IDS = (PAD, BOS, EOS, UNK)


def scored_mask(targets: torch.Tensor, oov_ids: Sequence[int] = (UNK,)) -> torch.Tensor:
    """The real in-vocabulary targets: not PAD, BOS, EOS nor any OOV bucket."""
    mask = torch.ones_like(targets, dtype=torch.bool)
    for sid in {*SPECIAL_IDS, *oov_ids}:
        mask &= targets != sid
    return mask


def accuracy_counts(logits: torch.Tensor, targets: torch.Tensor,
                    oov_ids: Sequence[int] = (UNK,)) -> tuple[int, int]:
    """(correct, scored) next-token counts for one batch (see module docstring)."""
    mask = scored_mask(targets, oov_ids)
    correct = (logits.argmax(-1) == targets) & mask
    return int(correct.sum()), int(mask.sum())


@torch.no_grad()
def evaluate(model: nn.Module, rows: np.ndarray, batch_size: int = 256,
             oov_ids: Sequence[int] = (UNK,)) -> dict:
    """Accuracy, loss and perplexity of `model` on example rows [n, L+1], and TFF's three
    accuracies with `oov_ids` (the tokenizer's OOV buckets) masked as TFF masks them."""
    model.eval()
    correct = scored = 0
    tff = np.zeros((3, 2), dtype=np.int64)
    nll_sum, nll_count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = torch.from_numpy(rows[start : start + batch_size].astype(np.int64))
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = logits_of(model(inputs))
        c, s = accuracy_counts(logits, targets, oov_ids)
        correct, scored = correct + c, scored + s
        tff += tff_counts(logits.argmax(-1).cpu().numpy(), targets.numpy(), oov_ids)
        nonpad = targets != PAD
        logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        nll_sum += float(-(logp * nonpad).sum())
        nll_count += int(nonpad.sum())
    loss = nll_sum / max(nll_count, 1)
    return {
        "accuracy": correct / max(scored, 1),
        "loss": loss,
        "perplexity": float(np.exp(min(loss, 50.0))),
        "scored_tokens": scored,
        **tff_accuracies(tff),
    }


def unigram_baseline(train_rows: Iterable[np.ndarray], test_rows: np.ndarray,
                     oov_ids: Sequence[int] = (UNK,)) -> dict:
    """Always predict the most frequent scored training token; its test accuracy and the
    perplexity of the add-one unigram distribution: the bar any real model must clear. `tff`:
    TFF's three accuracies of the unigram argmax and of the most frequent word
    (`field_metrics.constant_baselines`)."""
    counts: dict[int, int] = {}
    seen = []
    for rows in train_rows:
        seen.append(rows[:, 1:])
        ids, n = np.unique(rows[:, 1:], return_counts=True)
        for i, c in zip(ids.tolist(), n.tolist(), strict=True):
            counts[i] = counts.get(i, 0) + c
    special = [*SPECIAL_IDS, *oov_ids]
    scored = {i: c for i, c in counts.items() if i not in special}
    top = max(scored, key=scored.get)
    targets = test_rows[:, 1:]
    mask = ~np.isin(targets, special)
    acc = float(((targets == top) & mask).sum() / max(mask.sum(), 1))
    nonpad_counts = {i: c for i, c in counts.items() if i != PAD}
    total = sum(nonpad_counts.values())
    vocab = max(max(counts) + 1, int(targets.max()) + 1)
    test_ids = targets[targets != PAD]
    probs = np.array([(nonpad_counts.get(int(i), 0) + 1) / (total + vocab) for i in test_ids])
    loss = float(-np.log(probs).mean()) if len(probs) else float("nan")
    return {"accuracy": acc, "top_token": int(top), "loss": loss, "perplexity": float(np.exp(loss)),
            "tff": constant_baselines(seen, targets, oov_ids)}


HELD_OUT_NEEDED = 2  # one held-out user to score, one to fit the unigram baseline on


def fewest_users(test_fraction: float) -> int | None:
    """The fewest users of which `test_fraction` holds out HELD_OUT_NEEDED and leaves one to train
    (None when no number does: a fraction of 0)."""
    if test_fraction <= 0:
        return None
    users = HELD_OUT_NEEDED + 1
    while (held := held_out_count(users, test_fraction)) < HELD_OUT_NEEDED or held >= users:
        users += 1
    return users


def too_few_held_out(held_out: int, test_fraction: float | None) -> str:
    """The error for a run with fewer than HELD_OUT_NEEDED held-out users, with what would help:
    held-out users are whole users, so it is more users (or a larger fraction), never fewer."""
    head = (f"the held-out evaluation needs at least {HELD_OUT_NEEDED} held-out users with text (one "
            f"to score, one to fit the unigram baseline on) and this run has {held_out}")
    if test_fraction is None:
        return head
    fewest = fewest_users(test_fraction)
    if fewest is None:
        return (f"{head}: data.test_fraction = 0 holds out no user; set it above 0 (0.1 needs at "
                f"least {fewest_users(0.1)} users)")
    return (f"{head}: data.test_fraction = {test_fraction:g} holds out round(users x "
            f"{test_fraction:g}) whole users, so give at least {fewest} users with text (with "
            f"fewer, from {HELD_OUT_NEEDED + 1} up, a larger data.test_fraction holds out more of them)")


def split_held_out(test: Sequence[ClientData], limit: int | None,
                   test_fraction: float | None = None) -> tuple[np.ndarray, list]:
    """(evaluation rows, the held-out clients the unigram baseline is fitted on), from disjoint
    held-out users: the baseline must not be fitted on training clients (that is private data
    outside the guarantee) nor on the rows it is scored on.

    The evaluation rows are the first `limit` rows of the held-out clients, in order (as
    before); the baseline uses the held-out clients none of whose rows are scored. When the
    evaluation takes every held-out client, the clients are split in two: the first half
    (rounded up) is scored, the second half fits the baseline. `test_fraction` (the config's)
    makes the error for too few held-out users say how many users would do.
    """
    if len(test) < HELD_OUT_NEEDED:
        raise DpfleetError(too_few_held_out(len(test), test_fraction))
    sizes = np.cumsum([len(c.examples) for c in test])
    n_eval = int(np.searchsorted(sizes, limit) + 1) if limit else len(test)
    if n_eval >= len(test):
        n_eval, limit = (len(test) + 1) // 2, None
    rows = np.concatenate([c.examples for c in test[:n_eval]])
    return (rows[:limit] if limit else rows), list(test[n_eval:])
