"""The distillation corpus: the teacher's top-k next-token logits as sharded silver labels.

Paper 000 Sec. 4.1 / App. B.3: run the teacher over public sequences once and keep its top-k
logits (k = 10) per position, so any on-device LM sharing the vocabulary can be distilled later
without the teacher. The temperature is applied when the loss is computed (public/kd.py), so
one corpus serves every t.

Input alignment. The teacher reads the *student's* tokenization, mapped into teacher ids
(exact: every student piece is a teacher piece), behind the teacher's bos. So row i is the
teacher's distribution for student token i given exactly the context the student will see.
Where trimming split a rare word the teacher sees a non-canonical segmentation of it.

Output mapping. The teacher's top-k ids go through `teacher_to_student`: a kept piece is itself;
a trimmed piece becomes the first student piece of its fallback (the student's first step
towards that string) and entries landing on the same student id are merged by log-sum-exp,
so their probability mass adds up; control/unused pieces and pad/bos/unk are dropped. A row
may therefore hold fewer than k entries: empty slots have id 0 (pad) and logit -inf.
With `targets = "student"` the merge happens before the top-k, over the whole teacher
distribution (TopKExtractor). A row with no entry at all is stored as -inf, not NaN.

Shard layout (`shard-NNNNN.npz`, uncompressed numpy arrays; N tokens in the shard):

| array         | dtype, shape          | content                                                  |
| ------------- | --------------------- | -------------------------------------------------------- |
| `tokens`      | uint16 [N]            | student ids; bit 15 set on each sequence's first token   |
| `topk_ids`    | uint16 [N, k]         | student ids, best first                                  |
| `topk_logits` | float16 [N, k - 1]    | logit_j - logit_0 for j = 1..k-1 (<= 0, -inf when empty) |

The best logit is not stored: softmax over the top-k is shift-invariant, so it is 0 by
definition. That is 2 + 2k + 2(k - 1) = 4k bytes per token (40 for k = 10) with sequence
boundaries inside the token array (student vocabularies are capped at 32,768 ids).
`manifest.json` holds the settings, each finished shard's SHA-256 and token count
(`shard_files`), and, once every shard is done, the shard list (`shards`) and the measured
throughput.

Resumed, verified. Labelling the main job's public text takes hours on a CPU, so a kill must
not lose them: each shard is written atomically, then the manifest (also atomically) records
its hash, so after a kill the manifest names exactly the shards that are whole. A rerun with
the same settings keeps each shard whose file matches its recorded hash and recomputes the rest
(a missing, truncated, corrupt or unrecorded file; one line says which and why); the bar starts
from the tokens already labelled. `TopKCorpus` checks every shard against its hash on load and
refuses a corrupt corpus in one line naming the shard. A corpus written before hashes were
recorded (no `shard_files`) still loads, unverified; a rerun over it recomputes its shards,
there being nothing to verify them against. Cached corpora, shared by every job that asks for
the same labels: public/topk_cache.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpfleet.edge.tokenizer import BOS, PAD, UNK, Tokenizer
from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write, sha256_file, sha256_hex
from dpfleet.jsonio import write_json
from dpfleet.progress import progress_bar
from dpfleet.public.teacher import Teacher
from dpfleet.public.teacher_head import (
    DEFAULT_CHUNK_TOKENS,
    micro_batches,
    reduce_batch,
    resolve_batch_tokens,
    resolve_body_tokens,
    right_padded,
    student_space_reduce,
)
from dpfleet.public.teacher_screen import SCREEN_CHUNK_TOKENS, resolve_head, screen_for
from dpfleet.public.teacher_tokenizer import MAX_STUDENT_VOCAB, TeacherVocab

_START = np.uint16(1 << 15)
TARGETS = ("teacher", "student")  # where the top-k is taken (TopKExtractor)


def student_sequences(texts: Iterable[str], tokenizer: Tokenizer, seq_len: int) -> list[list[int]]:
    """Encode texts and cut each into consecutive chunks of at most `seq_len` tokens."""
    if seq_len < 1:
        raise DpfleetError("seq_len must be positive")
    out = []
    for text in texts:
        ids = tokenizer.encode(text)
        out.extend(ids[i : i + seq_len] for i in range(0, len(ids), seq_len))
    return out


def merge_mapped(ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge top-k entries that map to the same student id (log-sum-exp); drop ids < 0.

    `ids`, `logits`: [rows, k], teacher order. Returns [rows, k], best first, empty slots
    holding id PAD and logit -inf.
    """
    valid = ids >= 0
    logits = logits.masked_fill(~valid, float("-inf"))
    same = (ids[:, :, None] == ids[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    k = ids.shape[1]
    merged = torch.logsumexp(
        logits[:, None, :].expand(-1, k, -1).masked_fill(~same, float("-inf")), dim=-1
    )
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)
    keep = valid & ~(same & earlier).any(-1)
    merged = merged.masked_fill(~keep, float("-inf"))
    order = merged.argsort(dim=-1, descending=True, stable=True)
    return ids.masked_fill(~keep, PAD).gather(1, order), merged.gather(1, order)


class TopKExtractor:
    """Teacher forward passes -> student-vocabulary top-k rows for student sequences.

    `targets` picks how the teacher's distribution becomes k student-space entries:
    "teacher" (paper 000's recipe) takes the top-k in the teacher vocabulary and merges the
    entries that map to one student id; "student" first pushes the *whole* teacher distribution
    through the id map (public/teacher_head.py: student_space_reduce) and then takes the top-k,
    so mass of trimmed continuations outside the teacher's top-k is kept. The body runs over
    at most `body_tokens` padded positions at a time (0: from free accelerator memory, 1,024 on
    CPU) and the head over `chunk_tokens`; each chunk is mapped and merged at once, so memory
    does not grow with the batch a caller hands to `rows`. `head` ("auto", "float32", "int8")
    picks the LM head: "int8" screens the whole vocabulary with an int8 GEMM and scores the
    best 32 ids in float32 (public/teacher_screen.py; CPU, teacher-space targets; chunks of at
    most 256 rows); `head_mode` says which ran, and labels from the two heads never share a cache.
    """

    def __init__(self, teacher: Teacher, vocab: TeacherVocab, k: int = 10,
                 targets: str = "teacher", chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 body_tokens: int = 0, head: str = "auto"):
        if vocab.tokenizer.vocab_size > MAX_STUDENT_VOCAB:
            raise DpfleetError(f"student vocabulary exceeds {MAX_STUDENT_VOCAB} ids")
        if len(vocab.teacher_to_student) != teacher.vocab_size:
            raise DpfleetError(
                f"tokenizer was built for a {len(vocab.teacher_to_student)}-piece teacher, "
                f"but {teacher.name} has {teacher.vocab_size} outputs"
            )
        if not 1 <= k <= 64:
            raise DpfleetError("k must be in [1, 64]")
        if targets not in TARGETS:
            raise DpfleetError(f"top-k targets must be one of {', '.join(TARGETS)}, not {targets!r}")
        if chunk_tokens < 1:
            raise DpfleetError("chunk_tokens must be positive")
        if body_tokens < 0:
            raise DpfleetError("body_tokens must be >= 0 (0: from free accelerator memory)")
        self.teacher, self.k, self.targets, self.chunk_tokens = teacher, k, targets, chunk_tokens
        self.body_tokens = resolve_body_tokens(teacher, body_tokens, chunk_tokens)
        device = teacher.device
        self.s2t_np = np.asarray(vocab.student_to_teacher, dtype=np.int64)
        self.s2t = torch.as_tensor(self.s2t_np, device=device)
        t2s = vocab.teacher_to_student.astype(np.int64)
        t2s[np.isin(t2s, [PAD, BOS, UNK])] = -1  # never a prediction target
        self.t2s = torch.as_tensor(t2s, device=device)
        self.student_vocab = vocab.tokenizer.vocab_size
        self.teacher_bos = int(vocab.student_to_teacher[BOS])
        if self.teacher_bos < 0:
            raise DpfleetError("the teacher vocabulary has no bos token")
        self.head_mode, self._head = resolve_head(head, teacher, targets), None
        if targets == "student":
            self._reduce = student_space_reduce(self.t2s, self.student_vocab, k)
        elif self.head_mode == "int8":  # the screen takes the hidden rows, not logits
            self._screen, self.chunk_tokens = screen_for(teacher), min(chunk_tokens, SCREEN_CHUNK_TOKENS)
            self._reduce, self._head = self._screened, lambda hidden: hidden
        else:
            self._reduce = self._teacher_space

    def _teacher_space(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One head chunk: teacher-space top-k, mapped and merged in student ids."""
        values, indices = logits.topk(self.k, dim=-1)
        return merge_mapped(self.t2s[indices], values)

    def _screened(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk of hidden rows: the int8-screened teacher-space top-k, mapped and merged."""
        values, indices = self._screen.topk(hidden, self.k)
        return merge_mapped(self.t2s[indices], values)

    def rows(self, batch: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (ids, logits), each [total tokens, k], for a batch of sequences in order."""
        ids, mask = right_padded(batch, PAD)
        mapped = self.s2t_np[ids[:, :-1]]  # the one gather through the id map
        if (mapped[mask[:, 1:]] < 0).any():
            raise DpfleetError("a sequence holds a special token with no teacher id")
        inputs = np.full(ids.shape, self.teacher_bos, dtype=np.int64)
        inputs[:, 1:] = np.where(mask[:, 1:], mapped, self.teacher_bos)
        return reduce_batch(self.teacher, inputs, mask, self._reduce, self.body_tokens,
                            self.chunk_tokens, head=self._head)


def _pack(sequences: Sequence[Sequence[int]], ids: torch.Tensor, logits: torch.Tensor) -> dict:
    tokens = np.concatenate([np.asarray(s, dtype=np.uint16) for s in sequences])
    starts = np.cumsum([0, *(len(s) for s in sequences[:-1])])
    tokens[starts] |= _START
    ids_np = ids.cpu().numpy().astype(np.uint16)
    # an empty row (nothing reachable) is stored as -inf throughout, never -inf - -inf = NaN
    rel = torch.where(torch.isneginf(logits[:, 1:]), logits[:, 1:], logits[:, 1:] - logits[:, :1])
    rel = rel.cpu().numpy().astype(np.float16)
    return {"tokens": tokens, "topk_ids": ids_np, "topk_logits": rel}


def token_batches(sequences: Sequence[Sequence[int]], batch_tokens: int) -> Iterable[list]:
    """Consecutive runs of sequences whose padded size (count x longest) fits `batch_tokens`
    (the same packing as the body's micro-batches)."""
    for span in micro_batches(np.array([len(s) for s in sequences], dtype=np.int64), batch_tokens):
        yield list(sequences[span])


def sequences_fingerprint(sequences: Sequence[Sequence[int]]) -> str:
    """A short digest of the token sequences: what a corpus's labels were computed for."""
    digest = hashlib.sha256()
    for seq in sequences:
        digest.update(np.asarray(seq, dtype=np.uint16).tobytes() + b"\xff\xff")
    return digest.hexdigest()[:16]


def read_manifest(path: Path) -> dict:
    """A corpus's manifest.json; a damaged one is one error line, not a traceback."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DpfleetError(f"{path} is not a manifest ({exc}); delete its folder to rebuild the "
                           "corpus") from exc


def shard_problem(path: Path, record: dict | None) -> str | None:
    """Why the shard file at `path` must be computed ("": never written), or None when it is
    whole: present and matching the SHA-256 recorded for it."""
    if not path.is_file():
        return "missing" if record else ""
    if record is None:
        return "present but not recorded in manifest.json"
    if sha256_file(path) != record.get("sha256"):
        return "SHA-256 differs from manifest.json's (truncated, corrupt or another corpus's)"
    return None


def build_corpus(
    extractor: TopKExtractor,
    sequences: Sequence[Sequence[int]],
    out: Path,
    shard_sequences: int = 4096,
    batch_tokens: int = 0,
    progress: bool = True,
    log: Callable[[str], None] = print,
    seal: Callable[[dict], str] | None = None,
) -> dict:
    """Write the top-k shards for `sequences` to `out` (resuming) and return the manifest.

    Resumes and verifies as the module docstring says: shards whose file matches the SHA-256
    in manifest.json are kept, every other one is computed, and the manifest records each new
    shard as soon as it is written, so a kill at any moment loses at most the shard in hand.
    `log` gets the lines about the resumption and each shard recomputed for a reason.
    `batch_tokens` (0: automatic) is what one host copy carries; memory is bounded by the
    extractor's `body_tokens` and `chunk_tokens`, not by it. `seal` (the label cache's,
    public/topk_cache.py) gives every manifest written its `cache_mac`, so that a half-done
    cache entry resumes as well as a finished one is reused."""
    batch_tokens = resolve_batch_tokens(batch_tokens, extractor.body_tokens)
    sequences = _checked_sequences(extractor, sequences, shard_sequences)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = _corpus_settings(extractor, sequences, shard_sequences)
    manifest_file = out / "manifest.json"
    old = _same_corpus_manifest(manifest_file, settings, extractor, out)
    recorded: dict[str, dict] = dict(old.get("shard_files", {}))
    shards, todo, reasons, done_tokens = _shards_to_label(out, sequences, shard_sequences, recorded)

    def sealed(body: dict) -> dict:
        return {**body, "cache_mac": seal(body)} if seal is not None else body

    def write_manifest(extra: dict) -> None:
        body = {**settings, "shard_files": dict(sorted(recorded.items())), **extra}
        write_json(manifest_file, sealed(body), indent=2)

    if todo:
        write_manifest({})  # without the shard list, and without any record found stale
        if len(todo) < len(shards):
            log(f"resuming: {len(shards) - len(todo)} of {len(shards)} shards already labelled "
                f"({done_tokens:,} of {settings['tokens']:,} tokens) in {out}")
    for line in reasons:
        log(line)

    new_tokens, seconds = _label_shards(extractor, todo, out, recorded, write_manifest,
                                        batch_tokens=batch_tokens, total=settings["tokens"],
                                        done_tokens=done_tokens, progress=progress)
    size = sum((out / name).stat().st_size for name in shards)
    manifest = sealed({
        **settings,
        "shard_files": dict(sorted(recorded.items())),
        "shards": shards,
        "bytes_per_token": size / settings["tokens"],
        # a run that computed nothing keeps the throughput and device of the one that did
        "tokens_per_s": new_tokens / seconds if seconds else old.get("tokens_per_s"),
        "device": old.get("device") if not seconds and "device" in old
        else str(extractor.teacher.device),
    })
    if manifest != old:
        write_json(manifest_file, manifest, indent=2)
    return manifest


def _checked_sequences(extractor: TopKExtractor, sequences: Sequence[Sequence[int]],
                       shard_sequences: int) -> list[list[int]]:
    """The non-empty sequences as lists, refused in one line before any folder is made: ids the
    student's vocabulary cannot hold mean the sequences were encoded with another tokenizer."""
    sequences = [list(s) for s in sequences if len(s) > 0]
    if not sequences:
        raise DpfleetError("no sequences to distill")
    if any(max(s) >= extractor.student_vocab for s in sequences):  # (a vocabulary <= 32,768 ids)
        raise DpfleetError(f"token ids must be below the student vocabulary's size "
                           f"({extractor.student_vocab}): were the sequences encoded with "
                           "another tokenizer?")
    if shard_sequences < 1:
        raise DpfleetError("shard_sequences must be positive")
    return sequences


def _corpus_settings(extractor: TopKExtractor, sequences: list[list[int]], shard_sequences: int) -> dict:
    """What makes two corpora the same: the manifest keys a resumed build must match."""
    settings = {
        "format": "dpfleet-topk-v1",
        "k": extractor.k,
        "teacher": extractor.teacher.name,
        "sequences": len(sequences),
        "tokens": sum(map(len, sequences)),
        "shard_sequences": shard_sequences,
        "fingerprint": sequences_fingerprint(sequences),
    }
    # options added later are recorded only when not at their default, so older corpora match
    if extractor.targets != "teacher":
        settings["targets"] = extractor.targets
    if extractor.head_mode != "float32":
        settings["head_mode"] = extractor.head_mode
    return settings


def _same_corpus_manifest(manifest_file: Path, settings: dict, extractor: TopKExtractor,
                          out: Path) -> dict:
    """The manifest already in `out` ({} if none), refused when it was built with other settings
    or sequences: resuming it would mix two corpora's shards."""
    if not manifest_file.is_file():
        return {}
    old = read_manifest(manifest_file)
    if ({key: old.get(key) for key in settings} != settings
            or old.get("targets", "teacher") != extractor.targets
            or old.get("head_mode", "float32") != extractor.head_mode):
        raise DpfleetError(f"{out} holds a corpus built with other settings or sequences")
    return old


def _shards_to_label(out: Path, sequences: list[list[int]], shard_sequences: int,
                     recorded: dict[str, dict]) -> tuple[list[str], list, list[str], int]:
    """Every shard's name, the (name, sequences) still to label, why each found one is redone
    and the tokens already labelled. A stale record is dropped from `recorded`, so no manifest
    written from here on names a shard that is not whole on disk."""
    shards, todo, reasons = [], [], []
    done_tokens = 0
    for first in range(0, len(sequences), shard_sequences):
        name = f"shard-{first // shard_sequences:05d}.npz"
        chunk = sequences[first : first + shard_sequences]
        shards.append(name)
        reason = shard_problem(out / name, recorded.get(name))
        if reason is None:
            done_tokens += sum(map(len, chunk))
            continue
        recorded.pop(name, None)
        todo.append((name, chunk))
        if reason:
            reasons.append(f"top-k shard {out / name}: {reason}; recomputing it")
    return shards, todo, reasons, done_tokens


def _label_shards(extractor: TopKExtractor, todo: list, out: Path, recorded: dict[str, dict],
                  write_manifest: Callable[[dict], None], *, batch_tokens: int, total: int,
                  done_tokens: int, progress: bool) -> tuple[int, float]:
    """Label and write each shard of `todo`, recording it in the manifest once its file is whole
    (the resume rule); returns the tokens labelled and the seconds it took (the throughput)."""
    new_tokens, seconds = 0, 0.0
    bar = progress_bar(total=total, initial=done_tokens, unit="tok", desc="top-k",
                       enabled=progress and bool(todo), terminal_only=False)
    for name, chunk in todo:
        start = time.perf_counter()
        parts = []
        for batch in token_batches(chunk, batch_tokens):  # the bar moves per batch (~30 s on a CPU)
            parts.append(extractor.rows(batch))
            bar.update(sum(map(len, batch)))
        arrays = _pack(chunk, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        data = buffer.getvalue()
        atomic_write(out / name, data)
        n_tokens = len(arrays["tokens"])
        recorded[name] = {"sha256": sha256_hex(data), "tokens": n_tokens}
        write_manifest({})  # the shard is whole on disk before its record names it
        seconds += time.perf_counter() - start
        new_tokens += n_tokens
        bar.set_postfix(tok_s=f"{new_tokens / seconds:.0f}")
    bar.close()
    return new_tokens, seconds


@dataclass
class KDBatch:
    """Padded student inputs/targets with the teacher's top-k for each target position."""

    inputs: torch.Tensor  # long [B, T]: bos + tokens[:-1]
    targets: torch.Tensor  # long [B, T]: tokens, PAD-padded
    topk_ids: torch.Tensor  # long [B, T, k]
    topk_logits: torch.Tensor  # float32 [B, T, k], -inf in empty slots and padding


class TopKCorpus:
    """A distillation corpus read back from its shards (all in memory: 40 bytes/token).

    Every shard is checked against the SHA-256 its manifest records, so a corrupt corpus is
    refused in one line that names the shard, rather than training on damaged labels. A corpus
    written before the hashes were recorded (no `shard_files` in manifest.json) loads unverified.
    """

    def __init__(self, folder: Path):
        folder = Path(folder)
        manifest_file = folder / "manifest.json"
        if not manifest_file.is_file():
            raise DpfleetError(f"no distillation corpus in {folder} (manifest.json missing)")
        self.manifest = read_manifest(manifest_file)
        repair = (f"rerun the `dpfleet public distill-corpus` that built it (same settings, "
                  f"--out {folder}) to recompute it")
        missing = [s for s in self.manifest.get("shards", []) if not (folder / s).is_file()]
        if "shards" not in self.manifest or missing:
            raise DpfleetError(f"{folder} is incomplete; {repair}")
        records = self.manifest.get("shard_files")
        tokens, ids, rel = [], [], []
        for name in self.manifest["shards"]:
            data = (folder / name).read_bytes()
            if records is not None and sha256_hex(data) != records.get(name, {}).get("sha256"):
                raise DpfleetError(f"top-k shard {folder / name} is corrupt (its SHA-256 is not "
                                   f"the one manifest.json records); {repair}")
            try:
                with np.load(io.BytesIO(data)) as z:
                    tokens.append(z["tokens"])
                    ids.append(z["topk_ids"])
                    rel.append(z["topk_logits"])
            except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
                raise DpfleetError(f"top-k shard {folder / name} is unreadable ({exc}); "
                                   f"{repair}") from exc
        raw = np.concatenate(tokens)
        self.starts = np.flatnonzero(raw & _START)
        self.ends = np.append(self.starts[1:], len(raw))
        self.tokens = (raw & ~_START).astype(np.int64)
        self.topk_ids = np.concatenate(ids).astype(np.int64)
        rel = np.concatenate(rel).astype(np.float32)
        best = np.where(self.topk_ids[:, :1] == PAD, -np.inf, 0.0).astype(np.float32)
        self.topk_logits = np.concatenate([best, rel], axis=1)

    def __len__(self) -> int:
        return len(self.starts)

    def batch(self, indices: Sequence[int]) -> KDBatch:
        """Collate sequences `indices` into a right-padded `KDBatch`."""
        spans = [(self.starts[i], self.ends[i]) for i in indices]
        width = max(e - s for s, e in spans)
        k = self.topk_ids.shape[1]
        inputs = np.full((len(spans), width), PAD, dtype=np.int64)
        targets = np.full((len(spans), width), PAD, dtype=np.int64)
        ids = np.full((len(spans), width, k), PAD, dtype=np.int64)
        logits = np.full((len(spans), width, k), -np.inf, dtype=np.float32)
        for b, (s, e) in enumerate(spans):
            n = e - s
            targets[b, :n] = self.tokens[s:e]
            inputs[b, 0] = BOS
            inputs[b, 1:n] = self.tokens[s : e - 1]
            ids[b, :n] = self.topk_ids[s:e]
            logits[b, :n] = self.topk_logits[s:e]
        return KDBatch(*(torch.from_numpy(a) for a in (inputs, targets, ids, logits)))
