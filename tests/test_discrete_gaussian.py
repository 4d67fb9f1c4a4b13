"""The discrete Gaussian sampler is exact: its samples follow the N_Z(0, sigma^2) pmf (chi-square),
its variance is the pmf's (below sigma^2 for small sigma, as CKS 2020 Sec. 2 shows), it is a function
of the stream's words alone, and no floating-point value decides anything."""

import ast
import hashlib
import inspect
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dpfleet.coordinator.mechanisms import discrete_gaussian as dgm
from dpfleet.coordinator.mechanisms.discrete_gaussian import (
    DiscreteGaussian,
    DiscreteGaussianNodes,
    integer_sigma_sq,
    uniform_below,
)
from dpfleet.coordinator.mechanisms.noise_stream import NodeStream


def stream(seed: int, tree_id: int = 0) -> NodeStream:
    return NodeStream(seed.to_bytes(32, "little"), tree_id, 0, 0)


def pmf(sigma_sq: float, support: np.ndarray) -> np.ndarray:
    """The exact N_Z(0, sigma^2) pmf on `support` (test-side reference; floats are fine here)."""
    wide = np.arange(-int(40 * math.sqrt(sigma_sq)) - 40, int(40 * math.sqrt(sigma_sq)) + 41)
    norm = np.exp(-wide.astype(float) ** 2 / (2 * sigma_sq)).sum()
    return np.exp(-support.astype(float) ** 2 / (2 * sigma_sq)) / norm


def chi_square_p(samples: np.ndarray, sigma_sq: float) -> float:
    """p-value of the samples against the pmf, bins with expected count >= 5 (tails merged)."""
    n = samples.size
    reach = int(math.sqrt(sigma_sq) * 12) + 3
    support = np.arange(-reach, reach + 1)
    expected = pmf(sigma_sq, support) * n
    keep = expected >= 5
    lo, hi = support[keep].min(), support[keep].max()
    observed = np.array([np.sum(samples <= lo)]
                        + [np.sum(samples == v) for v in range(lo + 1, hi)] + [np.sum(samples >= hi)])
    exp_in = pmf(sigma_sq, np.arange(lo + 1, hi))
    exp = np.concatenate([[pmf(sigma_sq, support[support <= lo]).sum()], exp_in,
                          [pmf(sigma_sq, support[support >= hi]).sum()]]) * n
    return float(stats.chisquare(observed, exp * observed.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("sigma_sq", [Fraction(1, 4), Fraction(1), Fraction(9), Fraction(400)])
def test_samples_follow_the_exact_pmf(sigma_sq):
    x = DiscreteGaussian(sigma_sq).sample(40_000, stream(7))
    assert chi_square_p(x, float(sigma_sq)) > 1e-4
    support = np.arange(-int(40 * math.sqrt(sigma_sq)) - 40, int(40 * math.sqrt(sigma_sq)) + 41)
    var = float(np.sum(pmf(float(sigma_sq), support) * support.astype(float) ** 2))
    assert var <= float(sigma_sq) * (1 + 1e-12)  # the discrete Gaussian's variance is < sigma^2
    se = var * math.sqrt(2 / x.size) * 1.5  # sd of a sample variance (kurtosis ~3), with slack
    assert abs(x.var() - var) < 5 * se
    assert abs(x.mean()) < 5 * math.sqrt(var / x.size)


def test_small_sigma_variance_is_measurably_below_sigma_sq():
    """sigma = 0.5: Var = 0.2150..., not 0.25; a continuous-then-round sampler would give 0.33."""
    x = DiscreteGaussian(Fraction(1, 4)).sample(100_000, stream(3))
    support = np.arange(-20, 21)
    var = float(np.sum(pmf(0.25, support) * support.astype(float) ** 2))
    assert var == pytest.approx(0.2150, abs=1e-4)
    assert x.var() == pytest.approx(var, abs=0.006) and x.var() < 0.235
    rounded = np.round(np.random.default_rng(0).normal(0, 0.5, 100_000))
    assert rounded.var() > 0.3  # the float shortcut is a different distribution


def test_tail_path_with_python_integers_agrees():
    """Force the exact Python-int path for |y| > 2 (normally only the far tail) and for a sigma^2
    whose integers leave int64: same pmf."""
    dg = DiscreteGaussian(Fraction(9))
    dg.y_fast = 2
    assert chi_square_p(dg.sample(20_000, stream(11)), 9.0) > 1e-4
    big = DiscreteGaussian(Fraction(10**17 + 1, 3))
    assert big.y_fast == -1  # everything through Python ints
    x = big.sample(3_000, stream(12))
    sigma = math.sqrt((10**17 + 1) / 3)
    assert abs(x.mean()) < 5 * sigma / math.sqrt(x.size)
    assert x.std() / sigma == pytest.approx(1, abs=5 / math.sqrt(2 * x.size))


@settings(deadline=None, max_examples=20)
@given(st.integers(1, 10**6), st.integers(1, 50), st.integers(0, 2**64 - 1))
def test_any_sigma_and_key_gives_the_right_moments(p, q, seed):
    sigma_sq = Fraction(p, q)
    x = DiscreteGaussian(sigma_sq).sample(4_000, stream(seed))
    assert x.dtype == np.int64
    sigma = math.sqrt(sigma_sq)
    assert abs(x.mean()) < 6 * sigma / math.sqrt(x.size) + 1e-9
    if sigma >= 1:  # the variance is sigma^2 up to e^(-2 pi^2 sigma^2)
        assert x.var() / sigma**2 == pytest.approx(1, abs=6 * math.sqrt(2 / x.size) * 1.5)
    else:
        assert x.var() <= sigma**2 + 6 * sigma**2 * math.sqrt(2 / x.size) * 1.5


@settings(deadline=None, max_examples=25)
@given(st.integers(2, 2**63), st.integers(1, 300), st.integers(0, 2**32))
def test_uniform_below_stays_in_range_and_hits_both_ends(m, n, seed):
    u = uniform_below(m, stream(seed), n)
    assert u.dtype == np.uint64 and u.shape == (n,) and int(u.max()) < m
    small = uniform_below(np.full(3000, 3, np.uint64), stream(seed))
    assert set(small.tolist()) == {0, 1, 2}


class ScriptedStream:
    """Words that are a fixed function of a script (SHA-256 of script and position): the
    sampler's output must be a function of them alone."""

    def __init__(self, script):
        self.script, self.pos = repr([int(w) for w in script]).encode(), 0

    def words(self, n):
        out = [int.from_bytes(hashlib.sha256(self.script + str(self.pos + i).encode()).digest()[:8],
                              "little") for i in range(n)]
        self.pos += n
        return np.array(out, dtype=np.uint64)


def banned_floats():
    """A MonkeyPatch under which every float source a sampler could lean on raises."""
    def banned(*args, **kwargs):
        raise AssertionError("floating-point call in the discrete sampler")
    patch = pytest.MonkeyPatch()
    for mod, names in ((math, ("exp", "log", "sqrt", "floor", "ceil")),
                       (np, ("exp", "log", "sqrt", "floor", "ceil", "round", "float64")),
                       (np.random, ("default_rng", "random", "normal"))):
        for name in names:
            patch.setattr(mod, name, banned)
    return patch


@settings(deadline=None, max_examples=30)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=64),
       st.sampled_from([Fraction(1, 4), Fraction(2), Fraction(50), Fraction(10**9 + 7, 7)]))
