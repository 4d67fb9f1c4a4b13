"""The chunked teacher head (public/teacher_head.py) and student-space top-k targets.

References are computed independently: the model's own full forward (`model(...).logits`), a
full softmax in float64 and Python dictionaries for the id map. Float tolerance: the chunked
head is the same float32 matmul on fewer rows, so values agree to 1e-5 (absolute, logits of
size ~10); the float64 brute force agrees to 1e-4.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.edge.tokenizer import BOS, PAD, UNK
from dpfleet.errors import DpfleetError
from dpfleet.public.kd import kd_loss
from dpfleet.public.matching import teacher_logprobs
from dpfleet.public.teacher_head import reduce_head, student_space_reduce
from dpfleet.public.topk import (
    TopKCorpus,
    TopKExtractor,
    _pack,
    build_corpus,
    merge_mapped,
    student_sequences,
)

torch.set_num_threads(1)
TOL = 1e-5


@pytest.fixture(scope="module")
def teacher(wide_tiny_teacher):
    return wide_tiny_teacher


@pytest.fixture(scope="module")
def sequences(tiny_teacher_vocab):
    texts = ["The king said unto them, go forth and multiply .", "Valkyria Chronicles III is a "
             "tactical role playing game .", "Enter HAMLET and HORATIO , with the players .",
             "In 1998 the city council voted to rebuild the old bridge over the river ."]
    return student_sequences(texts * 2, tiny_teacher_vocab.tokenizer, seq_len=11)


def _full_logits(teacher, vocab, seq) -> torch.Tensor:
    """The model's own forward over one sequence: [len(seq), teacher vocab]."""
    ids = [int(vocab.student_to_teacher[BOS])] + [int(vocab.student_to_teacher[s]) for s in seq]
    with torch.no_grad():
        return teacher.model(input_ids=torch.tensor([ids[: len(seq)]])).logits[0].float()


def _t2s(vocab) -> np.ndarray:
    t2s = vocab.teacher_to_student.astype(np.int64)
    t2s[np.isin(t2s, [PAD, BOS, UNK])] = -1
    return t2s


def test_body_then_head_is_the_models_forward(teacher, tiny_teacher_vocab, sequences):
    for seq in sequences[:3]:
        ids = torch.tensor([[2, *(int(tiny_teacher_vocab.student_to_teacher[s]) for s in seq)]])
        got = teacher.logits(ids, torch.ones_like(ids))[0]
        assert torch.allclose(got, teacher.model(input_ids=ids).logits[0], atol=TOL)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 100_000])
def test_chunked_topk_equals_the_full_forward(teacher, tiny_teacher_vocab, sequences, chunk):
    k = 8
    ext = TopKExtractor(teacher, tiny_teacher_vocab, k, chunk_tokens=chunk)
    ids, values = ext.rows(sequences)
    full = torch.cat([_full_logits(teacher, tiny_teacher_vocab, s) for s in sequences])
    assert full.shape[0] == sum(map(len, sequences)) and ids.shape == (full.shape[0], k)
    ref_values, ref_idx = full.topk(k, dim=-1)
    ref_ids, ref_merged = merge_mapped(ext.t2s[ref_idx], ref_values)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(values, ref_merged, atol=TOL, equal_nan=False)


def test_the_head_never_sees_more_than_a_chunk(teacher, tiny_teacher_vocab, sequences,
                                               monkeypatch):
    seen = []
    head = teacher.head
    monkeypatch.setattr(teacher, "head", lambda h: seen.append(h.shape[0]) or head(h))
    monkeypatch.setattr(teacher, "logits", lambda *a: pytest.fail("full logits built"))
    for targets in ("teacher", "student"):
        TopKExtractor(teacher, tiny_teacher_vocab, 5, targets, chunk_tokens=13,
                      head="float32").rows(sequences)
    teacher_logprobs(TopKExtractor(teacher, tiny_teacher_vocab, 5, chunk_tokens=13),
                     tiny_teacher_vocab.tokenizer, sequences, batch_tokens=10_000, progress=False)
    assert max(seen) == 13 and len(seen) > 2 * math.ceil(sum(map(len, sequences)) / 13)


