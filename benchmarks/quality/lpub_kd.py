"""Teacher work on part of a public pool: l_pub on a candidate set, KD labels for the selected.

On 2 shared CPU cores the teacher (Gemma-3-270M) scores ~50 tokens/s, so l_pub of the whole
23k-record pool (~360k tokens) and top-k labels for it do not fit a session. This module lets
`public_pool.py --lpub-kd` run the pipeline's own code on a part of the pool:

- l_pub is computed only for *candidates* (the union over seeds of the top records by l_priv)
  and is -inf elsewhere, so `match_scores` can never pick a non-candidate. This is a two-stage
  approximation of Algorithm 1: a record outside the candidates with a high enough l_pub could
  have entered the combined top q.
- KD labels (top-k shards, `public/topk.py`) are built only for the records some arm selects;
  the corpus refuses any other record, so a selection that differs from the predicted one
  fails loudly instead of training on missing labels.

Both are cached per record by content, so arms, seeds, reruns and a grown candidate set pay
for the teacher once per record. The cache key of a record is the SHA-256 of its on-device ids
(int32): the teacher is deterministic on CPU, l_pub depends only on the text decoded from those
ids and their count, and the top-k rows only on the ids. The folders are keyed by the rest:
l_pub under `$DPFLEET_CACHE/public/lpub-<digest(teacher, vocab meta)>/` (files of (key, l_pub)
named by the digest of their keys), top-k shards (`public/topk.py`'s format) under
`$DPFLEET_CACHE/public/topk-subset-<digest(teacher, vocab meta, k, targets)>/`, indexed by the
keys of the tokens the shards themselves hold. Missing records are scored in chunks that worker
processes claim (`claim`), so two workers share the teacher work.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dpfleet.edge.tokenizer import PAD
from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.errors import DpfleetError
from dpfleet.public.pipeline import TeacherWork, cache_key
from dpfleet.public.topk import TopKCorpus, build_corpus

CHUNK = 64  # records per claimed unit of teacher work


def record_key(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int32).tobytes()).hexdigest()


def _chunks(records: Sequence[int]) -> list[list[int]]:
    records = sorted(set(int(i) for i in records))
    return [records[i : i + CHUNK] for i in range(0, len(records), CHUNK)]


def _chunk_name(keys: Sequence[str]) -> str:
    return hashlib.sha256("".join(keys).encode()).hexdigest()[:16]


def work_through(total: int, missing: Callable[[], list[int]], do_chunk: Callable[[list[int]], bool],
                 desc: str, progress: bool, pause_s: float = 5.0) -> None:
    """Run `do_chunk` on chunks of the `missing()` records until none is missing; `do_chunk`
    returns False for a chunk it skipped (done or claimed by another worker), and a pass that
    did nothing waits `pause_s` for the other workers (l_pub scoring and KD labelling alike)."""
    bar = tqdm(total=total, desc=desc, unit="rec", disable=not progress)
    while left := missing():
        bar.n = total - len(left)
        bar.refresh()
        worked = False
        for chunk in _chunks(left):
            if do_chunk(chunk):
                bar.update(len(chunk))
                worked = True
        if not worked:
            time.sleep(pause_s)  # the rest is another worker's
    bar.close()


class PartialTeacher(TeacherWork):
    """`TeacherWork` restricted to `candidates` (l_pub) and `labelled` (KD) records of the pool."""

    def __init__(self, cfg, vocab, pool, progress: bool, candidates: Sequence[int] = (),
                 labelled: Sequence[int] = ()):
        super().__init__(cfg, vocab, pool, progress)
        p = cfg.public
        # keyed by the teacher body's precision too (TeacherWork.key_parts; empty for CPU float32)
        self.lpub_folder = cache_dir() / "public" / (
            f"lpub-{cache_key(p.teacher, vocab.meta, *self.key_parts)}")
        self.topk_folder = cache_dir() / "public" / (
            f"topk-subset-{cache_key(p.teacher, vocab.meta, p.k, p.targets, *self.key_parts)}")
        self.candidates = sorted(set(int(i) for i in candidates))
        self.labelled = sorted(set(int(i) for i in labelled))
        # what this process ran the teacher on (cache misses only), for tokens/s
        self.teacher_stats = {"lpub_tokens": 0, "lpub_seconds": 0.0, "topk_tokens": 0,
                              "topk_seconds": 0.0}

    # -- l_pub ---------------------------------------------------------------------------
    def _lpub_cache(self) -> dict[str, float]:
        """Every cached l_pub, by record key (each file's name checks its list of keys)."""
        out = {}
        for path in sorted(self.lpub_folder.glob("[0-9a-f]*.npz")):
            with np.load(path) as z:
                keys = [str(k) for k in z["keys"]]
                if _chunk_name(keys) != path.stem:
                    raise DpfleetError(f"{path} holds other records than its name says")
                out.update(zip(keys, z["l_pub"].tolist(), strict=True))
        return out

    def score_candidates(self, claim: Callable[[Path], bool]) -> None:
        """Score the candidates not yet cached, in claimed chunks of missing records, until
        every candidate is cached (by this worker or another)."""
        from dpfleet.public.matching import teacher_logprobs

        self.lpub_folder.mkdir(parents=True, exist_ok=True)
        keys = {i: record_key(self.pool.sequences[i]) for i in self.candidates}

        def score(chunk: list[int]) -> bool:
            seqs = [self.pool.sequences[i] for i in chunk]
            path = self.lpub_folder / f"{_chunk_name([keys[i] for i in chunk])}.npz"
            if path.is_file() or not claim(path.with_suffix("")):
                return False
            t0 = time.perf_counter()
            scores = teacher_logprobs(self.extractor(), self.vocab.tokenizer, seqs,
                                      self.cfg.public.batch_tokens, progress=False)
            self.teacher_stats["lpub_seconds"] += time.perf_counter() - t0
            self.teacher_stats["lpub_tokens"] += _teacher_tokens(self, seqs)
            tmp = path.with_name(f".{path.name}")
            with tmp.open("wb") as f:
                np.savez(f, keys=np.array([keys[i] for i in chunk]), l_pub=scores)
            tmp.replace(path)
            return True

        work_through(len(keys), lambda: [i for i in self.candidates
                                         if keys[i] not in self._lpub_cache()],
                     score, "l_pub records", self.progress)

    def logprobs(self) -> np.ndarray:
        """l_pub of the candidates from the cache, -inf for every other record."""
        out = np.full(len(self.pool.sequences), -np.inf)
        for i, value in self._cached(self.candidates, self._lpub_cache(), "cached l_pub",
                                     "score the candidates first").items():
            out[i] = value
        return out

    def _cached(self, records: Sequence[int], cache: dict, what: str, hint: str) -> dict:
        """{record: its cache entry}; DpfleetError naming the first record not cached."""
        out = {}
        for i in records:
            key = record_key(self.pool.sequences[i])
            if key not in cache:
                raise DpfleetError(f"no {what} for pool record {i}: {hint}")
            out[i] = cache[key]
        return out

    # -- KD labels -------------------------------------------------------------------------
    def _topk_cache(self) -> dict[str, tuple[TopKCorpus, int]]:
        """Every cached top-k row, by the key of the tokens the shard itself holds."""
        out = {}
        for folder in sorted(p for p in self.topk_folder.glob("[0-9a-f]*") if _complete(p)):
            corpus = TopKCorpus(folder)
            for row in range(len(corpus)):
                out[record_key(corpus.tokens[corpus.starts[row] : corpus.ends[row]])] = (corpus, row)
        return out

    def label(self, claim: Callable[[Path], bool]) -> None:
        """Build top-k shards for the labelled records not yet cached (claimed chunks of
        missing records), until every one is cached."""
        self.topk_folder.mkdir(parents=True, exist_ok=True)
        keys = {i: record_key(self.pool.sequences[i]) for i in self.labelled}

        def label_chunk(chunk: list[int]) -> bool:
            folder = self.topk_folder / _chunk_name([keys[i] for i in chunk])
            if _complete(folder) or not claim(folder.with_name(folder.name + "-claim")):
                return False
            t0 = time.perf_counter()
            build_corpus(self.extractor(), [self.pool.sequences[i] for i in chunk], folder,
                         batch_tokens=self.cfg.public.batch_tokens, progress=False)
            self.teacher_stats["topk_seconds"] += time.perf_counter() - t0
            self.teacher_stats["topk_tokens"] += sum(len(self.pool.sequences[i]) for i in chunk)
            return True

        work_through(len(keys), lambda: [i for i in self.labelled
                                         if keys[i] not in self._topk_cache()],
                     label_chunk, "top-k records", self.progress)

    def corpus(self) -> SubsetCorpus:
        where = self._cached(self.labelled, self._topk_cache(), "teacher labels",
                             "label the selection first")
        return SubsetCorpus(len(self.pool.sequences), where)


def _complete(folder: Path) -> bool:
    manifest = folder / "manifest.json"
    return manifest.is_file() and "shards" in json.loads(manifest.read_text())


def _teacher_tokens(work: TeacherWork, seqs: Sequence[Sequence[int]]) -> int:
    """Teacher-tokenizer tokens of the records' text (what l_pub scoring runs the teacher on)."""
    from dpfleet.public.teacher_tokenizer import load_teacher_spm, processor

    sp = processor(load_teacher_spm(work.extractor().teacher.path))
    return sum(len(sp.encode(work.vocab.tokenizer.decode(s))) for s in seqs)


class SubsetCorpus:
    """Top-k labels for some records of a pool, indexed by pool index (like `TopKCorpus`).

    Asking for a record without labels is an error: training would otherwise silently use
    L_LM only for it."""

    def __init__(self, size: int, where: dict[int, tuple[TopKCorpus, int]]):
        self.size, self.where = size, where

    def __len__(self) -> int:
        return self.size

    def batch(self, indices: Sequence[int]):
        missing = [int(i) for i in indices if int(i) not in self.where]
        if missing:
            raise DpfleetError(f"no teacher labels for pool records {missing[:5]} (of "
                               f"{len(missing)}): the selection differs from the labelled set")
        import torch

        from dpfleet.public.topk import KDBatch

        parts = [self.where[int(i)][0].batch([self.where[int(i)][1]]) for i in indices]
        width = max(p.targets.shape[1] for p in parts)

        def pad(t: torch.Tensor, value) -> torch.Tensor:
            shape = (t.shape[0], width - t.shape[1], *t.shape[2:])
            return torch.cat([t, torch.full(shape, value, dtype=t.dtype)], 1)

        return KDBatch(*(torch.cat([pad(getattr(p, name), value) for p in parts])
                         for name, value in (("inputs", PAD), ("targets", PAD),
                                             ("topk_ids", PAD), ("topk_logits", float("-inf")))))
