"""The teacher's LM head over chunks of token positions, each chunk reduced at once.

The LM head dominates a small teacher (Gemma-3-270M: 262,144 outputs, 640 inputs), and its full
[tokens x vocab] float32 logits are what runs a GPU out of memory (16k tokens: 16 GiB, more with
the copies a softmax makes). Here the transformer body runs once per batch, its hidden rows at
the kept positions are taken, and the head runs on `chunk_tokens` rows at a time; each chunk is
reduced straight away to what the job keeps (top-k, log-sum-exp, target log-prob, student-space
log-masses), so peak memory is chunk_tokens x vocab floats whatever the batch size.

Batches are built in numpy (ids and mask stacked in one array) and moved in one pinned,
non-blocking copy on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from dpfleet.public.teacher import Teacher

DEFAULT_CHUNK_TOKENS = 2048
CPU_BATCH_TOKENS = 1024  # on CPU larger batches only add memory (benchmarks/public_topk.py --scaling)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host-to-device copy (pinned and non-blocking on CUDA)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def right_padded(rows: Sequence[Sequence[int]], fill: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int64 [len(rows), longest] built in numpy: rows left-aligned, `fill` after."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max())
    mask = np.arange(width)[None, :] < lengths[:, None]
    ids = np.full(mask.shape, fill, dtype=np.int64)
    ids[mask] = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    return ids, mask


def kept_hidden(teacher: Teacher, inputs: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    """Hidden rows [kept positions, hidden] of the body over a right-padded numpy batch,
    in row-major order of `mask` (sequence by sequence)."""
    both = to_device(np.stack([inputs, mask.astype(np.int64)]), teacher.device)
    hidden = teacher.body(both[0], both[1])
    return hidden[both[1].bool()]


@torch.no_grad()
def reduce_head(teacher: Teacher, hidden: torch.Tensor, reduce: Callable[..., tuple],
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, *extra: torch.Tensor) -> tuple:
    """Apply `reduce(logits_chunk, *extra_chunk)` to the head over `chunk_tokens` rows at a
    time and concatenate each of its outputs along rows. `extra` tensors are row-aligned
    with `hidden` and sliced like it."""
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be positive")
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        parts.append(reduce(teacher.head(hidden[start:stop]), *(e[start:stop] for e in extra)))
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


def topk_reduce(k: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Teacher-space top-k (values, ids) of each row."""
    return lambda logits: logits.topk(k, dim=-1)


def target_logprob(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
    """log p(target) of each row: its logit minus the row's log-sum-exp (no softmax copy)."""
    picked = logits.gather(-1, targets[:, None]).squeeze(-1)
    return (picked - torch.logsumexp(logits, dim=-1),)


def student_space_reduce(t2s: torch.Tensor, student_vocab: int, k: int):
    """Top-k of the teacher distribution pushed into the student vocabulary.

    Every teacher id with `t2s >= 0` sends its probability mass to student id `t2s`; the
    student row is log(sum of those masses) + the row's max logit, so entries are on the
    teacher-logit scale like the teacher-space top-k (only differences are ever used). Ids no
    teacher id maps to are -inf; a row with fewer than k reachable ids has id PAD (0) and -inf
    in the empty slots, and a row where nothing is reachable is all -inf, never NaN. On CUDA
    the scatter adds atomically, so the last bits of a sum may vary between runs.
    """
    if not 1 <= k <= student_vocab:
        raise ValueError("k must be in [1, student vocabulary]")
    dump = torch.where(t2s >= 0, t2s, torch.full_like(t2s, student_vocab))  # column dropped below

    def reduce(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = logits.masked_fill(dump == student_vocab, float("-inf")).amax(-1, keepdim=True)
        shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        mass = torch.exp(logits - shift)  # the chunk's one [rows, vocab] temporary
        space = logits.new_zeros(logits.shape[0], student_vocab + 1).index_add_(1, dump, mass)
        values, ids = (space[:, :student_vocab].log() + shift).topk(k, dim=-1)
        empty = torch.isneginf(values)
        return ids.masked_fill(empty, 0), values

    return reduce


def resolve_batch_tokens(teacher: Teacher, batch_tokens: int, chunk_tokens: int) -> int:
    """`batch_tokens`, or (when 0) a size chosen from the free accelerator memory."""
    if batch_tokens < 0:
        raise ValueError("batch_tokens must be >= 0 (0: from free memory)")
    return batch_tokens or auto_batch_tokens(teacher, chunk_tokens)


def auto_batch_tokens(teacher: Teacher, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                      seq_len: int = 128, fraction: float = 0.5, cap: int = 1 << 16) -> int:
    """A batch size in tokens from the accelerator's free memory (CUDA), else 1,024.

    Without autograd the body keeps about one layer's activations: per token the residual
    stream, the attention projections and the MLP's gate/up/down (~(6 h + 3 i) values, in the
    body's dtype), plus eager attention's heads x seq_len scores. The head chunk (chunk x vocab
    float32, twice for the reductions' temporaries) is a fixed cost taken off first.
    """
    if teacher.device.type != "cuda":
        return CPU_BATCH_TOKENS
    cfg = getattr(teacher.model.config, "get_text_config", lambda: teacher.model.config)()
    hidden = int(getattr(cfg, "hidden_size", 1024))
    inner = int(getattr(cfg, "intermediate_size", 4 * hidden))
    heads = int(getattr(cfg, "num_attention_heads", 8))
    size = next(teacher.model.parameters()).element_size()
    per_token = (6 * hidden + 3 * inner + heads * seq_len) * size + 4 * hidden
    free, _ = torch.cuda.mem_get_info(teacher.device)
    budget = fraction * free - 2 * chunk_tokens * teacher.vocab_size * 4
    return int(min(cap, max(256, budget // per_token)))