@settings(max_examples=12, deadline=None)
@given(chunk=st.integers(1, 120), k=st.integers(1, 12), student=st.booleans())
def test_chunk_size_never_changes_the_rows(teacher, tiny_teacher_vocab, sequences, chunk, k,
                                           student):
    targets = "student" if student else "teacher"
    ref = TopKExtractor(teacher, tiny_teacher_vocab, k, targets, chunk_tokens=10**6)
    got = TopKExtractor(teacher, tiny_teacher_vocab, k, targets, chunk_tokens=chunk)
    (ref_ids, ref_v), (ids, v) = ref.rows(sequences[:4]), got.rows(sequences[:4])
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(v, ref_v, atol=TOL)
    assert not torch.isnan(v).any()


@pytest.mark.parametrize("chunk", [1, 5, 100_000])
def test_chunked_teacher_logprobs_equal_the_full_softmax(teacher, tiny_teacher_vocab, sequences,
                                                         chunk):
    from dpfleet.public.teacher_tokenizer import load_teacher_spm, processor

    ext = TopKExtractor(teacher, tiny_teacher_vocab, 5, chunk_tokens=chunk)
    got = teacher_logprobs(ext, tiny_teacher_vocab.tokenizer, sequences, batch_tokens=40,
                           progress=False)
    sp = processor(load_teacher_spm(teacher.path))
    for value, seq in zip(got, sequences, strict=True):
        own = sp.encode(tiny_teacher_vocab.tokenizer.decode(seq))
        ids = torch.tensor([[2, *own]])
        with torch.no_grad():
            logp = torch.log_softmax(teacher.model(input_ids=ids).logits[0, :-1].double(), -1)
        total = logp.gather(-1, torch.tensor(own)[:, None]).sum().item()
        assert value == pytest.approx(total / len(seq), abs=1e-4)


def _brute_student_space(full: torch.Tensor, t2s: np.ndarray) -> list[dict[int, float]]:
    """Per row: student id -> log of the teacher probability mass mapped onto it (float64)."""
    rows = []
    for row in full.double():
        logp = torch.log_softmax(row, -1).tolist()
        mass: dict[int, float] = {}
        for t, lp in enumerate(logp):
            if t2s[t] >= 0:
                mass[int(t2s[t])] = mass.get(int(t2s[t]), 0.0) + math.exp(lp)
        rows.append({s: math.log(m) + torch.logsumexp(row, -1).item() for s, m in mass.items()})
    return rows


def test_student_space_topk_equals_brute_force(teacher, tiny_teacher_vocab, sequences):
    k = 10
    ext = TopKExtractor(teacher, tiny_teacher_vocab, k, "student", chunk_tokens=6)
    ids, values = ext.rows(sequences[:3])
    full = torch.cat([_full_logits(teacher, tiny_teacher_vocab, s) for s in sequences[:3]])
    for i, mass in enumerate(_brute_student_space(full, _t2s(tiny_teacher_vocab))):
        best = sorted(mass.items(), key=lambda kv: -kv[1])[:k]
        assert ids[i].tolist() == [s for s, _ in best]
        assert np.allclose(values[i].numpy(), [v for _, v in best], atol=1e-4)


def test_student_space_keeps_the_mass_teacher_space_loses(teacher, tiny_teacher_vocab, sequences):
    """The whole teacher distribution (over reachable ids) lands in student space, and its top-k
    holds at least the teacher-space top-k's mass, strictly more on some rows."""
    k = 10
    t2s = torch.as_tensor(_t2s(tiny_teacher_vocab))
    n_student = tiny_teacher_vocab.tokenizer.vocab_size
    full = torch.cat([_full_logits(teacher, tiny_teacher_vocab, s) for s in sequences])
    everything = student_space_reduce(t2s, n_student, n_student)(full)[1]
    reachable = torch.logsumexp(full.masked_fill(t2s < 0, float("-inf")), -1)
    assert torch.allclose(torch.logsumexp(everything, -1), reachable, atol=TOL)

    teacher_space = TopKExtractor(teacher, tiny_teacher_vocab, k).rows(sequences)[1]
    student_space = TopKExtractor(teacher, tiny_teacher_vocab, k, "student").rows(sequences)[1]
    lse = torch.logsumexp(full, -1)
    kept_t = torch.exp(torch.logsumexp(teacher_space, -1) - lse)  # probability kept per row
    kept_s = torch.exp(torch.logsumexp(student_space, -1) - lse)
    assert (kept_s >= kept_t - 1e-6).all()
    assert (kept_s - kept_t).max() > 0.02  # trimmed continuations outside the teacher's top-k


