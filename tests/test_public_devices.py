"""Devices chosen on purpose (issue 16 item 3): the student trains where its config says (CPU
by default, whatever accelerator is present), the teacher takes the accelerator when present,
and a device that cannot be had is a one-line user error. The CUDA-only check (bf16 body with a
float32 head) runs only where a GPU is present."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpfleet.cli import main
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.params import get_flat
from dpfleet.public import teacher as teacher_module
from dpfleet.public.kd_pretrain import KDTrainConfig, PlainCorpus, kd_train, student_device
from dpfleet.public.teacher import load_teacher
from dpfleet.public.teacher_head import auto_body_tokens
from dpfleet.public.topk import TopKExtractor, student_sequences

torch.set_num_threads(1)
TINY = {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16}


def _train(vocab, steps=6, **cfg):
    seqs = student_sequences(["the king said unto them go forth ."] * 20, vocab.tokenizer, 8)
    model_cfg = ModelConfig(vocab_size=vocab.tokenizer.vocab_size, **TINY)
    torch.manual_seed(0)
    theta0 = get_flat(build_model(model_cfg))
    return kd_train(model_cfg, theta0, PlainCorpus(seqs), None,
                    KDTrainConfig(steps=steps, batch_size=4, lr=1e-2, **cfg), progress=False)


def test_student_stays_on_cpu_when_an_accelerator_is_present(tiny_teacher_vocab, monkeypatch):
    """The old code moved the student to CUDA whenever `cuda.is_available()`; claim one is
    present (none is here, so any move to CUDA would fail) and train: the default stays on CPU
    and gives the same weights as with no accelerator at all."""
    plain, _ = _train(tiny_teacher_vocab)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    claimed, _ = _train(tiny_teacher_vocab)
    assert np.array_equal(plain, claimed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_student_without_cuda_is_a_user_error(tiny_teacher_vocab):
    with pytest.raises(DpfleetError, match="no CUDA device"):
        _train(tiny_teacher_vocab, device="cuda")


@pytest.mark.parametrize("name", ["gpu0", "meta", "cuda:x"])
def test_unknown_student_device_is_a_user_error(name):
    with pytest.raises(DpfleetError, match="student device"):
        student_device(name)


def test_pretrain_cli_bad_device_is_one_line(tiny_teacher_vocab, tmp_path, capsys):
    folder = tiny_teacher_vocab.tokenizer.model_file.parent
    with pytest.raises(SystemExit) as exit_info:
        main(["public", "pretrain", "--tokenizer", str(folder), "--out", str(tmp_path / "ck"),
              "--dataset", "wikitext2", "--max-records", "20", "--steps", "2", "--device", "tpu9"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "student device" in err[0]


def test_teacher_takes_the_accelerator_when_present(tiny_teacher_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert teacher_module.default_device().type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert teacher_module.default_device().type == "cpu"
    teacher = load_teacher(str(tiny_teacher_dir), device="cpu", precision="float32")
    # CPU at float32: float32 throughout, and the head is the model's own weight (no second copy)
    assert next(teacher.model.parameters()).dtype == torch.float32
    assert teacher.head_weight is teacher.model.get_output_embeddings().weight
    assert auto_body_tokens(teacher) == 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_teacher_bf16_body_fp32_head(tiny_teacher_dir, tiny_teacher_vocab):
    cpu = load_teacher(str(tiny_teacher_dir), device="cpu")
    gpu = load_teacher(str(tiny_teacher_dir), device="cuda")
    assert next(gpu.model.get_decoder().parameters()).dtype == torch.bfloat16
    assert gpu.head_weight.dtype == torch.float32
    seqs = student_sequences(["the king said unto them go forth ."] * 4,
                             tiny_teacher_vocab.tokenizer, 8)
    ids_c, v_c = TopKExtractor(cpu, tiny_teacher_vocab, 5, chunk_tokens=7).rows(seqs)
    ids_g, v_g = TopKExtractor(gpu, tiny_teacher_vocab, 5, chunk_tokens=7).rows(seqs)
    assert v_g.dtype == torch.float32 and torch.allclose(v_g.cpu(), v_c, atol=0.1)
    assert (ids_g.cpu()[:, 0] == ids_c[:, 0]).float().mean() > 0.9
    assert 256 <= auto_body_tokens(gpu) <= 1 << 16


def test_body_pass_follows_free_accelerator_memory(tiny_teacher_dir, monkeypatch):
    """0 = automatic: 1,024 tokens per body pass on CPU; on CUDA, more free memory gives larger
    passes within [256, 65536] (mem_get_info stands in for a GPU here; no kernel runs). The
    loader batch is max(16384, one body pass), whatever the device."""
    from dpfleet.public.teacher import Teacher
    from dpfleet.public.teacher_head import resolve_batch_tokens, resolve_body_tokens

    cpu = load_teacher(str(tiny_teacher_dir), device="cpu")
    assert resolve_body_tokens(cpu, 0, 512) == 1024 and resolve_body_tokens(cpu, 77, 512) == 77
    assert resolve_batch_tokens(0, 1024) == 16384 and resolve_batch_tokens(0, 40_000) == 40_000
    assert resolve_batch_tokens(77, 40_000) == 77
    with pytest.raises(ValueError):
        resolve_body_tokens(cpu, -1, 512)
    with pytest.raises(ValueError):
        resolve_batch_tokens(-1, 512)
    fake = Teacher(cpu.name, cpu.path, cpu.model, torch.device("cuda"), cpu.head_weight)
    sizes = []
    for free_gib in (0.001, 0.05, 0.2, 80):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d, f=free_gib: (int(f * 2**30), 0))
        sizes.append(auto_body_tokens(fake, chunk_tokens=512))
    assert sizes[0] == 256 and sizes[-1] == 1 << 16
    assert sizes == sorted(sizes) and sizes[1] < sizes[2]


def test_cuda_precision_plan_runs_on_cpu(tiny_teacher_dir, tiny_teacher_vocab):
    """The CUDA cast (bf16 body, float32 head copy taken before the cast) applied to a CPU model:
    the mixed-precision forward path the GPU runs, here on CPU kernels. The head copy holds the
    original float32 weights exactly, the stored values stay float32, and the rows stay close to
    the float32 teacher's (bf16 rounds the hidden state to ~3 digits)."""
    from dpfleet.public.teacher import Teacher, cast_for_device

    ref = load_teacher(str(tiny_teacher_dir), device="cpu")
    assert cast_for_device(ref.model, "cpu") is None
    mixed = load_teacher(str(tiny_teacher_dir), device="cpu")
    original = mixed.model.get_output_embeddings().weight.detach().clone()
    head = cast_for_device(mixed.model, "cuda")
    assert next(mixed.model.get_decoder().parameters()).dtype == torch.bfloat16
    assert head.dtype == torch.float32 and torch.equal(head, original)
    assert head.data_ptr() != mixed.model.get_output_embeddings().weight.data_ptr()
    mixed = Teacher(mixed.name, mixed.path, mixed.model, torch.device("cpu"), head)
    seqs = student_sequences(["the king said unto them go forth ."] * 4,
                             tiny_teacher_vocab.tokenizer, 8)
    ids_r, v_r = TopKExtractor(ref, tiny_teacher_vocab, 5, chunk_tokens=7).rows(seqs)
    ids_m, v_m = TopKExtractor(mixed, tiny_teacher_vocab, 5, chunk_tokens=7).rows(seqs)
    assert v_m.dtype == torch.float32 and not torch.equal(v_m, v_r)  # the bf16 body did run
    assert torch.allclose(v_m, v_r, atol=0.1)
    assert (ids_m[:, 0] == ids_r[:, 0]).float().mean() > 0.9


