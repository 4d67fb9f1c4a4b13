import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dpfleet.edge.client_update import client_update, clip_l2
from dpfleet.edge.minibatch import batches
from dpfleet.edge.runtime import EagerRuntime
from dpfleet.export.models import ModelConfig

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@given(arrays(np.float32, st.integers(1, 200), elements=finite), st.floats(1e-3, 1e3))
def test_clip_bounds_norm_and_keeps_direction(vec, clip):
    out, norm = clip_l2(vec, clip)
    assert norm == pytest.approx(float(np.linalg.norm(vec.astype(np.float64))), rel=1e-9)
    assert np.linalg.norm(out.astype(np.float64)) <= clip  # exactly, not up to rounding
    if norm <= clip:
        np.testing.assert_array_equal(out, vec)
    else:
        np.testing.assert_allclose(out * (norm / clip), vec, rtol=1e-4, atol=1e-3)


@settings(max_examples=300)
@given(st.integers(1, 5000), st.floats(1e-6, 1e6), st.floats(1e-3, 1e3), st.integers(0, 2**32 - 1))
def test_clip_never_exceeds_the_bound_over_scales(d, scale, clip, seed):
    vec = (np.random.default_rng(seed).standard_normal(d) * scale).astype(np.float32)
    out, norm = clip_l2(vec, clip)
    assert out.dtype == np.float32
    assert float(np.linalg.norm(out.astype(np.float64))) <= clip
    if norm > clip:  # only the rounding step is taken off: the length is C to float32 precision
        assert float(np.linalg.norm(out.astype(np.float64))) >= clip * (1 - 1e-6)


def test_plain_float32_scaling_does_exceed_the_bound():
    """The bug this guards against: scale in float64, round to float32, and the norm is > C."""
    worst = 0.0
    for seed in range(200):
        vec = np.random.default_rng(seed).standard_normal(1000).astype(np.float32)
        norm = float(np.linalg.norm(vec.astype(np.float64)))
        naive = (vec * (0.3 / norm)).astype(np.float32)
        worst = max(worst, float(np.linalg.norm(naive.astype(np.float64))) / 0.3 - 1)
        out, _ = clip_l2(vec, 0.3)
        assert float(np.linalg.norm(out.astype(np.float64))) <= 0.3
    assert worst > 1e-8  # the naive clip overshoots; clip_l2 above never does


def test_clip_rejects_nonpositive_bound():
    with pytest.raises(ValueError):
        clip_l2(np.ones(3, np.float32), 0.0)


@settings(deadline=None, max_examples=30)
@given(st.integers(1, 100), st.integers(1, 20), st.integers(0, 1000))
def test_epoch_batches_cover_every_example_once(n, bs, seed):
    got = np.concatenate(batches(n, bs, seed))
    assert sorted(got.tolist()) == list(range(n))
    assert all(len(b) <= bs for b in batches(n, bs, seed))


def test_client_update_is_clipped_delta_of_one_epoch():
    cfg = ModelConfig(arch="lstm", vocab_size=50, embedding_dim=8, hidden_dim=16, projection_dim=8)
    rt = EagerRuntime(cfg)
    theta0 = rt.get_weights()
    rows = np.random.default_rng(0).integers(4, 50, (35, 6)).astype(np.int32)
    big = client_update(rt, theta0, rows, lr=0.5, batch_size=16, clip_norm=1e6, seed=1)
    small = client_update(rt, theta0, rows, lr=0.5, batch_size=16, clip_norm=1e-3, seed=1)
    assert not big.clipped and small.clipped
    assert big.norm == pytest.approx(small.norm, rel=1e-5)  # same epoch from the same theta0
    assert np.linalg.norm(small.delta) == pytest.approx(1e-3, rel=1e-4)
    np.testing.assert_allclose(small.delta / 1e-3, big.delta / big.norm, rtol=1e-3, atol=1e-6)
    np.testing.assert_array_equal(rt.get_weights() - theta0, big.delta)  # 3 steps really ran
    assert big.num_examples == 35


def test_diverged_client_contributes_a_zero_delta():
    cfg = ModelConfig(arch="cifg", vocab_size=30, embedding_dim=4, hidden_dim=4, projection_dim=4)
    rt = EagerRuntime(cfg)
    rows = np.random.default_rng(1).integers(4, 30, (16, 6)).astype(np.int32)
    u = client_update(rt, rt.get_weights(), rows, lr=1e30, batch_size=4, clip_norm=1.0, seed=0)
    assert u.clipped and u.norm == float("inf")
    assert np.all(u.delta == 0) and u.delta.dtype == np.float32