def test_empty_rows_are_minus_inf_never_nan(tmp_path):
    """A row with no reachable student id, and one with fewer than k: -inf slots, id PAD, all
    the way through the shard and back, and the KD loss skips the empty row."""
    t2s = torch.tensor([-1, -1, 5, 5, 6, -1])
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5, -1.0, 4.0], [1.0, 2.0, 3.0, 0.5, -1.0, 4.0]])
    ids, values = student_space_reduce(t2s, 8, 4)(logits)
    assert ids[0].tolist() == [5, 6, 0, 0]
    assert values[0, 0].item() == pytest.approx(math.log(math.exp(3) + math.exp(0.5)), abs=TOL)
    assert torch.isneginf(values[0, 2:]).all()
    ids_e, values_e = student_space_reduce(torch.full((6,), -1), 8, 4)(logits[:1])
    assert torch.isneginf(values_e).all() and (ids_e == PAD).all()

    arrays = _pack([[7, 7, 7]], torch.cat([ids, ids_e]), torch.cat([values, values_e]))
    assert not np.isnan(arrays["topk_logits"]).any()
    assert np.isneginf(arrays["topk_logits"][2]).all()
    (tmp_path / "manifest.json").write_text('{"shards": ["shard-00000.npz"]}')
    np.savez(tmp_path / "shard-00000.npz", **arrays)
    batch = TopKCorpus(tmp_path).batch([0])
    assert torch.isneginf(batch.topk_logits[0, 2]).all()
    student = torch.randn(1, 3, 8, requires_grad=True)
    loss = kd_loss(student, batch.topk_ids, batch.topk_logits, batch.targets != PAD)
    loss.backward()
    assert torch.isfinite(loss) and (student.grad[0, 2] == 0).all()
    assert (student.grad[0, :2] != 0).any()


def test_student_targets_corpus_round_trip_and_settings(teacher, tiny_teacher_vocab, sequences,
                                                        tmp_path):
    ext = TopKExtractor(teacher, tiny_teacher_vocab, 6, "student", chunk_tokens=9)
    manifest = build_corpus(ext, sequences, tmp_path, shard_sequences=3, batch_tokens=30,
                            progress=False)
    assert manifest["targets"] == "student"
    corpus = TopKCorpus(tmp_path)
    ids, values = ext.rows(sequences)
    assert torch.equal(torch.as_tensor(corpus.topk_ids), ids)
    rel = (values - values[:, :1]).numpy()
    assert np.allclose(corpus.topk_logits, rel, atol=2e-2, rtol=1e-3)
    with pytest.raises(DpfleetError, match="other settings"):
        build_corpus(TopKExtractor(teacher, tiny_teacher_vocab, 6), sequences, tmp_path,
                     shard_sequences=3, progress=False)


def test_bad_targets_and_chunk_are_user_errors(teacher, tiny_teacher_vocab):
    with pytest.raises(DpfleetError, match="targets must be one of"):
        TopKExtractor(teacher, tiny_teacher_vocab, 5, "both")
    with pytest.raises(DpfleetError, match="chunk_tokens"):
        TopKExtractor(teacher, tiny_teacher_vocab, 5, chunk_tokens=0)


def test_reduce_head_splits_extra_rows_with_the_hidden_rows(teacher):
    hidden = torch.randn(11, teacher.model.config.hidden_size)
    targets = torch.arange(11)
    whole = reduce_head(teacher, hidden, lambda lg, t: (lg.gather(-1, t[:, None]),), 100, targets)
    split = reduce_head(teacher, hidden, lambda lg, t: (lg.gather(-1, t[:, None]),), 4, targets)
    assert torch.allclose(whole[0], split[0], atol=TOL)
    assert torch.allclose(whole[0][:, 0], teacher.head(hidden)[torch.arange(11), targets],
                          atol=TOL)


# --- micro-batches of sequences through the body (memory flat in the batch size) ------------


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), budget=st.integers(1, 400))
def test_micro_batches_cover_the_rows_in_order_within_the_budget(lengths, budget):
    from dpfleet.public.teacher_head import micro_batches

    spans = micro_batches(np.asarray(lengths), budget)
    assert [i for s in spans for i in range(s.start, s.stop)] == list(range(len(lengths)))
    for s in spans:
        rows = lengths[s]
        assert len(rows) * max(rows) <= budget or len(rows) == 1
    # greedy: the next row would not have fitted into the span before it
    for before, after in zip(spans, spans[1:], strict=False):
        rows = lengths[before.start : after.start + 1]
        assert len(rows) * max(rows) > budget


