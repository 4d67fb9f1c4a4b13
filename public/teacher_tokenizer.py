"""The on-device vocabulary, taken from the public teacher LLM (paper 000 Sec. 3.1).

Sharing the teacher's vocabulary is what makes the teacher's top-k logits usable as targets for
the student and keeps the private data out of the vocabulary. A teacher vocabulary is far too
big for a phone (Gemma 3: 262,144 pieces), so it is *trimmed*:

1. The teacher's SentencePiece model is read as a `ModelProto` (from `tokenizer.model` in a
   Hugging Face folder, or rebuilt from a GGUF file's `tokenizer.ggml.*` fields). Untrimmed it
   encodes as the teacher's own tokenizer does (checked on WikiText-2, see the tests).
2. Public text is encoded with the full model and the pieces are ranked by frequency.
3. The top pieces are kept, each *with its BPE derivation* (its characters and every
   intermediate piece the teacher's merges pass through), plus all 256 byte pieces so any text
   still encodes with no unknown token, plus pad/bos/eos/unk remapped to ids 0/1/2/3.

In what sense the trimmed model agrees with the teacher:
* Every student piece is a teacher piece (same string, same BPE score), so the student ->
  teacher id map is total and exact, and every student encoding decodes to the input text.
* For BPE teachers: on any text whose teacher encoding uses only kept pieces, the trimmed
  encoding is *identical* (up to the id map). Removing a piece the teacher never formed on that
  text cannot change which merge wins at any step, and kept pieces stay reachable because their
  derivations are kept.
* Elsewhere a trimmed piece falls back to shorter kept pieces, and a character outside the
  vocabulary to its UTF-8 bytes. BPE then re-merges over the smaller vocabulary, so the
  fallback is a valid segmentation of the same text but not always the teacher's pieces split
  further (a neighbour may merge differently once a higher-priority merge is gone).
* For unigram teachers the kept pieces keep their scores, and Viterbi over fewer pieces is again
  a valid segmentation; agreement then holds only where no trimmed piece would have won.

The id map (`idmap.npz` beside the model) holds `student_to_teacher` (exact) and
`teacher_to_student`, which sends each teacher piece to a student id: itself when kept, else the
*first* student piece of its fallback encoding (the student's first step towards that string);
teacher bos/eos/pad to the student's; other control and unused pieces to -1 (no student token).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpfleet.edge.tokenizer import BOS, EOS, PAD, UNK, SentencePieceTokenizer
from dpfleet.errors import DpfleetError
from dpfleet.jsonio import write_json

# Student ids are stored as uint16 with the top bit free (see public/topk.py).
MAX_STUDENT_VOCAB = 32_768
_N_BYTES = 256
_SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", UNK: "<unk>"}


def _pb():
    from sentencepiece import sentencepiece_model_pb2

    return sentencepiece_model_pb2


def spm_from_gguf(gguf_path: Path):
    """Rebuild a SentencePiece `ModelProto` from a GGUF file's tokenizer fields.

    Only SentencePiece-style vocabularies (`tokenizer.ggml.model == "llama"`, e.g. Gemma) have one;
    byte-level BPE vocabularies (`gpt2`, e.g. SmolLM2) are refused. llama.cpp stores
    whitespace-only user-defined pieces with plain spaces; SentencePiece wants them escaped as
    U+2581 like every other piece, or they can never match.
    """
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))

    def field(name: str):
        f = reader.fields.get(name)
        if f is None:
            return None
        if name in ("tokenizer.ggml.tokens",):
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        if name in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            return [f.parts[i][0].item() for i in f.data]
        return f.contents()

    kind = field("tokenizer.ggml.model")
    if kind != "llama":
        raise DpfleetError(
            f"{gguf_path}: tokenizer is {kind!r}, not SentencePiece; the on-device vocabulary "
            "must come from a SentencePiece teacher (e.g. gemma3-270m)"
        )
    tokens = field("tokenizer.ggml.tokens")
    scores = field("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    ids = {
        key: field(f"tokenizer.ggml.{key}_token_id")
        for key in ("padding", "bos", "eos", "unknown")
    }
    space_prefix = field("tokenizer.ggml.add_space_prefix")

    pb = _pb()
    proto = pb.ModelProto()
    spec = proto.trainer_spec
    # Merge priority is the piece score, digits are split (Gemma, Llama), bytes back up chars.
    spec.model_type = pb.TrainerSpec.BPE  # llama.cpp's SPM tokenizer is score-ordered BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = 6 in types
    spec.split_digits = True
    spec.allow_whitespace_only_pieces = True
    spec.pad_id = -1 if ids["padding"] is None else int(ids["padding"])
    spec.bos_id = -1 if ids["bos"] is None else int(ids["bos"])
    spec.eos_id = -1 if ids["eos"] is None else int(ids["eos"])
    spec.unk_id = int(ids["unknown"] or 0)
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(space_prefix) if space_prefix is not None else True
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    for i, (piece, score, kind_id) in enumerate(zip(tokens, scores, types, strict=True)):
        p = proto.pieces.add()
        p.piece = piece.replace(" ", "\u2581")
        p.score = float(score)
        # GGUF token types use SentencePiece's numbering; llama.cpp marks <unk> as control.
        p.type = pb.ModelProto.SentencePiece.UNKNOWN if i == spec.unk_id else int(kind_id)
    _name_specials(proto)
    return proto


def _name_specials(proto) -> None:
    """SentencePiece finds pad/bos/eos/unk by piece *name* (`*_piece`), not by the `*_id` fields."""
    spec = proto.trainer_spec
    for kind in ("pad", "bos", "eos", "unk"):
        i = getattr(spec, f"{kind}_id")
        if i >= 0:
            setattr(spec, f"{kind}_piece", proto.pieces[i].piece)


def load_teacher_spm(teacher_dir: Path):
    """The teacher's SentencePiece `ModelProto` from its folder's `tokenizer.model`."""
    model_file = Path(teacher_dir) / "tokenizer.model"
    if not model_file.is_file():
        raise DpfleetError(
            f"{teacher_dir} has no tokenizer.model: the teacher has no SentencePiece vocabulary "
            "(byte-level BPE teachers such as smollm2 cannot give the on-device tokenizer)"
        )
    proto = _pb().ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    return proto


def processor(proto):
    """A `SentencePieceProcessor` over an in-memory `ModelProto`."""
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def piece_counts(proto, lines: Iterable[str], batch: int = 4096) -> np.ndarray:
    """How often each teacher piece occurs in the teacher's encoding of `lines`."""
    sp = processor(proto)
    counts = np.zeros(len(proto.pieces), dtype=np.int64)
    buf: list[str] = []

    def flush() -> None:
        encoded = sp.encode(buf)
        if encoded:
            flat = np.fromiter((i for ids in encoded for i in ids), dtype=np.int64)
            counts[:] += np.bincount(flat, minlength=len(counts))
        buf.clear()

    for line in lines:
        buf.append(line)
        if len(buf) >= batch:
            flush()
    flush()
    return counts