def test_body_pass_arithmetic_for_gemma_on_an_h100():
    """body_tokens_for_memory with Gemma-3-270M's shape (hidden 640, MLP 2048, 4 heads, vocab
    262,144, bf16 body): the chosen pass plus the head chunk fits the budget, one more token's
    worth would not, a free 80 GiB card hits the 65,536 cap, and 8 GiB (whose half the 4 GiB head
    chunk fills) gets the 256 floor. (A namespace stands in for the model config; no GPU.)"""
    from types import SimpleNamespace

    from dpfleet.public.teacher_head import body_tokens_for_memory

    gemma = SimpleNamespace(hidden_size=640, intermediate_size=2048, num_attention_heads=4)
    per_token = (6 * 640 + 3 * 2048 + 4 * 128) * 2 + 4 * 640  # body activations + fp32 hidden row
    head = 2 * 2048 * 262_144 * 4
    for free in (int(8.5 * 2**30), 9 * 2**30):  # the 4 GiB head chunk leaves 0.25, 0.5 GiB
        n = body_tokens_for_memory(gemma, 2, 262_144, free, chunk_tokens=2048)
        assert 256 < n < 1 << 16
        assert n * per_token + head <= 0.5 * free < (n + 1) * per_token + head
    assert body_tokens_for_memory(gemma, 2, 262_144, 80 * 2**30, 2048) == 1 << 16
    assert body_tokens_for_memory(gemma, 2, 262_144, 8 * 2**30, 2048) == 256  # the head chunk alone
    # a float32 body (element size 4) gets fewer tokens from the same memory
    assert body_tokens_for_memory(gemma, 4, 262_144, 9 * 2**30, 2048) < \
        body_tokens_for_memory(gemma, 2, 262_144, 9 * 2**30, 2048)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tests_run_deterministic_and_rows_repeat_bit_for_bit(tiny_teacher_dir,
                                                                  tiny_teacher_vocab):
    """On a GPU the suite runs with the documented flags (tests/conftest.py), so the resume
    tests' bit-exact comparisons are valid there too; the student-space scatter (index_add_)
    then gives the same bits on a second run."""
    import os

    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")
    gpu = load_teacher(str(tiny_teacher_dir), device="cuda")
    seqs = student_sequences(["the king said unto them go forth ."] * 6,
                             tiny_teacher_vocab.tokenizer, 8)
    ext = TopKExtractor(gpu, tiny_teacher_vocab, 5, "student", chunk_tokens=7, body_tokens=16)
    (ids_a, v_a), (ids_b, v_b) = ext.rows(seqs), ext.rows(seqs)
    assert torch.equal(ids_a, ids_b) and torch.equal(v_a, v_b)


