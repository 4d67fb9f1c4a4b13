"""The int8-screened LM head (public/teacher_screen.py) against the float32 head it replaces.

The reference is a plain float32 `h @ W.T` (+ bias, softcap) and its `topk`. The screen returns
float32 dot products of the same rows summed in another order, so values agree to 1e-5; its ids
must be the reference's wherever the reference's k-th and (k+1)-th logits are apart (ties and
near-ties may swap places legitimately, so the weights here are drawn without them).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.errors import DpfleetError
from dpfleet.public.teacher import Teacher
from dpfleet.public.teacher_screen import (
    Int8Screen,
    int8_gemm_available,
    resolve_head,
    screen_output_dtype,
)
from dpfleet.public.topk import TopKExtractor

pytestmark = pytest.mark.skipif(not int8_gemm_available(), reason="no oneDNN quantized linear")
torch.set_num_threads(1)


def _reference(h, w, bias=None, cap=None, k=10):
    logits = h @ w.T
    if bias is not None:
        logits = logits + bias
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.topk(k, dim=-1)


@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(40, 700), dim=st.integers(8, 96), rows=st.integers(1, 40),
       k=st.integers(1, 12), seed=st.integers(0, 2**31 - 1), with_bias=st.booleans(),
       cap=st.sampled_from([None, 30.0]))
def test_screened_topk_is_the_float32_topk(vocab, dim, rows, k, seed, with_bias, cap):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, dim, generator=gen)
    h = torch.randn(rows, dim, generator=gen) * 3
    bias = torch.randn(vocab, generator=gen) if with_bias else None
    ref_v, ref_i = _reference(h, w, bias, cap, k)
    values, ids = Int8Screen(w, bias, cap).topk(h, k)
    assert values.dtype == torch.float32
    assert torch.allclose(values, ref_v, atol=1e-4)
    # ids agree except where two reference logits are within float32 noise of each other
    full = _reference(h, w, bias, cap, min(vocab, k + 1))[0]
    apart = (full[:, :-1] - full[:, 1:]).abs().min(1).values > 1e-4 if k < vocab else True
    assert torch.equal(ids[apart], ref_i[apart])


def test_a_row_with_a_tiny_norm_is_screened_as_well_as_a_large_one():
    # One activation scale per chunk would leave the small row a handful of int8 levels; each row
    # is scaled to max |h| = 1 first, so its own top-k survives.
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5000, 64, generator=gen)
    h = torch.randn(8, 64, generator=gen)
    h[3] *= 1e-5
    h[5] *= 1e4
    ref_v, ref_i = _reference(h, w)
    values, ids = Int8Screen(w).topk(h, 10)
    assert torch.equal(ids, ref_i)
    assert torch.allclose(values, ref_v, rtol=1e-5, atol=1e-9)


def test_the_screen_writes_bfloat16_only_where_onednn_has_bf16_kernels():
    """On an AVX2 CPU oneDNN writes bfloat16 through its reference kernel (2,400x slower than
    float32 output; a real-teacher job took hours): the screen must write float32 there."""
    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    w, h = torch.randn(300, 32), torch.randn(4, 32)
    assert Int8Screen(w).approximate(h).dtype == (torch.bfloat16 if onednn_bf16 else torch.float32)
    assert screen_output_dtype() == (torch.bfloat16 if onednn_bf16 else torch.float32)


def test_the_approximate_logits_do_not_saturate():
    """Rows and weights of one sign at full scale: the u8 x s8 pair sums that saturate a CPU
    without VNNI (vpmaddubsw) if activations use all 8 bits. Each logit is within its
    quantization error of the exact one (error 29 with 8 bits and float32 output, AMD EPYC AVX2)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.rand(256, 64, generator=gen) + 0.5
    w[128:] *= -1
    h = torch.rand(6, 64, generator=gen) + 0.5
    screen = Int8Screen(w)
    exact = (h / h.abs().amax(1, keepdim=True)) @ w.T
    approx = screen.approximate(h).float()
    # per product at most half a step of each factor: 64 x (1.5/63 + 1.5/127) / 2 < 1.2
    assert (approx - exact).abs().max() < 1.2
    assert torch.equal(approx.argmax(1), exact.argmax(1))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_either_output_dtype_screens_the_float32_topk(out_dtype):
    """Both outputs the screen may write (by CPU) rank the same candidates; bfloat16 on a CPU
    without oneDNN BF16 is slow but correct, at this size a fraction of a second."""
    gen = torch.Generator().manual_seed(11)
    w, h = torch.randn(2000, 48, generator=gen), torch.randn(16, 48, generator=gen)
    screen = Int8Screen(w)
    screen._out_dtype = out_dtype
    assert screen.approximate(h).dtype == out_dtype
    ref_v, ref_i = _reference(h, w)
    values, ids = screen.topk(h, 10)
    assert torch.equal(ids, ref_i)
    assert torch.allclose(values, ref_v, atol=1e-4)


def test_padding_ids_past_the_vocabulary_are_never_candidates():
    # 130 ids: the second group of 128 has 126 padding slots. With every real logit negative,
    # a padding slot's 0 would beat them if it were not -inf.
    w = -torch.rand(130, 16) - 0.5
    h = torch.rand(4, 16) + 0.1
    screen = Int8Screen(w, candidates=32)
    ids = screen.candidate_ids(h)
    assert int(ids.max()) < 130
    assert torch.equal(screen.topk(h, 5)[1], _reference(h, w, k=5)[1])


@pytest.fixture(scope="module")
def teacher(wide_tiny_teacher):
    return wide_tiny_teacher


def test_the_extractor_rows_of_both_heads_agree(teacher, tiny_teacher_vocab):
    from dpfleet.public.topk import student_sequences

    texts = ["The king said unto them, go forth and multiply .",
             "In 1998 the city council voted to rebuild the old bridge over the river ."]
    seqs = student_sequences(texts * 3, tiny_teacher_vocab.tokenizer, seq_len=9)
    fast = TopKExtractor(teacher, tiny_teacher_vocab, 8, head="int8")
    slow = TopKExtractor(teacher, tiny_teacher_vocab, 8, head="float32")
    assert (fast.head_mode, slow.head_mode) == ("int8", "float32")
    (ids_f, v_f), (ids_s, v_s) = fast.rows(seqs), slow.rows(seqs)
    assert torch.equal(ids_f, ids_s)
    assert torch.allclose(v_f, v_s, atol=1e-5)


def test_head_choice(teacher):
    assert resolve_head("float32", teacher, "teacher") == "float32"
    assert resolve_head("auto", teacher, "student") == "float32"  # needs every logit's mass
    with pytest.raises(DpfleetError, match="targets = teacher"):
        resolve_head("int8", teacher, "student")
    with pytest.raises(DpfleetError, match="head must be one of"):
        resolve_head("fp8", teacher, "teacher")
    gpu = Teacher(teacher.name, teacher.path, teacher.model, torch.device("meta"),
                  head_weight=teacher.head_weight)
    assert resolve_head("auto", gpu, "teacher") == "float32"  # only a CPU takes the screen
    with pytest.raises(DpfleetError, match="device = cpu"):
        resolve_head("int8", gpu, "teacher")