def _bpe_derivation(piece: str, merge_score: dict[str, float]) -> list[str] | None:
    """Pieces SentencePiece BPE forms on the way to `piece` (its chars first), or None.

    SentencePiece merges the adjacent pair whose concatenation is a piece with the highest
    score, leftmost on ties; encoding `piece` alone replays exactly the merges that form it in
    any context (a merge with a neighbour would have prevented it).
    """
    symbols = list(piece)
    if any(c not in merge_score for c in symbols):
        return None
    formed = list(symbols)
    while len(symbols) > 1:
        best, best_i = None, -1
        for i in range(len(symbols) - 1):
            score = merge_score.get(symbols[i] + symbols[i + 1])
            if score is not None and (best is None or score > best):
                best, best_i = score, i
        if best is None:
            return None
        symbols[best_i : best_i + 2] = [symbols[best_i] + symbols[best_i + 1]]
        formed.append(symbols[best_i])
    return formed


@dataclass
class TrimmedVocab:
    """A student SentencePiece `ModelProto` and its exact map into the teacher's ids."""

    proto: object
    student_to_teacher: np.ndarray  # int32 [student vocab], -1 for a special the teacher lacks


def trim(proto, counts: np.ndarray, vocab_size: int) -> TrimmedVocab:
    """Keep the most frequent teacher pieces (with their derivations) within `vocab_size`."""
    pb = _pb()
    sp_types = pb.ModelProto.SentencePiece
    if not 4 + _N_BYTES < vocab_size <= MAX_STUDENT_VOCAB:
        raise DpfleetError(
            f"vocab size must be in ({4 + _N_BYTES}, {MAX_STUDENT_VOCAB}], got {vocab_size}"
        )
    pieces = proto.pieces
    byte_ids = [i for i, p in enumerate(pieces) if p.type == sp_types.BYTE]
    if len(byte_ids) != _N_BYTES:
        raise DpfleetError("the teacher vocabulary has no byte fallback; cannot trim it safely")
    spec = proto.trainer_spec
    teacher_special = {PAD: spec.pad_id, BOS: spec.bos_id, EOS: spec.eos_id, UNK: spec.unk_id}
    is_bpe = spec.model_type == pb.TrainerSpec.BPE
    mergeable = {sp_types.NORMAL, sp_types.USER_DEFINED}
    merge_score = {p.piece: p.score for p in pieces if p.type in mergeable}
    index = {p.piece: i for i, p in enumerate(pieces) if p.type in mergeable}

    budget = vocab_size - 4 - _N_BYTES
    kept: dict[int, None] = {}  # insertion-ordered set of teacher ids
    observed = [i for i in np.argsort(-counts, kind="stable") if counts[i] > 0]
    by_score = sorted(index.values(), key=lambda i: -pieces[i].score)
    for tid in (*observed, *by_score):
        if len(kept) >= budget:
            break
        if tid in kept or pieces[tid].type not in mergeable:
            continue
        if is_bpe and pieces[tid].type == sp_types.NORMAL:
            path = _bpe_derivation(pieces[tid].piece, merge_score)
            if path is None:  # never formed by the teacher's own merges
                continue
            needed = [index[s] for s in path if index[s] not in kept]
        else:
            needed = [tid]
        if len(kept) + len(needed) <= budget:
            kept.update(dict.fromkeys(needed))

    student = pb.ModelProto()
    student.CopyFrom(proto)
    del student.pieces[:]
    s2t = []
    for sid in (PAD, BOS, EOS, UNK):
        tid = teacher_special[sid]
        p = student.pieces.add()
        p.piece = pieces[tid].piece if tid >= 0 else _SPECIAL_NAMES[sid]
        p.score = 0.0
        p.type = sp_types.UNKNOWN if sid == UNK else sp_types.CONTROL
        s2t.append(tid)
    for tid in (*byte_ids, *kept):
        student.pieces.append(pieces[tid])
        s2t.append(tid)
    student.trainer_spec.vocab_size = len(student.pieces)
    student.trainer_spec.pad_id, student.trainer_spec.bos_id = PAD, BOS
    student.trainer_spec.eos_id, student.trainer_spec.unk_id = EOS, UNK
    student.trainer_spec.byte_fallback = True
    _name_specials(student)
    return TrimmedVocab(student, np.asarray(s2t, dtype=np.int32))


