"""From a clipped float update to a vector in Z_(2^b) and back (Kairouz, Liu, Steinke 2021).

SecAgg sums integers modulo 2^b, DP-FTRL wants a real sum with a known L2 sensitivity. Per
client (`encode`):

1. clip to L2 norm C (the round engine already did; enforced again, never trusted);
2. flatten; vectors shorter than the rotation block B (a power of two) are zero-padded to the
   next power of two, longer ones are not padded at all (step 3);
3. rotate: z = H D x / sqrt(B) on each whole block, D random signs from the round's shared
   seed, H the Walsh-Hadamard matrix; when B does not divide d, one more rotation with fresh
   signs covers the last B coordinates, overlapping the previous block. Each step is
   orthogonal, so ||z|| = ||x||, and every final coordinate is the output of one size-B
   rotation of a vector of norm <= C with independent signs: by Hoeffding every coordinate is
   below C sqrt(2 ln(2 d' / beta_clip) / B) with probability 1 - beta_clip, which is what lets
   a few bits per coordinate suffice, at no padding cost (zero-padding to a multiple of B
   cost 14.7% at d = 1e5);
4. scale by s and round randomly (unbiased), re-drawing until ||q|| <= Delta_s -- conditional
   randomized rounding, so the norm after rounding has a hard bound;
5. clip every coordinate to [-L, L] with L = floor((2^(b-1) - 1) / n): n clients can then never
   wrap around the modulus, so the modular sum equals the integer sum (the "very small chance
   that the modular operator inflates sensitivity" of paper 002, Sec. 2.4, is gone). Clipping
   toward zero can only shrink the norm, and with the scale below it almost never triggers;
6. wrap into Z_(2^b) (two's complement).

`decode` maps the ring sum back to signed integers, divides by s and rotates back.

Whose randomness rounds (step 4): a real device's own, unseen by the coordinator, unless the
run is in research mode (`dp.noise_seed` >= 0), where the coordinator hands each device
`rounding_seed(round seed, position)` and the in-process simulation rounds with the same, so
`simulate` and `serve` release the same bits. Only the rotation signs and the rounding are
random here, and neither the sensitivity nor the quantization bound depends on their secrecy:
both hold for every draw (secagg/THREAT_MODEL.md, "Research-mode rounding").

Guarantees (for DP accounting and for the tests):
- sensitivity: every client's decoded contribution has L2 norm <= `sensitivity` =
  Delta_s / s, Delta_s^2 = min((sC)^2 + d'/4 + sqrt(2 ln(1/beta)) (sC + sqrt(d')/2),
  (sC + sqrt(d'))^2); DP-FTRL must calibrate its noise to this, i.e. C * `norm_inflation`;
- quantization: when no coordinate was clipped in step 5, the decoded sum of m clients is
  within `quantization_bound(m)` = m sqrt(d') / s (L2) of the exact sum of their clipped
  inputs, since each rounding error is below 1 in every coordinate and the rotation is
  orthogonal (the truncation of the padding only shrinks the error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dpfleet.secagg.crypto import ring_dtype

HADAMARD_GROUP = 1 << 15  # float64 entries transformed together: 256 KiB stays in L2
MAX_ROUNDING_DRAWS = 64  # each draw passes with probability >= 1 - beta, beta = e^-1/2
ROUNDING_TAG = 0xE1C  # separates the rounding streams from the round seed's other uses


def rounding_seed(round_seed: int, position: int) -> list[int]:
    """The seed (NumPy `SeedSequence` entropy words) of the rounding randomness of the client at
    `position` in the round (attempt) whose discretizer has `round_seed`: keyed by round,
    attempt and position, so a reopened attempt never reuses a draw. The in-process simulation
    always rounds with it; a served device only in research mode, sent in its assignment."""
    return [int(round_seed), ROUNDING_TAG, int(position)]


def rounding_rng(seed: object) -> np.random.Generator:
    """The generator of a `rounding_seed` as received over the wire: exactly three 32-bit
    words, anything else a ValueError (a device refuses such an assignment)."""
    if (not isinstance(seed, list) or len(seed) != 3
            or not all(isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 1 << 32
                       for w in seed)):
        raise ValueError(f"rounding_seed must be three 32-bit words, got {seed!r}")
    return np.random.default_rng(seed)


@dataclass(frozen=True)
class Encoded:
    """One client's ring vector and what encoding did to it."""

    values: np.ndarray
    clipped_coordinates: int  # coordinates cut to [-L, L] (step 5)
    rounding_draws: int  # conditional rounding attempts (step 4)
    input_scaled_down: bool  # the input exceeded C and was scaled to it (step 1)


