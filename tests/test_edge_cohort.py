"""Cohort training equals the sequential eager path client by client, for every zoo model.

Tolerance: the cohort runs batched matmuls over the client axis, the sequential path single
ones, so only float32 rounding differs: deltas within 1e-6 absolute (they are ~0.1), norms within
1e-5 relative, mean losses within 1e-5. Measured differences are ~4e-8 (see the report).
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.engine.backends import SequentialTrainer, make_trainer
from dpfleet.edge.cohort import CohortTrainer, bytes_per_client, chunk_size
from dpfleet.edge.cohort_lstm import RECURRENT
from dpfleet.edge.runtime import EagerRuntime
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ARCHITECTURES, ModelConfig, build_model
from dpfleet.export.params import get_flat

L = 9
BATCH = 8


def model_cfg(arch: str, **over) -> ModelConfig:
    return ModelConfig(**{**dict(arch=arch, vocab_size=64, embedding_dim=16, hidden_dim=24,
                                 projection_dim=16, num_heads=2, max_length=16), **over})


def client_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """n BOS-prefixed rows of random length, PAD-padded (as client_data.to_rows makes them)."""
    rows = rng.integers(4, 64, (n, L + 1)).astype(np.int32)
    rows[:, 0] = 1
    for i in range(n):
        rows[i, rng.integers(2, L + 1):] = 0
    return rows


def both(arch, examples, seeds, *, lr=0.5, clip=0.5, chunk=3, fused=True, **model):
    torch.manual_seed(0)
    cfg = model_cfg(arch, **model)
    theta = get_flat(build_model(cfg))
    seq = SequentialTrainer(EagerRuntime(cfg)).train_round(
        theta, examples, seeds, lr=lr, batch_size=BATCH, clip_norm=clip)
    trainer = CohortTrainer(cfg, seq_len=L, batch_size=BATCH, device="cpu", chunk=chunk, fused=fused)
    assert trainer.fused == (fused and arch in RECURRENT)
    cohort = trainer.train_round(theta, examples, seeds, lr=lr, batch_size=BATCH, clip_norm=clip)
    return seq, cohort


def assert_same(seq, cohort):
    assert len(seq) == len(cohort)
    for a, b in zip(seq, cohort, strict=True):
        np.testing.assert_allclose(b.delta, a.delta, rtol=0, atol=1e-6)
        assert b.norm == pytest.approx(a.norm, rel=1e-5)
        assert b.loss == pytest.approx(a.loss, abs=1e-5)
        assert b.clipped == a.clipped and b.num_examples == a.num_examples


@pytest.mark.parametrize(("arch", "fused"), [(a, True) for a in ARCHITECTURES]
                         + [(a, False) for a in RECURRENT])
def test_cohort_equals_sequential_for_every_zoo_model(arch, fused):
    """Recurrent models run the hand-written path (fused) and, with fused=False, torch.func."""
    rng = np.random.default_rng(1)
    # ragged: 1 row, a short last batch, exactly one batch, one row over, several batches
    examples = [client_rows(rng, n) for n in (1, 5, 8, 9, 33, 40, 2)]
    seeds = list(range(100, 107))
    unclipped, _ = both(arch, examples, seeds, clip=1e9, fused=fused)
    norms = sorted(u.norm for u in unclipped)
    clip = (norms[3] + norms[4]) / 2  # between two clients' norms: both clip branches run
    seq, cohort = both(arch, examples, seeds, clip=clip, fused=fused)
    assert_same(seq, cohort)
    assert any(u.clipped for u in seq) and not all(u.clipped for u in seq)


@pytest.mark.parametrize("arch", ["cifg", "transformer"])
def test_no_client_update_depends_on_another_clients_data(arch):
    """User-level sensitivity needs each delta to be a function of its own client only: change one
    client's data and every other client's delta stays the same, while the changed one moves by
    far more than the tolerance (a chunk that mixed clients would fail both ways)."""
    rng = np.random.default_rng(2)
    examples = [client_rows(rng, n) for n in (12, 30, 7, 19)]
    seeds = [5, 6, 7, 8]
    _, before = both(arch, examples, seeds, clip=100.0, chunk=4)
    examples[1] = client_rows(np.random.default_rng(99), 30)
    _, after = both(arch, examples, seeds, clip=100.0, chunk=4)
    for j in (0, 2, 3):
        np.testing.assert_allclose(after[j].delta, before[j].delta, rtol=0, atol=1e-6)
    assert np.abs(after[1].delta - before[1].delta).max() > 1e-3


@pytest.mark.parametrize("arch", ["cifg", "transformer"])
def test_another_clients_long_rows_do_not_move_a_short_clients_update(arch):
    """Attack on the block trimming (cut to the chunk's longest real row): the other clients'
    rows are short, client 1's grow from short to full length, so the shared block widens; the
    short clients' deltas stay the same while client 1's moves by far more than the tolerance."""
    rng = np.random.default_rng(3)
    examples = [client_rows(rng, n) for n in (12, 30, 7, 19)]
    for rows in examples:
        rows[:, 4:] = 0  # every row at most 3 real targets: the blocks are cut to 4 columns
    seeds = [5, 6, 7, 8]
    _, before = both(arch, examples, seeds, clip=100.0, chunk=4)
    examples[1] = np.random.default_rng(99).integers(4, 64, (30, L + 1)).astype(np.int32)
    examples[1][:, 0] = 1  # full-length rows: the chunk's block is L + 1 wide now
    _, after = both(arch, examples, seeds, clip=100.0, chunk=4)
    for j in (0, 2, 3):
        np.testing.assert_allclose(after[j].delta, before[j].delta, rtol=0, atol=1e-6)
    assert np.abs(after[1].delta - before[1].delta).max() > 1e-3


def test_chunking_does_not_change_results():
    rng = np.random.default_rng(3)
    examples = [client_rows(rng, n) for n in (3, 17, 25, 1, 9)]
    seeds = [1, 2, 3, 4, 5]
    _, one = both("lstm", examples, seeds, chunk=1)
    _, all_ = both("lstm", examples, seeds, chunk=5)
    assert_same(one, all_)


def test_diverged_client_contributes_nothing_like_the_sequential_path():
    rng = np.random.default_rng(4)
    examples = [client_rows(rng, 20), client_rows(rng, 4)]
    seq, cohort = both("cifg", examples, [1, 2], lr=1e30, clip=1.0)
    for a, b in zip(seq, cohort, strict=True):
        assert np.isinf(a.norm) == np.isinf(b.norm)
        if np.isinf(b.norm):
            assert not b.delta.any() and b.clipped
    assert any(np.isinf(u.norm) for u in cohort)


@settings(max_examples=8, deadline=None)
@given(sizes=st.lists(st.integers(1, 26), min_size=1, max_size=5),
       seed=st.integers(0, 2**31 - 1), clip=st.floats(0.01, 2.0))
def test_property_cohort_matches_and_clips(sizes, seed, clip):
    rng = np.random.default_rng(seed)
    examples = [client_rows(rng, n) for n in sizes]
    seeds = [seed + i for i in range(len(sizes))]
    seq, cohort = both("lstm", examples, seeds, clip=clip, chunk=2)
    assert_same(seq, cohort)
    for u in cohort:
        assert np.linalg.norm(u.delta.astype(np.float64)) <= clip * (1 + 1e-5)


def test_chunk_size_rule():
    cfg = model_cfg("lstm")
    per = bytes_per_client(cfg, BATCH, L)
    cpu = torch.device("cpu")
    assert chunk_size(cfg, BATCH, L, cpu, memory_mb=1) == max(1, 2**20 // per)
    assert chunk_size(cfg, BATCH, L, cpu, memory_mb=64) == 64 * 2**20 // per
    assert chunk_size(cfg, BATCH, L, cpu, memory_mb=64) >= chunk_size(cfg, BATCH, L, cpu, memory_mb=8)
    big = ModelConfig(arch="lstm", vocab_size=4096, embedding_dim=96, hidden_dim=256, projection_dim=96)
    assert bytes_per_client(big, 16, 20) > 30 * 2**20  # ~36 MiB: weights x3 + logits x4


class _ExportedStandIn:
    """Stands in for an exported ExecuTorch / ONNX runtime: only its name matters here."""

    name = "onnx"


def test_make_trainer_picks_and_refuses():
    cfg = model_cfg("cifg")
    eager = EagerRuntime(cfg)
    assert make_trainer("auto", eager, cfg, seq_len=L, batch_size=BATCH, device="cpu").name == "cohort"
    assert make_trainer("sequential", eager, cfg, seq_len=L, batch_size=BATCH).name == "sequential"
    assert make_trainer("auto", _ExportedStandIn(), cfg, seq_len=L, batch_size=BATCH).name == "sequential"
    with pytest.raises(DpfleetError, match="needs 'sequential'"):
        make_trainer("cohort", _ExportedStandIn(), cfg, seq_len=L, batch_size=BATCH)
    with pytest.raises(DpfleetError, match="client.trainer"):
        make_trainer("fast", eager, cfg, seq_len=L, batch_size=BATCH)


def test_bad_examples_are_a_clear_error():
    cfg = model_cfg("cifg")
    trainer = CohortTrainer(cfg, seq_len=L, batch_size=BATCH, device="cpu")
    theta = get_flat(build_model(cfg))
    with pytest.raises(DpfleetError, match="token rows"):
        trainer.train_round(theta, [np.zeros(5, dtype=np.int32)], [1], lr=0.1, batch_size=BATCH,
                            clip_norm=1.0)
    with pytest.raises(DpfleetError, match="one seed per client"):
        trainer.train_round(theta, [client_rows(np.random.default_rng(0), 3)], [], lr=0.1,
                            batch_size=BATCH, clip_norm=1.0)