def teacher_to_student(teacher_proto, trimmed: TrimmedVocab) -> np.ndarray:
    """Each teacher id -> a student id (itself, else its fallback's first piece) or -1."""
    sp_types = _pb().ModelProto.SentencePiece
    n_teacher = len(teacher_proto.pieces)
    out = np.full(n_teacher, -1, dtype=np.int32)
    exact = trimmed.student_to_teacher >= 0
    out[trimmed.student_to_teacher[exact]] = np.flatnonzero(exact)
    rest = [
        i
        for i, p in enumerate(teacher_proto.pieces)
        if out[i] < 0 and p.type in (sp_types.NORMAL, sp_types.USER_DEFINED)
    ]
    texts = [teacher_proto.pieces[i].piece.replace("\u2581", " ") for i in rest]
    for tid, ids in zip(rest, processor(trimmed.proto).encode(texts), strict=True):
        if ids:
            out[tid] = ids[0]
    return out


@dataclass
class TeacherVocab:
    """A trimmed teacher tokenizer as saved on disk: the tokenizer and both id maps."""

    tokenizer: SentencePieceTokenizer
    student_to_teacher: np.ndarray  # int32 [student vocab]
    teacher_to_student: np.ndarray  # int32 [teacher vocab]
    meta: dict

    @classmethod
    def load(cls, folder: Path) -> TeacherVocab:
        folder = Path(folder)
        idmap, meta_file = folder / "idmap.npz", folder / "teacher.json"
        if not idmap.is_file() or not meta_file.is_file():
            raise DpfleetError(
                f"{folder} is not a teacher tokenizer (build one with "
                "`dpfleet public teacher-tokenizer`)"
            )
        tokenizer = SentencePieceTokenizer(folder / "spm.model")
        with np.load(idmap) as z:
            return cls(
                tokenizer,
                z["student_to_teacher"],
                z["teacher_to_student"],
                json.loads(meta_file.read_text()),
            )


def build_teacher_vocab(
    teacher_proto, lines: Iterable[str], vocab_size: int, out: Path, teacher: str
) -> TeacherVocab:
    """Trim `teacher_proto` on public `lines` and save the tokenizer folder to `out`."""
    counts = piece_counts(teacher_proto, lines)
    trimmed = trim(teacher_proto, counts, vocab_size)
    t2s = teacher_to_student(teacher_proto, trimmed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spm.model").write_bytes(trimmed.proto.SerializeToString())
    SentencePieceTokenizer(out / "spm.model").save(out)
    np.savez(out / "idmap.npz", student_to_teacher=trimmed.student_to_teacher,
             teacher_to_student=t2s)
    kept = trimmed.student_to_teacher[trimmed.student_to_teacher >= 0]
    meta = {
        "teacher": teacher,
        "teacher_vocab_size": len(teacher_proto.pieces),
        "vocab_size": len(trimmed.proto.pieces),
        "public_tokens": int(counts.sum()),
        # share of the public text's teacher tokens that are kept pieces (encoded identically)
        "token_coverage": float(counts[kept].sum() / max(1, counts.sum())),
    }
    write_json(out / "teacher.json", meta, indent=2)
    return TeacherVocab.load(out)