@dataclass(frozen=True)
class Discretizer:
    """Encoding shared by all clients of a round (same seed, clip, bits and client count)."""

    length: int
    clip_norm: float
    bits: int
    clients: int
    seed: int
    block_size: int = 1 << 14
    beta: float = math.exp(-0.5)  # conditional rounding: bound fails w.p. <= beta per draw
    clip_failure: float = 1e-6  # P(any coordinate clipped in step 5), per client

    def __post_init__(self) -> None:
        ring_dtype(self.bits)
        if self.length < 1 or self.clients < 1 or self.clip_norm <= 0:
            raise ValueError("length, clients and clip_norm must be positive")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.level < 2:
            raise ValueError(f"{self.bits} bits leave no room to sum {self.clients} clients "
                             f"without wrap-around; use more bits")

    @property
    def block(self) -> int:
        """Rotation block: block_size, or the next power of two for shorter vectors."""
        return min(self.block_size, 1 << (self.length - 1).bit_length())

    @property
    def padded_length(self) -> int:
        """d': the ring vector's length (= length unless length < block_size)."""
        return max(self.length, self.block)

    @property
    def _whole_blocks(self) -> int:
        return self.padded_length // self.block

    @property
    def _overlap(self) -> bool:
        """Whether a last, overlapping block covers the coordinates past the whole blocks."""
        return self.padded_length % self.block != 0

    @property
    def level(self) -> int:
        """L: per-client coordinate bound such that n * L never wraps the signed ring."""
        return ((1 << (self.bits - 1)) - 1) // self.clients

    @property
    def scale(self) -> float:
        """s: the rotated coordinate bound (1 - clip_failure quantile) maps to L - 1."""
        spread = self.clip_norm * math.sqrt(
            2 * math.log(2 * self.padded_length / self.clip_failure) / self.block)
        return (self.level - 1) / spread

    @property
    def rounding_bound(self) -> float:
        """Delta_s: the hard L2 bound of a rounded client vector, in scaled units."""
        sc, d = self.scale * self.clip_norm, self.padded_length
        tail = math.sqrt(2 * math.log(1 / self.beta)) * (sc + math.sqrt(d) / 2)
        return math.sqrt(min(sc**2 + d / 4 + tail, (sc + math.sqrt(d)) ** 2))

    @property
    def sensitivity(self) -> float:
        """L2 bound of one client's decoded contribution: the sensitivity DP must use."""
        return self.rounding_bound / self.scale

    @property
    def norm_inflation(self) -> float:
        return self.sensitivity / self.clip_norm

    def quantization_bound(self, summed: int) -> float:
        """L2 bound on |decode(sum of m encodings) - sum of the m clipped inputs|."""
        return summed * math.sqrt(self.padded_length) / self.scale

    @cached_property
    def _signs(self) -> np.ndarray:
        """Signs of the whole blocks, then (if any) of the overlapping last block."""
        rng = np.random.default_rng([self.seed, 0xD15C])
        count = (self._whole_blocks + self._overlap) * self.block
        return rng.integers(0, 2, count).astype(np.float64) * 2 - 1

    def rotate(self, x: np.ndarray) -> np.ndarray:
        """z = H D x / sqrt(B) per whole block, then on the last B coordinates if needed."""
        z = np.zeros(self.padded_length)
        z[: self.length] = x
        head, b = self._whole_blocks * self.block, self.block
        z[:head] *= self._signs[:head]
        _hadamard(z[:head].reshape(-1, b))
        z[:head] /= math.sqrt(b)
        if self._overlap:
            tail = z[-b:]
            tail *= self._signs[head:]
            _hadamard(tail.reshape(1, b))
            tail /= math.sqrt(b)
        return z

    def unrotate(self, z: np.ndarray) -> np.ndarray:
        """The inverse of `rotate` (H is symmetric with H H = B I), truncated to `length`."""
        x = np.array(z, dtype=np.float64)
        head, b = self._whole_blocks * self.block, self.block
        if self._overlap:  # undo the last rotation first
            tail = x[-b:]
            _hadamard(tail.reshape(1, b))
            tail *= self._signs[head:]
            tail /= math.sqrt(b)
        _hadamard(x[:head].reshape(-1, b))
        x[:head] *= self._signs[:head]
        x[:head] /= math.sqrt(b)
        return x[: self.length]

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> Encoded:
        """One client's clipped update as ring elements (`rng` drives the rounding only)."""
        x = np.asarray(x, dtype=np.float64).ravel()
        if x.size != self.length:
            raise ValueError(f"update has {x.size} entries, the round expects {self.length}")
        norm = float(np.linalg.norm(x))
        too_long = norm > self.clip_norm
        if too_long:
            x = x * (self.clip_norm / norm)
        scaled = self.rotate(x)
        scaled *= self.scale
        floor = np.floor(scaled)
        frac = np.subtract(scaled, floor, out=scaled)
        bound_sq = self.rounding_bound**2
        draws = 0
        while True:
            draws += 1
            q = floor + (rng.random(frac.size) < frac)
            if float(q @ q) <= bound_sq:
                break
            if draws == MAX_ROUNDING_DRAWS:  # probability <= beta^64 < 1e-13
                raise RuntimeError("conditional rounding kept exceeding its norm bound")
        level, clipped = self.level, 0
        if q.min() < -level or q.max() > level:
            clipped = int(np.count_nonzero(np.abs(q) > level))
            np.clip(q, -level, level, out=q)
        values = q.astype(np.int64).astype(ring_dtype(self.bits))  # two's complement wrap
        values &= values.dtype.type((1 << self.bits) - 1)
        return Encoded(values, clipped, draws, too_long)

    def decode(self, total: np.ndarray) -> np.ndarray:
        """The real-valued sum from the ring sum of the clients' encodings."""
        shift = 64 - self.bits  # sign-extend the low `bits` bits of each element
        signed = (np.asarray(total).astype(np.int64) << shift) >> shift
        return self.unrotate(signed / self.scale)


