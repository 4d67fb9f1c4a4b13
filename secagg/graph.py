"""Who masks with whom: the complete graph of Bonawitz et al. 2017 or the sparse SecAgg+ graph
of Bell et al. 2020, and how the degree k and the Shamir threshold t are chosen.

SecAgg+ replaces "everyone masks with everyone" by a random k-regular graph: each client agrees
keys with, secret-shares to, and masks against only its k neighbours, so client cost drops from
O(n) to O(k) with k = O(log n). We use the Harary graph H(k, n) (the circulant on offsets
1..k/2) under a uniformly random relabelling of the clients drawn from the round seed.

Choice of k and t (`plan_graph`). Let delta be the probability that a client drops out at any
point of the round, gamma the fraction of clients that may collude with the server, and n the
number of clients. Each client's neighbours are then (close to) independent draws, so with
exact binomial tails and a union bound over the n clients we require

1. correctness: P[Bin(k, 1 - delta) < t] <= 2^-eta / n -- every client keeps at least t live
   neighbours to hand in shares of its secrets, so the server can unmask;
2. privacy of each secret: P[Bin(k, gamma) >= t] <= 2^-sigma / n -- no client has t corrupt
   neighbours, who together with the server could rebuild both of its secrets;
3. no split sum: n * (delta + gamma)^(k/2) <= 2^-sigma -- honest survivors stay connected (a
   circulant needs a run of k/2 consecutive removed clients to be cut), so the server learns
   no partial sum of a sub-group;
4. 2t > k + c, where c is the 2^-sigma / n quantile of corrupt neighbours: a server that
   shows two contradictory survivor lists can never get t holders to answer each of them (an
   honest holder answers one list only; the c corrupt ones answer both), so no honest client's
   two secrets are both rebuilt. Enforced in both modes (`RoundSetup` refuses anything else);
   see THREAT_MODEL.md for what each mode does and does not resist.

The relabelling is drawn from a seed the clients of the round produce by commit-and-reveal
(`client.py`), so the server cannot choose it -- except by withholding reveals: when up to d
committed clients may be missing from the reveals (`RoundSetup.unrevealed`, so that a dropout
between commit and reveal does not abort the attempt), a server that sees every reveal first
can pick any of G = sum_{i<=d} C(n, i) graphs. Conditions 2-4 must then hold for all of them,
so for a sparse graph they are met at 2^-sigma / (n G) (union bound over the server's choices:
sigma + log2 G bits, `choice_bits`). The complete graph is the same under every seed: no cost.

`plan_graph` takes the smallest even k, then the smallest t, meeting all of them. When even
the complete graph (k = n - 1) cannot meet them -- small n cannot give 2^-40 guarantees -- it
assumes c = ceil(corruption * n) corrupt clients outright and takes t = max(c + 1,
floor((k + c) / 2) + 1) on the complete graph, flagged `bounded = False` (dropout tolerance is
then whatever k - t leaves); when that t exceeds k it refuses with `ValueError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

SECURITY_BITS = 40  # sigma: privacy failure probability 2^-40 per round
CORRECTNESS_BITS = 20  # eta: probability 2^-20 that a round cannot be unmasked


@dataclass(frozen=True)
class Graph:
    """k-regular masking graph on clients 0..n-1; k = n - 1 is the complete graph."""

    n: int
    k: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 2:
            raise ValueError(f"need at least 2 clients, got {self.n}")
        if not self.complete and (self.k < 2 or self.k % 2 or self.k > self.n - 2):
            raise ValueError(f"Harary degree must be even and in 2..n-2, got k={self.k}")

    @property
    def complete(self) -> bool:
        return self.k == self.n - 1

    @property
    def kind(self) -> str:
        return "complete" if self.complete else "harary"

    @cached_property
    def _order(self) -> tuple[np.ndarray, np.ndarray]:
        """Random relabelling: ring position -> client and client -> ring position."""
        ring = np.random.default_rng([self.seed, 0x5EC466]).permutation(self.n)
        position = np.empty(self.n, dtype=np.int64)
        position[ring] = np.arange(self.n)
        return ring, position

    def neighbours(self, u: int) -> frozenset[int]:
        if not 0 <= u < self.n:
            raise ValueError(f"client {u} outside 0..{self.n - 1}")
        if self.complete:
            return frozenset(range(self.n)) - {u}
        ring, position = self._order
        offsets = np.r_[1 : self.k // 2 + 1]
        spots = (position[u] + np.concatenate([offsets, -offsets])) % self.n
        return frozenset(ring[spots].tolist())


@dataclass(frozen=True)
class GraphPlan:
    """The degree and threshold chosen for a round, and whether the bounds above hold."""

    k: int
    threshold: int
    bounded: bool  # False: fell back to c = ceil(corruption * n) on the complete graph
    corrupt: int = 0  # c: corrupt neighbours the threshold is sized against (2t > k + c)


def log_tails(k: int, p: float) -> np.ndarray:
    """tails[t] = log P[Bin(k, p) >= t] for t = 0..k+1, exact (log-sum-exp over the pmf)."""
    if p <= 0:
        return np.r_[0.0, np.full(k + 1, -np.inf)]
    i = np.arange(k + 1)
    log_choose = np.array([math.lgamma(k + 1) - math.lgamma(j + 1) - math.lgamma(k - j + 1)
                           for j in range(k + 1)])
    log_pmf = log_choose + i * math.log(p) + (k - i) * math.log1p(-p)
    return np.r_[np.logaddexp.accumulate(log_pmf[::-1])[::-1], -np.inf]


def choice_bits(n: int, unrevealed: int) -> float:
    """log2 G, G = sum_{i<=d} C(n, i): how many graph seeds a server that may withhold up to
    d = `unrevealed` of n reveals can choose among (exact, in log space)."""
    if unrevealed <= 0:
        return 0.0
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
             for i in range(min(unrevealed, n) + 1)]
    return float(np.logaddexp.reduce(terms)) / math.log(2)


def corrupt_bound(k: int, n: int, corruption: float, sigma: float = SECURITY_BITS) -> int:
    """c: the number of corrupt neighbours exceeded with probability at most 2^-sigma / n."""
    corrupt = log_tails(k, corruption)
    return int(np.argmax(corrupt[1:] <= -sigma * math.log(2) - math.log(n)))


def threshold_for(
    k: int,
    n: int,
    dropout: float,
    corruption: float,
    sigma: float = SECURITY_BITS,
    eta: int = CORRECTNESS_BITS,
) -> int | None:
    """Smallest t meeting conditions 1, 2 and 4 for degree k (None when none does)."""
    secure = -sigma * math.log(2) - math.log(n)
    correct = -eta * math.log(2) - math.log(n)
    dropped, corrupt = log_tails(k, dropout), log_tails(k, corruption)
    worst_corrupt = corrupt_bound(k, n, corruption, sigma)
    for t in range(1, k + 1):
        if dropped[k - t + 1] > correct:  # P[fewer than t live neighbours] too large
            return None
        if corrupt[t] <= secure and 2 * t > k + worst_corrupt:
            return t
    return None


def plan_graph(
    n: int,
    kind: str = "harary",
    dropout: float = 0.1,
    corruption: float = 0.05,
    sigma: int = SECURITY_BITS,
    eta: int = CORRECTNESS_BITS,
    unrevealed: int = 0,
) -> GraphPlan:
    """Degree and threshold for n clients (see the module docstring for the conditions); a
    sparse graph whose seed may leave out up to `unrevealed` reveals meets the privacy
    conditions at sigma + `choice_bits` bits."""
    if n < 2:
        raise ValueError(f"need at least 2 clients, got {n}")
    if kind not in ("complete", "harary"):
        raise ValueError(f"graph must be 'complete' or 'harary', got {kind!r}")
    if not (0 <= dropout < 1 and 0 <= corruption < 1):
        raise ValueError("dropout and corruption must be probabilities in [0, 1)")
    if kind == "harary":
        removed = dropout + corruption
        chosen = sigma + choice_bits(n, unrevealed)  # every graph the server may pick
        for k in range(2, n - 1, 2):
            if removed > 0 and math.log(n) + k / 2 * math.log(removed) > -chosen * math.log(2):
                continue
            t = threshold_for(k, n, dropout, corruption, chosen, eta)
            if t is not None:
                return GraphPlan(k, t, True, corrupt_bound(k, n, corruption, chosen))
    k = n - 1
    t = threshold_for(k, n, dropout, corruption, sigma, eta)
    if t is not None:
        return GraphPlan(k, t, True, corrupt_bound(k, n, corruption, sigma))
    c = math.ceil(corruption * n)
    t = max(c + 1, (k + c) // 2 + 1)
    if t > k:
        raise ValueError(f"no threshold for {n} clients with {c} assumed corrupt: need "
                         f"2t > {k} + {c} and t <= {k}; use more clients or less corruption")
    return GraphPlan(k, t, False, c)
