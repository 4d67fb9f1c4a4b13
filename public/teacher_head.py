"""The teacher's forward in micro-batches of sequences, its LM head over chunks of positions.

Two things grow with a batch and run a GPU (or a CPU's RAM) out of memory: the LM head's
[tokens x vocab] float32 logits (Gemma-3-270M: 262,144 outputs, 16k tokens: 16 GiB, more with
the copies a softmax makes) and the transformer body's activations. Here a batch (what the
loader hands over: built in numpy, moved in one pinned non-blocking copy on CUDA) is cut into
micro-batches of whole sequences of at most `body_tokens` padded tokens; each runs through the
body, its hidden rows at the kept positions go through the head `chunk_tokens` rows at a time,
and each chunk is reduced at once to what the job keeps (top-k, log-sum-exp, target log-prob,
student-space log-masses). Peak memory is therefore set by `body_tokens` and `chunk_tokens`
alone, whatever the batch size: only the reduced rows (a few values per token) grow with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from dpfleet.public.teacher import Teacher

DEFAULT_CHUNK_TOKENS = 2048
CPU_BODY_TOKENS = 1024  # on CPU larger body passes only add memory (benchmarks/public_topk.py --scaling)
DEFAULT_BATCH_TOKENS = 16_384  # per host copy; memory does not depend on it


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


def micro_batches(lengths: np.ndarray, body_tokens: int) -> list[slice]:
    """Consecutive row ranges whose padded size (rows x their longest) is at most `body_tokens`;
    a single sequence longer than that is a micro-batch of its own (attention needs it whole)."""
    if body_tokens < 1:
        raise ValueError("body_tokens must be positive")
    spans, first, longest = [], 0, 0
    for row, length in enumerate(lengths.tolist()):
        if row > first and (row - first + 1) * max(longest, length) > body_tokens:
            spans.append(slice(first, row))
            first, longest = row, 0
        longest = max(longest, length)
    if len(lengths):
        spans.append(slice(first, len(lengths)))
    return spans


@torch.inference_mode()
def reduce_batch(teacher: Teacher, inputs: np.ndarray, mask: np.ndarray,
                 reduce: Callable[..., tuple], body_tokens: int,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, *extra: np.ndarray,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple:
    """`reduce(logits_chunk, *extra_chunk)` over every kept (`mask`) position of a right-padded
    numpy batch, in row-major order, its outputs concatenated along rows.

    `extra` arrays have the batch's shape and travel in the same single copy as the ids and
    the mask. The body sees at most `body_tokens` padded positions at a time (micro-batches of
    whole sequences, each trimmed to its own longest), the head at most `chunk_tokens` rows.
    `head` replaces `teacher.head` (the int8 screen hands `reduce` the hidden rows themselves).
    """
    lengths = mask.sum(1)
    both = to_device(np.stack([inputs, mask.astype(np.int64), *extra]), teacher.device)
    parts = []
    for rows in micro_batches(lengths, body_tokens):
        block = both[:, rows, : int(lengths[rows].max())]
        kept = block[1].bool()
        hidden = teacher.body(block[0], block[1])[kept]
        parts.append(reduce_head(teacher, hidden, reduce, chunk_tokens,
                                 *(e[kept] for e in block[2:]), head=head))
        del hidden, block, kept  # the next micro-batch reuses this memory
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


@torch.inference_mode()
def reduce_head(teacher: Teacher, hidden: torch.Tensor, reduce: Callable[..., tuple],
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, *extra: torch.Tensor,
                head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple:
    """Apply `reduce(head(hidden_chunk), *extra_chunk)` over `chunk_tokens` rows at a time
    (`head`: the teacher's float32 head unless given) and concatenate each of its outputs along
    rows. `extra` tensors are row-aligned with `hidden` and sliced like it."""
    head = teacher.head if head is None else head
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be positive")
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        parts.append(reduce(head(hidden[start:stop]), *(e[start:stop] for e in extra)))
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


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


def resolve_batch_tokens(batch_tokens: int, body_tokens: int) -> int:
    """`batch_tokens` (tokens per loader batch), or (when 0) the larger of 16,384 and one body
    pass, so a GPU's micro-batches are never cut short by the loader."""
    if batch_tokens < 0:
        raise ValueError("batch_tokens must be >= 0 (0: automatic)")
    return batch_tokens or max(DEFAULT_BATCH_TOKENS, body_tokens)


def resolve_body_tokens(teacher: Teacher, body_tokens: int, chunk_tokens: int) -> int:
    """`body_tokens`, or (when 0) a size chosen from the free accelerator memory."""
    if body_tokens < 0:
        raise ValueError("body_tokens must be >= 0 (0: from free memory)")
    return body_tokens or auto_body_tokens(teacher, chunk_tokens)


def auto_body_tokens(teacher: Teacher, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     seq_len: int = 128, fraction: float = 0.5, cap: int = 1 << 16) -> int:
    """Tokens per body pass from the accelerator's free memory (CUDA), else 1,024."""
    if teacher.device.type != "cuda":
        return CPU_BODY_TOKENS
    free, _ = torch.cuda.mem_get_info(teacher.device)
    cfg = getattr(teacher.model.config, "get_text_config", lambda: teacher.model.config)()
    element = next(teacher.model.get_decoder().parameters()).element_size()
    return body_tokens_for_memory(cfg, element, teacher.vocab_size, free, chunk_tokens,
                                  seq_len, fraction, cap)


def body_tokens_for_memory(cfg, element_size: int, vocab_size: int, free_bytes: int,
                           chunk_tokens: int, seq_len: int = 128, fraction: float = 0.5,
                           cap: int = 1 << 16) -> int:
    """The body pass that fits `fraction` of `free_bytes`, within [256, cap] tokens.

    Without autograd the body keeps about one layer's activations: per token the residual
    stream, the attention projections and the MLP's gate/up/down (~(6 h + 3 i) values, in the
    body's dtype), plus eager attention's heads x seq_len scores, plus the float32 hidden row
    handed to the head. The head chunk (chunk x vocab float32, twice for the reductions'
    temporaries) is a fixed cost taken off first.
    """
    hidden = int(getattr(cfg, "hidden_size", 1024))
    inner = int(getattr(cfg, "intermediate_size", 4 * hidden))
    heads = int(getattr(cfg, "num_attention_heads", 8))
    per_token = (6 * hidden + 3 * inner + heads * seq_len) * element_size + 4 * hidden
    budget = fraction * free_bytes - 2 * chunk_tokens * vocab_size * 4
    return int(min(cap, max(256, budget // per_token)))