@pytest.fixture(scope="module")
def ragged(tiny_teacher_vocab, sequences):
    """Sequences of many lengths (1 to 23 tokens), so micro-batches trim different widths."""
    cut = student_sequences([" ".join(["the king said unto them ."] * 4)] * 3,
                            tiny_teacher_vocab.tokenizer, seq_len=23)
    return [s[: 1 + (7 * i) % len(s)] for i, s in enumerate(sequences + cut)]


@settings(max_examples=20, deadline=None)
@given(body=st.integers(1, 300), chunk=st.integers(1, 120), student=st.booleans())
def test_micro_batched_rows_equal_the_one_shot_rows(teacher, tiny_teacher_vocab, ragged, body,
                                                    chunk, student):
    """The body over micro-batches of sequences and the head over chunks give the rows of one
    pass over the whole batch with one head chunk: ids exact, values within 1e-5."""
    targets = "student" if student else "teacher"
    one = TopKExtractor(teacher, tiny_teacher_vocab, 6, targets, chunk_tokens=10**6,
                        body_tokens=10**6)
    small = TopKExtractor(teacher, tiny_teacher_vocab, 6, targets, chunk_tokens=chunk,
                          body_tokens=body)
    (ref_ids, ref_v), (ids, v) = one.rows(ragged), small.rows(ragged)
    assert ids.shape == (sum(map(len, ragged)), 6)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(v, ref_v, atol=TOL, equal_nan=False)


@settings(max_examples=10, deadline=None)
@given(body=st.integers(1, 200), chunk=st.integers(1, 50))
def test_micro_batched_logprobs_equal_the_one_shot_logprobs(teacher, tiny_teacher_vocab, ragged,
                                                            body, chunk):
    tok = tiny_teacher_vocab.tokenizer
    one = TopKExtractor(teacher, tiny_teacher_vocab, 5, chunk_tokens=10**6, body_tokens=10**6)
    small = TopKExtractor(teacher, tiny_teacher_vocab, 5, chunk_tokens=chunk, body_tokens=body)
    ref = teacher_logprobs(one, tok, ragged, batch_tokens=10**6, progress=False)
    got = teacher_logprobs(small, tok, ragged, batch_tokens=10**6, progress=False)
    assert np.allclose(got, ref, atol=TOL, rtol=0)


def test_the_body_never_sees_more_than_its_budget(teacher, tiny_teacher_vocab, ragged,
                                                  monkeypatch):
    """A 10^6-token loader batch; the body gets at most 40 padded positions per pass (ragged's
    sequences are all shorter), the head at most 9 rows, for top-k and for l_pub."""
    passes, chunks = [], []
    body, head = teacher.body, teacher.head
    monkeypatch.setattr(teacher, "body", lambda i, m: passes.append(i.numel()) or body(i, m))
    monkeypatch.setattr(teacher, "head", lambda h: chunks.append(h.shape[0]) or head(h))
    ext = TopKExtractor(teacher, tiny_teacher_vocab, 5, chunk_tokens=9, body_tokens=40)
    ext.rows(ragged)
    teacher_logprobs(ext, tiny_teacher_vocab.tokenizer, ragged, batch_tokens=10**6,
                     progress=False)
    assert max(passes) <= 40 and max(chunks) <= 9
    assert len(passes) >= 2 * sum(map(len, ragged)) / 40  # the batch really was split


def test_bad_body_tokens_is_a_user_error(teacher, tiny_teacher_vocab):
    with pytest.raises(DpfleetError, match="body_tokens"):
        TopKExtractor(teacher, tiny_teacher_vocab, 5, body_tokens=-1)


def test_stored_corpus_does_not_depend_on_batch_or_body_size(teacher, tiny_teacher_vocab, ragged,
                                                             tmp_path):
    """What a user publishes (the shards) is the same whether the loader batches and the body
    passes were tiny or one pass took everything: ids exact, stored logits within float16."""
    stores = []
    for name, batch, body in (("small", 30, 17), ("one", 10**6, 10**6)):
        ext = TopKExtractor(teacher, tiny_teacher_vocab, 6, chunk_tokens=7, body_tokens=body)
        manifest = build_corpus(ext, ragged, tmp_path / name, shard_sequences=5,
                                batch_tokens=batch, progress=False)
        stores.append([dict(np.load(tmp_path / name / s)) for s in manifest["shards"]])
    for small, one in zip(*stores, strict=True):
        assert np.array_equal(small["topk_ids"], one["topk_ids"])
        assert np.array_equal(small["tokens"], one["tokens"])
        assert np.allclose(small["topk_logits"].astype(np.float32),
                           one["topk_logits"].astype(np.float32), atol=1e-2, rtol=1e-3)
