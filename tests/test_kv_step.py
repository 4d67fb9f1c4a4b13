"""Transformer KV-cache step: equal to the window program's last-position logits (ONNX, weight
inputs), slots past `position` never leak into the answer, and a message longer than the cache
is refused instead of silently wrapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numerics import assert_scaled_close

from dpfleet.edge.ort_session import load_session
from dpfleet.edge.tokenizer import BOS, PAD
from dpfleet.errors import DpfleetError
from dpfleet.export.kv_step import KVCacheStep, empty_cache, kv_step_program, kv_streamed_logits
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.phone import window_program_with_weight_inputs
from dpfleet.export.training import onnx_param_name

pytest.importorskip("onnxruntime")

SEQ_LEN = 8


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    torch.manual_seed(0)
    cfg = ModelConfig(arch="transformer", vocab_size=60, embedding_dim=16, hidden_dim=32, num_heads=2,
                      num_layers=2, max_length=16)
    model = build_model(cfg).eval()
    with torch.no_grad():  # untrained positions are ~0: widen them so position errors show
        model.pos.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp("kv")
    window_program_with_weight_inputs(model, SEQ_LEN, folder / "infer.onnx")
    kv_step_program(model, SEQ_LEN, folder / "kv.onnx")
    weights = {onnx_param_name(n): p.detach().numpy() for n, p in model.named_parameters()}
    window = load_session((folder / "infer.onnx").read_bytes(), "infer.onnx", 1)
    step = load_session((folder / "kv.onnx").read_bytes(), "kv.onnx", 1)
    return model, window, step, weights


def window_last(window, weights, ids):
    row = np.full((1, SEQ_LEN), PAD, np.int64)
    row[0, : len(ids)] = ids
    return window.run(None, {"tokens": row, **weights})[0][0, len(ids) - 1]


@pytest.mark.slow
def test_step_equals_window_and_eager(programs):
    model, window, step, weights = programs
    rng = np.random.default_rng(0)
    previous = None
    for n in range(SEQ_LEN):  # 0 .. seq_len - 1 message tokens after BOS
        ids = [BOS, *rng.integers(4, model.cfg.vocab_size, n).tolist()]
        got = kv_streamed_logits(step, model.cfg, SEQ_LEN, ids, weights)
        assert_scaled_close(got, window_last(window, weights, ids))
        with torch.no_grad():
            eager = model(torch.tensor([ids]))[0, -1].numpy()
        assert_scaled_close(got, eager)
        if previous is not None:
            assert np.abs(got - previous).max() > 1e-2  # every step really changes the answer
        previous = got


@pytest.mark.slow
def test_wrong_position_gives_wrong_logits(programs):
    """The position input is load-bearing: the same tokens fed at shifted slots differ."""
    model, _, step, weights = programs
    ids = [BOS, 7, 9, 11]
    right = kv_streamed_logits(step, model.cfg, SEQ_LEN, ids, weights)
    keys, values = empty_cache(model.cfg, SEQ_LEN)
    for position, t in enumerate(ids):
        logits, keys, values = step.run(None, {"token": np.array([t]), "position": np.array(position + 2),
                                               "keys": keys, "values": values, **weights})
    assert np.abs(logits[0] - right).max() > 1e-2


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.slow
def test_stale_slots_never_leak(programs, seed):
    """Garbage in the cache slots after `position` (a reused buffer) does not change the logits."""
    model, _, _, _ = programs
    step = KVCacheStep(model, SEQ_LEN).eval()
    rng = np.random.default_rng(seed)
    ids = [BOS, *rng.integers(4, model.cfg.vocab_size, 3).tolist()]
    outs = []
    for junk in (0.0, 100.0):
        keys, values = (torch.from_numpy(c) for c in empty_cache(model.cfg, SEQ_LEN))
        keys += junk * torch.from_numpy(rng.standard_normal(keys.shape).astype(np.float32))
        values += junk * torch.from_numpy(rng.standard_normal(values.shape).astype(np.float32))
        with torch.no_grad():
            for position, t in enumerate(ids):
                logits, keys, values = step(torch.tensor([t]), torch.tensor(position), keys, values)
        outs.append(logits[0].numpy())
    assert_scaled_close(outs[0], outs[1])


@pytest.mark.slow
def test_batched_candidates_keep_rows_apart(programs):
    model, _, step, weights = programs
    keys, values = empty_cache(model.cfg, SEQ_LEN, batch=3)
    for position, tokens in enumerate(([BOS] * 3, [5, 6, 7])):
        logits, keys, values = step.run(None, {"token": np.array(tokens), "position": np.array(position),
                                               "keys": keys, "values": values, **weights})
    for row, t in enumerate([5, 6, 7]):
        alone = kv_streamed_logits(step, model.cfg, SEQ_LEN, [BOS, t], weights)
        assert_scaled_close(logits[row], alone)


@pytest.mark.slow
def test_message_longer_than_the_cache_is_refused(programs):
    model, _, step, weights = programs
    with pytest.raises(DpfleetError, match="re-feed the last 7"):
        kv_streamed_logits(step, model.cfg, SEQ_LEN, [BOS] * (SEQ_LEN + 1), weights)
    with pytest.raises(DpfleetError, match="cache slots"):
        KVCacheStep(model, model.cfg.max_length + 1)
    with pytest.raises(DpfleetError, match="transformer only"):
        lstm = build_model(ModelConfig(vocab_size=20, embedding_dim=8, hidden_dim=8, projection_dim=8))
        KVCacheStep(lstm, 4)
