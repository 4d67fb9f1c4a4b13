"""L_KD and L_pub against hand computations (paper 000 Sec. 4.1)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.public.kd import kd_loss, public_loss

INF = float("inf")


def _logsumexp(xs):
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def _batch():
    """One sequence of 4 positions over a 4-token vocabulary, k = 3.

    position 0: full teacher row; position 1: one empty slot; position 2: an empty teacher
    row (nothing to distill); position 3: padding with garbage that must be ignored.
    """
    student = torch.tensor([[[1.0, 2.0, 0.0, -1.0],
                             [0.5, -0.5, 3.0, 1.0],
                             [2.0, 1.0, 0.0, 0.0],
                             [9.0, -9.0, 9.0, -9.0]]])
    ids = torch.tensor([[[1, 0, 3], [2, 1, 0], [0, 0, 0], [3, 2, 1]]])
    logits = torch.tensor([[[0.0, -2.0, -3.0], [0.0, -0.5, -INF],
                            [-INF, -INF, -INF], [0.0, -1.0, -2.0]]])
    targets = torch.tensor([[1, 2, 3, 0]])
    return student, ids, logits, targets


def _hand_kd(student, ids, logits, positions, t):
    total = 0.0
    for pos in positions:
        z_s = [v / t for v in student[0, pos].tolist()]
        z_t = [v / t for v in logits[0, pos].tolist()]
        finite = [j for j, v in enumerate(z_t) if v > -INF]
        lse_t = _logsumexp([z_t[j] for j in finite])
        lse_s = _logsumexp(z_s)
        total -= sum(
            math.exp(z_t[j] - lse_t) * (z_s[ids[0, pos, j].item()] - lse_s) for j in finite
        )
    return total / len(positions)


@pytest.mark.parametrize("t", [1.0, 2.0, 0.5])
def test_kd_loss_matches_hand_computation(t):
    student, ids, logits, targets = _batch()
    got = kd_loss(student, ids, logits, targets != 0, temperature=t)
    # position 2 has no teacher entries and position 3 is padding: only 0 and 1 count
    assert got.item() == pytest.approx(_hand_kd(student, ids, logits, [0, 1], t), rel=1e-6)


def test_kd_at_t1_first_position_by_hand():
    student, ids, logits, targets = _batch()
    mask = torch.tensor([[True, False, False, False]])
    p = [math.exp(0) / (1 + math.exp(-2) + math.exp(-3)),
         math.exp(-2) / (1 + math.exp(-2) + math.exp(-3)),
         math.exp(-3) / (1 + math.exp(-2) + math.exp(-3))]
    log_z = math.log(math.e + math.e**2 + 1 + math.e**-1)
    expected = -(p[0] * (2 - log_z) + p[1] * (1 - log_z) + p[2] * (-1 - log_z))
    assert kd_loss(student, ids, logits, mask).item() == pytest.approx(expected, rel=1e-6)


def test_public_loss_is_lm_plus_beta_kd_with_pad_masking():
    student, ids, logits, targets = _batch()
    total, lm, kd = public_loss(student, targets, ids, logits, beta=0.1, pad_id=0)
    lm_hand = sum(
        _logsumexp(student[0, pos].tolist()) - student[0, pos, targets[0, pos]].item()
        for pos in range(3)
    ) / 3
    assert lm.item() == pytest.approx(lm_hand, rel=1e-6)
    assert kd.item() == pytest.approx(_hand_kd(student, ids, logits, [0, 1], 1.0), rel=1e-6)
    assert total.item() == pytest.approx(lm_hand + 0.1 * kd.item(), rel=1e-6)


def test_padding_and_empty_rows_get_no_gradient():
    student, ids, logits, targets = _batch()
    student.requires_grad_(True)
    kd_loss(student, ids, logits, targets != 0).backward()
    assert torch.isfinite(student.grad).all()
    assert (student.grad[0, 2:] == 0).all()
    assert (student.grad[0, :2] != 0).any()


def test_all_masked_is_zero_not_nan():
    student, ids, logits, _ = _batch()
    got = kd_loss(student, ids, logits, torch.zeros(1, 4, dtype=torch.bool))
    assert got.item() == 0.0


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.25, 4.0))
def test_kd_is_minimised_by_the_teacher_distribution(seed, t):
    """Cross-entropy >= entropy, with equality when the student equals the teacher on top-k."""
    gen = torch.Generator().manual_seed(seed)
    vocab, k = 12, 4
    ids = torch.randperm(vocab, generator=gen)[:k].view(1, 1, k)
    teacher = torch.randn(k, generator=gen).sort(descending=True).values
    rel = (teacher - teacher[0]).view(1, 1, k)
    mask = torch.ones(1, 1, dtype=torch.bool)
    student = torch.randn(1, 1, vocab, generator=gen) * 3
    p = torch.softmax(rel / t, -1)
    entropy = -(p * p.log()).sum()
    assert kd_loss(student, ids, rel, mask, t).item() >= entropy.item() - 1e-5
    # the student that puts the teacher's tempered top-k distribution on those ids (and
    # next to nothing elsewhere) reaches the entropy
    ideal = torch.full((1, 1, vocab), -1e4)
    ideal[0, 0, ids[0, 0]] = rel[0, 0]
    assert kd_loss(ideal, ids, rel, mask, t).item() == pytest.approx(entropy.item(), abs=1e-4)