def _hadamard(rows: np.ndarray) -> np.ndarray:
    """Unnormalized fast Walsh-Hadamard transform of each row, in place (rows: float64 2-D).

    Radix-4 butterflies (two stages per pass over memory, plus one radix-2 stage when log2 of
    the width is odd), a few rows at a time so every pass runs in cache: about 4x faster than
    whole-array radix-2 passes at d = 4.4e6.
    """
    count, width = rows.shape
    group = max(1, HADAMARD_GROUP // width)
    for first in range(0, count, group):
        part = rows[first : first + group]
        h = 1
        while 4 * h <= width:
            view = part.reshape(part.shape[0], width // (4 * h), 4, h)
            a, b, c, d = (view[:, :, i, :] for i in range(4))
            sum_ab, diff_ab, sum_cd, diff_cd = a + b, a - b, c + d, c - d
            np.add(sum_ab, sum_cd, out=a)
            np.add(diff_ab, diff_cd, out=b)
            np.subtract(sum_ab, sum_cd, out=c)
            np.subtract(diff_ab, diff_cd, out=d)
            h *= 4
        if h < width:
            view = part.reshape(part.shape[0], 2, h)
            low, high = view[:, 0, :], view[:, 1, :]
            diff = low - high
            low += high
            high[...] = diff
    return rows
