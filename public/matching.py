"""Distribution matching (paper 000 Sec. 5, Algorithm 1 steps 2-3, with App. D.3's weighting).

Each public record x gets two average token log-probabilities: l_priv(x) under the on-device LM
of the first DP-FTRL stage (a DP checkpoint, so scoring is post-processing and costs no privacy)
and l_pub(x) under the public teacher LLM. Records are ranked by

    h_beta(x) = (1 - beta) * l_pub(x) + beta * l_priv(x)

and the top q are kept. beta = 0.5 is the paper's h (the sum, halved); beta = 1 is the
l_priv-only ablation of Table 3. App. D shows the mixture's squared error is
beta^2 d^2 + (1 - beta)^2 sigma^2 (d: public-private shift of l_pub, sigma: the DP model's
noise), so neither extreme is best when both are comparable.

A pool is a list of records, each cut to its first `seq_len` tokens of the on-device vocabulary,
with the name of the source it came from, so one can report where the selection came from.

Both models score the same *text* (the decoded record), each in its own tokenization. The
teacher must read its canonical segmentation: fed the trimmed on-device pieces, which split most
rare words in ways it never saw in training, it finds every source about equally improbable
(per-token PPL ~1000) and l_pub stops telling styles apart. Normalisation: the teacher's total
log-likelihood of the text is divided by the record's number of *on-device* tokens, the same
denominator as l_priv. The numerator no longer depends on any segmentation, and both scores are
nats per on-device token of one string, so App. D.3's beta weighs like with like (per character
would do the first but put l_pub and l_priv on different scales).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpfleet.edge.datasets import load_records
from dpfleet.edge.tokenizer import BOS, PAD, Tokenizer
from dpfleet.errors import DpfleetError
from dpfleet.progress import progress_bar
from dpfleet.public.teacher_head import (
    reduce_batch,
    resolve_batch_tokens,
    right_padded,
    target_logprob,
)
from dpfleet.public.teacher_tokenizer import load_teacher_spm, processor
from dpfleet.public.topk import TopKExtractor, token_batches


@dataclass
class Pool:
    sequences: list[list[int]]  # student ids, one sequence per record
    sources: list[str]  # the dataset each record came from
    texts: list[str]

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for seq, src in zip(self.sequences, self.sources, strict=True):
            digest.update(np.asarray(seq, dtype=np.int32).tobytes() + src.encode() + b"\0")
        return digest.hexdigest()[:16]

    def save(self, path: Path) -> None:
        np.savez(path, tokens=np.concatenate([np.asarray(s, np.int32) for s in self.sequences]),
                 lengths=np.array([len(s) for s in self.sequences]), sources=np.array(self.sources),
                 texts=np.array(self.texts))


def build_pool(sources: Sequence[str], counts: Sequence[int], tokenizer: Tokenizer, seq_len: int,
               seed: int = 0, min_tokens: int = 4) -> Pool:
    """`counts[i]` random records of dataset `sources[i]` (train split), each as its first
    `seq_len` tokens; records shorter than `min_tokens` are skipped."""
    if len(sources) != len(counts) or not sources:
        raise DpfleetError("pool.sources and pool.records must be lists of the same length")
    pool = Pool([], [], [])
    for source, count in zip(sources, counts, strict=True):
        records = load_records(source, "train")
        order = list(range(len(records)))
        random.Random(f"{seed}/{source}").shuffle(order)
        taken = 0
        for i in order:
            if taken == count:
                break
            ids = tokenizer.encode(records[i].text)[:seq_len]
            if len(ids) >= min_tokens:
                pool.sequences.append(ids)
                pool.sources.append(source)
                pool.texts.append(records[i].text)
                taken += 1
        if taken < count:
            raise DpfleetError(f"{source} has only {taken} records of >= {min_tokens} tokens")
    return pool


@torch.no_grad()
def student_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                     batch_size: int = 256) -> np.ndarray:
    """Average token log-probability of each sequence under the on-device LM (BOS-prefixed)."""
    model.eval()
    out = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(map(len, chunk))
        rows = torch.full((len(chunk), width + 1), PAD, dtype=torch.long)
        rows[:, 0] = BOS
        for b, s in enumerate(chunk):
            rows[b, 1 : 1 + len(s)] = torch.as_tensor(s)
        targets = rows[:, 1:]
        logp = torch.log_softmax(model(rows[:, :-1]).float(), -1)
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        mask = targets != PAD
        out.append(((picked * mask).sum(1) / mask.sum(1)).numpy())
    return np.concatenate(out) if out else np.zeros(0)


@torch.no_grad()
def teacher_logprobs(extractor: TopKExtractor, tokenizer: Tokenizer,
                     sequences: Sequence[Sequence[int]], batch_tokens: int = 0,
                     progress: bool = True) -> np.ndarray:
    """l_pub: the teacher's log-likelihood of each record's text (decoded from the on-device ids
    with `tokenizer`, re-encoded with the teacher's own SentencePiece model, read behind its bos),
    divided by the record's number of on-device tokens (see the module docstring)."""
    sp = processor(load_teacher_spm(extractor.teacher.path))
    own = [sp.encode(tokenizer.decode(s)) for s in sequences]
    if not all(own):
        raise DpfleetError("a record decodes to no text the teacher can read")
    batch_tokens = resolve_batch_tokens(batch_tokens, extractor.body_tokens)
    totals = np.zeros(len(own))
    bar = progress_bar(total=sum(map(len, own)), unit="tok", desc="teacher log-probs", enabled=progress,
                       terminal_only=False)
    first = 0
    for batch in token_batches(own, batch_tokens):  # consecutive runs of records
        targets, mask = right_padded(batch, 0)
        inputs = np.full(targets.shape, extractor.teacher_bos, dtype=np.int64)
        inputs[:, 1:] = np.where(mask[:, 1:], targets[:, :-1], extractor.teacher_bos)
        (logp,) = reduce_batch(extractor.teacher, inputs, mask, target_logprob,
                               extractor.body_tokens, extractor.chunk_tokens, targets)
        rows = np.repeat(np.arange(len(batch)), mask.sum(1))
        totals[first : first + len(batch)] = np.bincount(
            rows, logp.double().cpu().numpy(), minlength=len(batch))
        first += len(batch)
        bar.update(int(mask.sum()))
    bar.close()
    return totals / np.array([len(s) for s in sequences])


def match_scores(l_pub: np.ndarray | None, l_priv: np.ndarray, beta: float) -> np.ndarray:
    """h_beta = (1 - beta) * l_pub + beta * l_priv; beta = 1 needs no teacher (l_pub None)."""
    if not 0 <= beta <= 1:
        raise DpfleetError("the matching weight beta must be in [0, 1]")
    if l_pub is None:
        if beta != 1:
            raise DpfleetError("matching with beta < 1 needs the teacher's log-probs")
        return np.asarray(l_priv, dtype=np.float64)
    return (1 - beta) * np.asarray(l_pub, np.float64) + beta * np.asarray(l_priv, np.float64)


def selection_size(n: int, fraction: float) -> int:
    if not 0 < fraction <= 1:
        raise DpfleetError("the public fraction q must be in (0, 1]")
    return max(1, math.ceil(fraction * n - 1e-9))


def top_fraction(scores: np.ndarray, fraction: float) -> np.ndarray:
    """Indices of the top `fraction` of records by score, best first (ties: lower index)."""
    order = np.argsort(-np.asarray(scores), kind="stable")
    return order[: selection_size(len(order), fraction)]


def random_fraction(n: int, fraction: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)[: selection_size(n, fraction)]


def source_report(sources: Sequence[str], selected: Sequence[int]) -> dict:
    """How many records of each source the pool and the selection hold."""
    pool = Counter(sources)
    chosen = Counter(sources[i] for i in selected)
    return {s: {"pool": pool[s], "selected": chosen.get(s, 0),
                "selected_share": chosen.get(s, 0) / max(1, len(selected))} for s in pool}
