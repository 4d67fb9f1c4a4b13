"""Exact discrete Gaussian N_Z(0, sigma^2) from uniform random words (Canonne, Kamath, Steinke 2020).

Why: with secure aggregation the release lives in Z_(2^b); adding integer noise there means no
floating-point sampler (whose rounding and tails leak, Mironov 2012) ever touches a release.

The sampler follows CKS Alg. 1-3 and makes every decision by integer comparison:
- uniform integers in [0, m) by rejection from uint64 words (`uniform_below`: a word w is kept
  iff w < 2^64 - (2^64 mod m), then w mod m), so each value is exactly uniform;
- Bernoulli(num / den) is `uniform_below(den) < num`; Bernoulli(exp(-gamma)) for rational
  gamma = g + r / den is g Bernoulli(exp(-1)) trials and one Bernoulli(exp(-r / den)) (Alg. 1:
  the parity of the first failing K in Bernoulli(x / K) trials, each drawn as Bernoulli(x) AND
  Bernoulli(1 / K), so no product den * K can overflow);
- discrete Laplace of scale t (Alg. 2) and the Gaussian acceptance exp(-(|y| - sigma^2 / t)^2 /
  (2 sigma^2)) (Alg. 3). Writing sigma^2 / t = c / e in lowest terms, the exponent is
  (e |y| - c)^2 q / (2 p e^2) with sigma^2 = p / q: a ratio of integers.

Vectorised: every step works on numpy int64 / uint64 arrays over the coordinates still waiting
for a sample. Integers that could leave int64 (huge sigma^2 denominators, far-tail |y|) take an
exact Python-int path per element (`_scalar`), so the output is exact for every sigma^2; the fast
path covers all elements when sigma^2 / t has a small denominator, e.g. sigma^2 = t * c
(`integer_sigma_sq` builds one).

`t` is the discrete Laplace scale: any t >= 1 gives exactly N_Z(0, sigma^2) (the proposal's
exp(-|y| / t) cancels in Alg. 3), CKS choose floor(sigma) + 1 for speed; the default here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Protocol

import numpy as np

INT63 = (1 << 63) - 1
MAX_SCALE = 1 << 32  # t above this could overflow X = U + t V in int64 (see `_laplace_trial`)


class WordStream(Protocol):
    def words(self, n: int) -> np.ndarray:
        """n uniform uint64 words, continuing where the previous call stopped."""
        ...


def uniform_below(m: int | np.ndarray, stream: WordStream, n: int | None = None) -> np.ndarray:
    """Exactly uniform integers in [0, m) per element (m: an int, with `n`, or a uint64 array;
    1 <= m < 2^64). A word w is kept iff w < 2^64 - (2^64 mod m), then w mod m."""
    if np.ndim(m) == 0:
        m = int(m)
        if m & (m - 1) == 0:  # a power of two: every word is kept, the low bits are uniform
            return stream.words(n) & np.uint64(m - 1)
        if m < 1 << 32:
            return _uniform_below_32(m, n, stream)
        limit, mod = np.uint64((1 << 64) - 1 - (1 << 64) % m), np.uint64(m)
    else:
        mod = np.ascontiguousarray(m, dtype=np.uint64).ravel()
        limit = ~((np.uint64(0) - mod) % mod)  # 2^64 - 1 - (2^64 mod m), by uint64 wrap-around
        n = mod.size
    out = stream.words(n)
    bad = np.flatnonzero(out > limit)
    while bad.size:  # probability < m / 2^64 per word
        out[bad] = stream.words(bad.size)
        bad = bad[out[bad] > (limit if limit.ndim == 0 else limit[bad])]
    return out % mod


def _uniform_below_32(m: int, n: int, stream: WordStream) -> np.ndarray:
    """Uniform in [0, m), m < 2^32, from 32-bit halves of words without division (Lemire 2019):
    x * m = u 2^32 + low with x uniform in [0, 2^32) is kept iff low >= 2^32 mod m; then
    every u in [0, m) has exactly floor(2^32 / m) accepted x."""
    mask32, mm, threshold = np.uint64(0xFFFFFFFF), np.uint64(m), np.uint64((1 << 32) % m)

    def halves(count: int) -> np.ndarray:
        w = stream.words(-(-count // 2))
        return np.concatenate([w >> np.uint64(32), w & mask32])[:count]

    prod = halves(n) * mm
    bad = np.flatnonzero((prod & mask32) < threshold)
    while bad.size:  # probability m / 2^32 per draw
        prod[bad] = halves(bad.size) * mm
        bad = bad[(prod[bad] & mask32) < threshold]
    return prod >> np.uint64(32)


def bernoulli(num: np.ndarray, den: int, stream: WordStream) -> np.ndarray:
    """Bernoulli(num / den) per element (0 <= num <= den < 2^63, den an int)."""
    num = np.asarray(num, dtype=np.int64)
    if den == 1:  # num is 0 or 1: no randomness
        return num >= 1
    return uniform_below(den, stream, num.size) < num.astype(np.uint64)


def bernoulli_exp_fraction(num: np.ndarray, den: int, stream: WordStream) -> np.ndarray:
    """Bernoulli(exp(-num / den)) per element for 0 <= num <= den (CKS Alg. 1, gamma <= 1).

    Every element still looping at pass K has the same K, so Bernoulli(1 / K) is one scalar-m
    uniform draw per pass; an element that fails at pass K returns whether K is odd."""
    num = np.asarray(num, dtype=np.int64)
    out = np.zeros(num.size, dtype=bool)
    active, k = np.arange(num.size), 1
    while active.size:
        hit = bernoulli(num[active], den, stream)  # Bernoulli(gamma / K) = B(gamma) and B(1 / K)
        if k > 1:
            hit &= uniform_below(k, stream, active.size) == 0
        if k % 2:
            out[active[~hit]] = True
        active, k = active[hit], k + 1
    return out


def bernoulli_exp(whole: np.ndarray, num: np.ndarray, den: int, stream: WordStream) -> np.ndarray:
    """Bernoulli(exp(-(whole + num / den))) per element (whole >= 0, 0 <= num < den)."""
    whole = np.asarray(whole, dtype=np.int64)
    alive = np.ones(whole.shape, dtype=bool)
    j = 0
    while True:  # exp(-1) once per unit of `whole`, stopping at the first failure
        idx = np.flatnonzero(alive & (whole > j))
        if not idx.size:
            break
        alive[idx] = bernoulli_exp_fraction(np.ones(idx.size, np.int64), 1, stream)
        j += 1
    idx = np.flatnonzero(alive)
    alive[idx] = bernoulli_exp_fraction(np.asarray(num, np.int64)[idx], den, stream)
    return alive


class DiscreteGaussian:
    """Sampler of N_Z(0, sigma^2), sigma^2 a non-negative rational, from a `WordStream`."""

    def __init__(self, sigma_sq: Fraction | int, t: int | None = None):
        sigma_sq = Fraction(sigma_sq)
        if sigma_sq < 0:
            raise ValueError(f"sigma^2 must be >= 0, got {sigma_sq}")
        self.sigma_sq = sigma_sq
        self.t = math.isqrt(sigma_sq.numerator // sigma_sq.denominator) + 1 if t is None else int(t)
        if self.t < 1 or self.t > MAX_SCALE:
            raise ValueError(f"Laplace scale t must be in [1, 2^32], got {self.t}")
        self.p, self.q = sigma_sq.numerator, sigma_sq.denominator
        m = sigma_sq / self.t
        self.c, self.e = m.numerator, m.denominator
        self.den = 2 * self.p * self.e**2  # gamma(y) = (e |y| - c)^2 q / den
        # |y| up to y_fast keeps (e |y| - c)^2 q < 2^63; beyond, or if den is huge: Python ints
        a_max = math.isqrt(INT63 // self.q)
        fits = self.den <= INT63 and self.c <= a_max and self.e <= INT63
        self.y_fast = min((a_max + self.c) // self.e, INT63 // self.e) if fits else -1

    def sample(self, n: int, stream: WordStream) -> np.ndarray:
        """n independent samples (int64); consumes words from `stream` only."""
        out = np.zeros(n, dtype=np.int64)
        if self.sigma_sq == 0:
            return out
        todo = np.arange(n)
        while todo.size:
            y, ok = self._laplace_trial(todo.size, stream)
            idx = np.flatnonzero(ok)
            ok[idx] = self._accept(np.abs(y[idx]), stream)
            out[todo[ok]] = y[ok]
            todo = todo[~ok]
        return out

    def _laplace_trial(self, n: int, stream: WordStream) -> tuple[np.ndarray, np.ndarray]:
        """One round of CKS Alg. 2 for n elements: (candidate, whether Alg. 2 accepted it)."""
        t = self.t
        u = uniform_below(np.full(n, t, np.uint64), stream).astype(np.int64)
        ok = bernoulli_exp_fraction(u, t, stream)
        v = np.zeros(n, dtype=np.int64)
        going = np.flatnonzero(ok)
        while going.size:  # V: the number of Bernoulli(exp(-1)) successes before a failure
            hit = bernoulli_exp_fraction(np.ones(going.size, np.int64), 1, stream)
            v[going[hit]] += 1
            going = going[hit]
        if v.max(initial=0) > (INT63 - t) // t:  # probability below exp(-2^31)
            raise OverflowError("discrete Laplace draw left int64")
        x = u + t * v
        sign = bernoulli(np.ones(n, np.int64), 2, stream)  # Y = 1: negative
        ok &= ~(sign & (x == 0))
        return np.where(sign, -x, x), ok

    def _accept(self, y_abs: np.ndarray, stream: WordStream) -> np.ndarray:
        """Bernoulli(exp(-(|y| - sigma^2 / t)^2 / (2 sigma^2))) per element (CKS Alg. 3)."""
        keep = np.zeros(y_abs.size, dtype=bool)
        fast = np.flatnonzero(y_abs <= self.y_fast)
        if fast.size:
            a = self.e * y_abs[fast] - self.c
            num = a * a * self.q
            keep[fast] = bernoulli_exp(num // self.den, num % self.den, self.den, stream)
        for i in np.flatnonzero(y_abs > self.y_fast):  # exact Python ints, one element at a time
            num = (self.e * int(y_abs[i]) - self.c) ** 2 * self.q
            keep[i] = _scalar_bernoulli_exp(num, self.den, stream)
        return keep


def _scalar_uniform_below(m: int, stream: WordStream) -> int:
    """Uniform in [0, m) for any Python int m >= 1, from as many words as m needs."""
    k = max(1, -(-m.bit_length() // 64))
    limit = ((1 << (64 * k)) // m) * m
    while True:
        value = 0
        for w in stream.words(k).tolist():
            value = value << 64 | w
        if value < limit:
            return value % m


def _scalar_bernoulli_exp(num: int, den: int, stream: WordStream) -> bool:
    """Bernoulli(exp(-num / den)) with Python ints (Alg. 1; exp(-1) per whole unit)."""
    whole, rest = divmod(num, den)

    def exp_fraction(n: int, d: int) -> bool:
        k = 1
        while _scalar_uniform_below(d, stream) < n and (k == 1 or _scalar_uniform_below(k, stream) == 0):
            k += 1
        return k % 2 == 1

    for _ in range(whole):  # stops at the first failure: expected < 2 trials
        if not exp_fraction(1, 1):
            return False
    return exp_fraction(rest, den)


def integer_sigma_sq(target: float) -> tuple[Fraction, int]:
    """(sigma^2, t) with sigma^2 = t * c >= target, t = floor(sqrt(target)) + 1: an integer
    sigma^2 whose sigma^2 / t is an integer, so the sampler's fast path covers |y| < ~40 sigma."""
    target_q = Fraction(target)
    if target_q <= 0:
        raise ValueError(f"sigma^2 must be positive, got {target}")
    t = math.isqrt(math.floor(target_q)) + 1
    c = math.ceil(target_q / t)
    return Fraction(t * c), t


class DiscreteGaussianNodes:
    """Tree-node noise in Z^dim: node (tree_id, level, index) is N_Z(0, sigma^2 I) drawn from
    `stream(tree_id, level, index)` alone, so any node can be recomputed (residual = prefix)."""

    def __init__(self, sigma_sq: Fraction | int, dim: int,
                 stream: Callable[[int, int, int], WordStream], *, t: int | None = None):
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.sampler = DiscreteGaussian(sigma_sq, t)
        self.dim, self.stream = dim, stream

    @property
    def sigma_sq(self) -> Fraction:
        return self.sampler.sigma_sq

    def __call__(self, tree_id: int, level: int, index: int) -> np.ndarray:
        return self.sampler.sample(self.dim, self.stream(tree_id, level, index))
