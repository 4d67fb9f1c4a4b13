"""What the server sees reveals nothing: a masked input is uniform on the ring, and fewer than
t Shamir shares are uniform and consistent with every secret."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.secagg import crypto
from dpfleet.secagg import messages as m
from dpfleet.secagg.inprocess import run_round
from dpfleet.secagg.params import RoundSetup


def _chi2_limit(df: int) -> float:
    """Upper 1e-6 quantile of chi-square(df) (Wilson-Hilferty): a false alarm once in a million."""
    z = 4.753
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _assert_uniform(values: np.ndarray, buckets: int) -> None:
    counts = np.bincount(values, minlength=buckets)
    expected = values.size / buckets
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_limit(buckets - 1), f"chi2 {chi2:.1f} with {buckets - 1} df"


@pytest.mark.parametrize("pattern", ["zeros", "ones", "ramp"])
def test_a_single_masked_input_is_uniform_on_the_ring(pattern):
    """Whatever the input, the masked vector the server receives is uniform on Z_(2^16)."""
    length, bits = 200_000, 16
    x = {"zeros": np.zeros(length), "ones": np.full(length, 65535),
         "ramp": np.arange(length) % 7}[pattern].astype(np.uint16)
    seen = {}

    def grab(phase, sender, recipient, data):
        if phase == "mask" and sender == 0:
            seen["y"] = m.decode(data).vector
        return [data]

    setup = RoundSetup(n=3, k=2, threshold=2, length=length, bits=bits)
    run_round(setup, lambda u: x if u == 0 else np.zeros(length, np.uint16), intercept=grab)
    y = seen["y"]
    _assert_uniform((y >> 8).astype(np.int64), 256)  # high byte
    _assert_uniform((y & 0xFF).astype(np.int64), 256)  # low byte
    _assert_uniform(((y[:-1] >> 12).astype(np.int64) << 4) | (y[1:] >> 12), 256)  # pairs


def test_fewer_than_t_shares_are_uniform_whatever_the_secret():
    t, trials = 3, 4000
    for secret in (b"\x00\x00", b"\xff\xff"):
        pairs = np.array([
            np.frombuffer(b"".join(crypto.share_secret(secret, [1, 2, 3], t)[:2]), "<u4")
            for _ in range(trials)
        ], dtype=np.int64)
        _assert_uniform(pairs[:, 0] % 64, 64)
        _assert_uniform(pairs[:, 1] % 64, 64)
        _assert_uniform((pairs[:, 0] - pairs[:, 1]) % crypto.PRIME % 64, 64)


def _eval_through(points: list[tuple[int, int]], x: int) -> int:
    """The value at x of the unique polynomial of degree < len(points) through points."""
    p, total = crypto.PRIME, 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num, den = num * (x - xj) % p, den * (xi - xj) % p
        total = (total + yi * num * pow(den, p - 2, p)) % p
    return total


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.binary(min_size=2, max_size=2), st.binary(min_size=2, max_size=2))
def test_t_minus_one_shares_are_consistent_with_every_secret(t, secret, other):
    """Any t-1 shares extend to a full valid sharing of *any* secret: they carry no
    information about which one was shared."""
    xs = list(range(1, t + 1))
    shares = crypto.share_secret(secret, xs, t)
    seen = [(x, int(np.frombuffer(s, "<u4")[0])) for x, s in zip(xs[:-1], shares[:-1],
                                                                   strict=True)]
    forged_point = (0, int(np.frombuffer(other, "<u2")[0]))
    y = _eval_through([forged_point, *seen], xs[-1])
    completed = [(x, np.array([v], "<u4").tobytes()) for x, v in [*seen, (xs[-1], y)]]
    assert crypto.reconstruct_secret(completed, t, 2) == other