def test_cpu_teacher_body_follows_the_cpus_precision(tiny_teacher_dir, tiny_teacher_vocab):
    """precision "auto" on CPU (the CLI's default): a bfloat16 body and a float32 head copy
    where the CPU has native BF16 (the rows then close to the float32 teacher's), float32
    throughout elsewhere."""
    from dpfleet.edge.precision import resolve_precision

    ref = load_teacher(str(tiny_teacher_dir), device="cpu", precision="float32")
    auto = load_teacher(str(tiny_teacher_dir), device="cpu", precision="auto")
    expected = resolve_precision("auto")
    assert auto.precision == expected
    body = next(auto.model.get_decoder().parameters()).dtype
    assert body == expected.dtype and auto.head_weight.dtype == torch.float32
    seqs = student_sequences(["the king said unto them go forth ."] * 4, tiny_teacher_vocab.tokenizer, 8)
    ids_r, v_r = TopKExtractor(ref, tiny_teacher_vocab, 5, chunk_tokens=7).rows(seqs)
    ids_a, v_a = TopKExtractor(auto, tiny_teacher_vocab, 5, chunk_tokens=7).rows(seqs)
    assert v_a.dtype == torch.float32 and torch.allclose(v_a, v_r, atol=0.1)
    assert torch.equal(v_a, v_r) == (expected.name == "float32")
    assert (ids_a[:, 0] == ids_r[:, 0]).float().mean() > 0.9


def test_pretrain_auto_precision_reads_the_students_size(tiny_teacher_vocab, tmp_path, monkeypatch):
    """On a CPU with BF16 (simulated), `public pretrain --precision auto` keeps a small student
    at float32 (its GEMMs ran no faster in bfloat16) and pretrain.json says so and why."""
    import json

    from dpfleet.edge import precision as precision_mod

    monkeypatch.setattr(precision_mod, "native_bf16", lambda: "AMX-BF16")
    folder = tiny_teacher_vocab.tokenizer.model_file.parent
    out = tmp_path / "ck"
    main(["public", "pretrain", "--tokenizer", str(folder), "--out", str(out), "--dataset",
          "wikitext2", "--max-records", "20", "--steps", "2", "--hidden-dim", "32",
          "--embedding-dim", "16", "--projection-dim", "16"])
    stated = json.loads((out / "pretrain.json").read_text())["precision"]
    assert stated["name"] == "float32" and "parameters are under 262,144" in stated["reason"]
