"""The public-training loss with distillation: L_pub = L_LM + beta * L_KD (paper 000 Sec. 4.1).

L_KD = CE(z_S / t, z_T / t) at each non-pad position, where the teacher's logits z_T exist only
on its top-k (mapped into the student vocabulary; public/topk.py):

    p_j = softmax_j(z_T,j / t) over the teacher's top-k entries j (the teacher has zero mass
          elsewhere),
    L_KD = - sum_j p_j * log softmax(z_S / t)[id_j]

The student's log-probabilities are normalised over its *whole* vocabulary, so the loss also
pushes mass off tokens outside the teacher's top-k (renormalising the student over the top-k
would only match ratios inside it). No t^2 factor is applied: the paper uses t = 1 and tunes
beta in {1e-1, 1e-2, 1e-3} directly. Positions whose target is pad, or whose teacher row is
empty, count neither in the sum nor in the mean.
"""

from __future__ import annotations

import torch

from dpfleet.export.models import next_token_loss


def kd_loss(
    student_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logits: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean over masked-in positions of CE(teacher top-k at t, student at t).

    student_logits [B, T, V]; topk_ids [B, T, k] (student ids); topk_logits [B, T, k] with -inf
    in empty slots; mask [B, T] bool.
    """
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    mask = mask & torch.isfinite(topk_logits).any(-1)
    teacher_p = torch.softmax(topk_logits[mask] / temperature, dim=-1)
    student_logp = torch.log_softmax(student_logits[mask] / temperature, dim=-1)
    picked = student_logp.gather(-1, topk_ids[mask])
    # empty slots have p = 0; keep 0 * log p finite even where the student's log p is -inf
    per_position = -(teacher_p * picked.masked_fill(teacher_p == 0, 0.0)).sum(-1)
    return per_position.sum() / mask.sum().clamp_min(1)


def public_loss(
    student_logits: torch.Tensor,
    targets: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logits: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(L_pub, L_LM, L_KD) with L_pub = L_LM + beta * L_KD, pad targets masked out of both."""
    lm = next_token_loss(student_logits, targets, pad_id)
    kd = kd_loss(student_logits, topk_ids, topk_logits, targets != pad_id, temperature)
    return lm + beta * kd, lm, kd
