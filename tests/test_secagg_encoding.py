"""Discretization: rotation, conditional rounding, element-wise clip, the proven bounds."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.secagg.encoding import Discretizer


def _ring_sum(disc, encodings):
    total = np.zeros(disc.padded_length, dtype=np.int64)
    for e in encodings:
        total += e.values
    return (total % (1 << disc.bits)).astype(encodings[0].values.dtype)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5000), st.sampled_from([1, 4, 64, 1 << 14]), st.integers(0, 2**32))
def test_rotation_is_orthogonal_and_invertible(length, block, seed):
    disc = Discretizer(length, 1.0, 32, 1, seed, block_size=block)
    x = np.random.default_rng(seed).normal(size=length)
    z = disc.rotate(x)
    assert z.size == disc.padded_length == max(length, disc.block)
    assert np.isclose(np.linalg.norm(z), np.linalg.norm(x))
    np.testing.assert_allclose(disc.unrotate(z), x, atol=1e-9)


@pytest.mark.parametrize("length", [100_000, 1_000_000, 4_400_000, 16_384 * 3 + 1])
def test_no_padding_past_one_block_and_every_coordinate_still_spread(length):
    """The overlapping last block replaces zero-padding (14.7% at d = 1e5 before); a unit
    input anywhere, including where the last two blocks overlap, stays spread to the
    Hoeffding bound the scale is computed from."""
    disc = Discretizer(length, 1.0, 32, 10, seed=3)
    assert disc.padded_length == length
    bound = np.sqrt(2 * np.log(2 * length / disc.clip_failure) / disc.block)
    for j in (0, length - disc.block - 1, length - disc.block + 1, length - 1):
        x = np.zeros(length)
        x[j] = 1.0
        z = disc.rotate(x)
        assert np.abs(z).max() <= bound and np.isclose(np.linalg.norm(z), 1.0)


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 8),
    length=st.integers(1, 3000),
    bits=st.integers(12, 32),
    clip=st.floats(1e-3, 1e3),
    fill=st.floats(0.0, 1.5),  # input norms relative to the clip; above 1 gets clipped
    seed=st.integers(0, 2**32),
)
def test_decoded_sum_is_within_the_quantization_bound(n, length, bits, clip, fill, seed):
    disc = Discretizer(length, clip, bits, n, seed)
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=length) for _ in range(n)]
    xs = [x * (fill * clip / max(np.linalg.norm(x), 1e-300)) for x in xs]
    encodings = [disc.encode(x, rng) for x in xs]
    clipped = [x * min(1.0, clip / max(np.linalg.norm(x), 1e-300)) for x in xs]
    assert all(e.clipped_coordinates == 0 for e in encodings)
    error = np.linalg.norm(disc.decode(_ring_sum(disc, encodings)) - np.sum(clipped, axis=0))
    assert error <= disc.quantization_bound(n)
    for x, e in zip(xs, encodings, strict=True):
        assert np.linalg.norm(disc.decode(e.values)) <= disc.sensitivity * (1 + 1e-12)
        assert e.input_scaled_down == (np.linalg.norm(x) > clip)
    assert disc.norm_inflation >= 1


def test_worst_case_inputs_never_wrap_the_modulus():
    """Every client aims its whole norm at one rotated coordinate (the rotation is public): the
    element-wise clip cuts it, and the ring sum still equals the integer sum."""
    n, bits, length = 7, 12, 64
    disc = Discretizer(length, 1.0, bits, n, seed=0)
    spike = np.zeros(length)
    spike[3] = 1.0
    x = disc.unrotate(spike)
    encodings = [disc.encode(sign * x, np.random.default_rng(i))
                 for i, sign in enumerate([1, 1, 1, 1, 1, 1, -1])]
    assert all(e.clipped_coordinates == 1 for e in encodings)
    signed = [np.where(e.values >= 1 << (bits - 1), e.values.astype(np.int64) - (1 << bits),
                       e.values) for e in encodings]
    assert max(int(np.abs(s).max()) for s in signed) == disc.level
    np.testing.assert_allclose(disc.rotate(disc.decode(_ring_sum(disc, encodings))) * disc.scale,
                               np.sum(signed, axis=0), atol=1e-6)


def test_randomized_rounding_is_unbiased():
    disc = Discretizer(8, 1.0, 8, 1, seed=2)
    x = np.linspace(-0.9, 0.9, 8) / 3
    rng = np.random.default_rng(0)
    draws = 1000
    mean = np.mean([disc.decode(disc.encode(x, rng).values) for _ in range(draws)], axis=0)
    # one decode errs by std <= 1/(2s) per coordinate; floor-rounding would be off by ~1/(2s)
    assert np.max(np.abs(mean - x)) < 6 * (0.5 / disc.scale) / np.sqrt(draws)


def test_too_few_bits_are_refused():
    with pytest.raises(ValueError, match="bits"):
        Discretizer(10, 1.0, 8, 200, seed=0)
    with pytest.raises(ValueError):
        Discretizer(10, 1.0, 16, 2, seed=0, block_size=3)
    with pytest.raises(ValueError):
        Discretizer(10, 1.0, 16, 2, seed=0).encode(np.zeros(11), np.random.default_rng())