def test_output_is_a_function_of_the_words_alone(script, sigma_sq):
    dg = DiscreteGaussian(sigma_sq)
    patch = banned_floats()
    try:
        a = dg.sample(50, ScriptedStream(script))
        b = dg.sample(50, ScriptedStream(script))
    finally:
        patch.undo()
    np.testing.assert_array_equal(a, b)
    c = dg.sample(50, ScriptedStream(script + [0]))
    assert not np.array_equal(a, c) or sigma_sq < 1  # other words, other samples


SAMPLER = ("uniform_below", "_uniform_below_32", "bernoulli", "bernoulli_exp_fraction",
           "bernoulli_exp", "DiscreteGaussian", "_scalar_uniform_below", "_scalar_bernoulli_exp")


def test_sampler_source_has_no_float_operations():
    """Static check of every function the sampler runs: no float literal, true division,
    float() / exp / log / sqrt, or float dtype."""
    tree = ast.parse(inspect.getsource(dgm))
    bodies = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)
              and n.name in SAMPLER]
    assert {b.name for b in bodies} == set(SAMPLER)
    for body in bodies:
        for node in ast.walk(body):
            if isinstance(node, ast.Constant) and isinstance(node.value, float):
                pytest.fail(f"float literal in {body.name}")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                # only Fraction division (sigma_sq / t) is allowed: it stays exact
                assert "sigma_sq" in ast.unparse(node), f"true division in {body.name}"
            name = ast.unparse(node) if isinstance(node, ast.Attribute | ast.Name) else ""
            assert name not in ("float", "math.exp", "math.log", "math.sqrt", "np.exp", "np.log",
                                "np.sqrt", "np.float64", "np.float32"), f"{name} in {body.name}"


def test_nodes_are_recomputable_and_distinct():
    key = bytes(range(32))
    def factory(t, lv, ix):
        return NodeStream(key, t, lv, ix)
    nodes = DiscreteGaussianNodes(Fraction(100), 5000, factory)
    a, b = nodes(0, 2, 3), nodes(0, 2, 3)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64 and a.shape == (5000,)
    other = nodes(0, 2, 4)
    assert np.corrcoef(a, other)[0, 1] < 0.1 and not np.array_equal(a, other)
    other_key = DiscreteGaussianNodes(Fraction(100), 5000,
                                      lambda t, lv, ix: NodeStream(bytes(32), t, lv, ix))(0, 2, 3)
    assert (a - other_key).std() > 12  # another key: unrelated noise (std 10 sqrt 2 = 14.1)


@pytest.mark.parametrize("target", [0.3, 1.0, 2.5, 1e4 + 0.5, 4.2e15])
def test_integer_sigma_sq_rounds_up_and_stays_fast(target):
    sigma_sq, t = integer_sigma_sq(target)
    assert sigma_sq >= Fraction(target) and sigma_sq.denominator == 1 and sigma_sq % t == 0
    assert float(sigma_sq) <= target * (1 + 2 / math.sqrt(target)) + 2
    dg = DiscreteGaussian(sigma_sq, t)
    assert dg.y_fast > 30 * math.sqrt(target)  # int64 fast path well into the tail


@pytest.mark.parametrize("whole,num,den", [(0, 0, 7), (0, 1, 3), (0, 5, 10), (0, 1, 1), (2, 3, 4),
                                           (0, 123_456_789, 10**17)])
def test_bernoulli_exp_hits_exp_minus_gamma(whole, num, den):
    n = 200_000
    s = stream(whole * 1000 + num % 997)
    if num == den:
        got = dgm.bernoulli_exp_fraction(np.full(n, num), den, s)
    else:
        got = dgm.bernoulli_exp(np.full(n, whole), np.full(n, num), den, s)
    p = math.exp(-(whole + num / den))
    assert abs(got.mean() - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-12
