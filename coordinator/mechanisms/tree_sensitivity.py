"""Worst-case squared sensitivity of DP-FTRL's online tree aggregation (no restart or restarts).

The mechanism (Kairouz et al. 2021, App. D) adds Gaussian noise of std z*C to the sums of
dyadic blocks of rounds inside a tree. A tree over T rounds is a forest of perfect binary trees
(the binary expansion of T, largest first); a restart at round r starts a new forest at r.
Under zero-out adjacency, one device changes every node that contains one of its
participations, and in the worst case all its updates point the same way, so the squared L2
sensitivity (in units of C^2) of a participation pattern is

    S(pattern) = sum over released nodes of (number of the device's participations in it)^2.

The whole run is one Gaussian mechanism with L2 sensitivity sqrt(S)*C, hence rho = S / (2 z^2).
Which nodes count (`nodes`): "all" complete dyadic blocks is the standard analysis (TF Privacy;
it reproduces paper 002's tables and also covers the efficient estimator that uses every node).
A streaming prefix-sum release (noise(t) = the blocks covering [0, t), as `tree_noise` does)
only ever uses left children and tree roots; its releases are in one-to-one correspondence
with those blocks, so "prefix" is the exact, smaller S of that mechanism (pt-BR: 36 vs 44).

MinS convention (used everywhere in dpfleet): `min_separation` counts the rounds strictly
*between* two participations of one device, i.e. rounds x < y are allowed iff y - x - 1 >=
min_separation (0 allows consecutive rounds). This is TF Privacy's convention, and it is the one
that reproduces paper 002 Table 1: en-IN (1290 rounds, MinS 170, MaxP 6, z = 7) gives
S = 112, rho = 1.14 as published, while reading MinS as y - x >= 170 gives S = 116, rho = 1.18.

Algorithm: an exact dynamic program over the forest, bottom-up. All nodes of one level of a
perfect tree are identical, so each level is computed once. For a window (a subtree or a run of
trees) and an exact participation count k, the state is a Pareto frontier: for each value level
v, the vector E_v[s] = the most free rounds after the last participation (capped at MinS) among
patterns with value >= v that leave >= s free rounds before the first one. Joining a left and a
right window only needs, for each s, the left pattern with the most room at its end, so joining
two levels is one gather. All participation counts of a merge are batched in numpy, and a level
that is provably dominated (its value is below that of the roomiest joined pattern) is dropped
before it is built. Exactness is checked against brute-force enumeration in the tests.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from dpfleet.errors import DpfleetError

_NEG = np.int64(-(2**52))  # value of an impossible pattern; sums of three stay far from overflow
_CHUNK_ELEMENTS = 1 << 22  # bound on one batched gather (elements), to bound memory


def check_int(value: object, name: str, minimum: int) -> int:
    """`value` as an int >= minimum, or a DpfleetError naming `name`."""
    if isinstance(value, bool):
        raise DpfleetError(f"{name} must be an integer, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise DpfleetError(f"{name} must be an integer, got {value!r}") from None
    if out < minimum:
        raise DpfleetError(f"{name} must be >= {minimum}, got {out}")
    return out


def normalize_restarts(rounds: int, restarts: Iterable[int] | None) -> tuple[int, ...]:
    """Sorted, de-duplicated restart rounds in [1, rounds); round 0 always starts a tree."""
    if restarts is None:
        return ()
    out = set()
    for r in restarts:
        r = check_int(r, "restart round", 0)
        if r >= rounds:
            raise DpfleetError(f"restart round {r} is not before the last round ({rounds} rounds)")
        if r > 0:
            out.add(r)
    return tuple(sorted(out))


def tree_pieces(rounds: int, restarts: Iterable[int] | None = None) -> list[tuple[int, int]]:
    """The perfect trees of the released forest, as (first round, height), in round order."""
    rounds = check_int(rounds, "rounds", 1)
    bounds = [0, *normalize_restarts(rounds, restarts), rounds]
    pieces = []
    for start, stop in itertools.pairwise(bounds):
        offset, remaining = start, stop - start
        while remaining:
            height = remaining.bit_length() - 1
            pieces.append((offset, height))
            offset += 1 << height
            remaining -= 1 << height
    return pieces


class _Frontier(NamedTuple):
    """Frontiers of one window for k = 0..K participations (row k), padded to R levels.

    Row 0 is the empty pattern: value 0 and room E[s] = min(cap, cap - s + size), which makes
    "no participation on this side" an ordinary term of the join formula below.
    """

    values: np.ndarray  # int64 (K+1, R): value levels, descending; _NEG pads
    room: np.ndarray  # int32 (K+1, R, W): E_v[s], -1 where impossible


class _Solver:
    """The dynamic program for one (max participation, gap) setting.

    The value of a perfect subtree's frontier leaves out the subtree's own root node, which is
    counted where it is known to be released: as a child when two subtrees are joined
    (`count_left` / `count_right`) or as the root of a forest piece (`with_root`).
    Joining windows L and R with kl and kr participations, a left level (vl, El) and a right
    level (vr, Er) give the level vl + vr (+ kl^2, kr^2 for counted children) with room
    Er[cap - El[s]]: the right pattern must leave cap - El[s] rounds before its first one.
    """

    def __init__(self, max_participation: int, gap: int, rounds: int):
        self.max_participation = max_participation
        self.gap = gap  # two participations x < y need y - x >= gap
        self.cap = min(gap - 1, rounds - 1)  # room is capped here: more never matters
        self.width = self.cap + 1

    def kmax(self, size: int) -> int:
        return min(self.max_participation, (size - 1) // self.gap + 1)

    def empty_room(self, size: int) -> np.ndarray:
        return np.minimum(self.cap, self.cap - np.arange(self.width) + size).astype(np.int32)

    def leaf(self) -> _Frontier:
        room = np.full((2, 1, self.width), -1, dtype=np.int32)
        room[0, 0] = self.empty_room(1)
        room[1, 0, 0] = 0
        return _Frontier(np.zeros((2, 1), dtype=np.int64), room)

    @staticmethod
    def with_root(tree: _Frontier) -> _Frontier:
        """Count the root node of a perfect subtree: + k^2 for k participations."""
        k2 = (np.arange(tree.values.shape[0]) ** 2)[:, None]
        return tree._replace(values=np.where(tree.values > _NEG // 2, tree.values + k2, _NEG))

    def join(self, left: _Frontier, kl: np.ndarray, il: np.ndarray,
             right: _Frontier, kr: np.ndarray, ir: np.ndarray) -> np.ndarray:
        """Rooms of the joined levels (broadcast index arrays) -> (..., W)."""
        room_l = left.room[kl, il]
        need = np.where(room_l >= 0, self.cap - room_l, 0)
        joined = np.take_along_axis(right.room[kr, ir], need, axis=-1)
        return np.where(room_l >= 0, joined, -1)

    def merge(self, left: _Frontier, m_left: int, right: _Frontier, m_right: int,
              count_left: bool = False, count_right: bool = False) -> _Frontier:
        """Frontier of the window `left + right`, counting the children's root nodes if asked."""
        k_left, r_left = left.values.shape[0] - 1, left.values.shape[1]
        k_right, r_right = right.values.shape[0] - 1, right.values.shape[1]
        ks = np.arange(1, self.kmax(m_left + m_right) + 1)
        lo, hi = np.maximum(0, ks - k_right), np.minimum(k_left, ks)
        # the last level of a frontier has the most room: one anchor per split (k, kl)
        last_l = (left.values > _NEG // 2).sum(axis=1) - 1
        last_r = (right.values > _NEG // 2).sum(axis=1) - 1
        cells = int((hi - lo + 1).max()) * r_left * r_right
        step = max(1, _CHUNK_ELEMENTS // cells)
        found_k, found_v, found_room = [], [], []
        for i in range(0, len(ks), step):
            k, lo_k, hi_k = ks[i:i + step, None], lo[i:i + step, None], hi[i:i + step, None]
            kl = lo_k + np.arange(int((hi_k - lo_k).max()) + 1)[None, :]  # (B, Q)
            valid = (kl <= hi_k) & (last_l[np.minimum(kl, k_left)] >= 0)
            kl = np.minimum(kl, hi_k)
            kr = k - kl
            valid &= last_r[kr] >= 0
            add = kl * kl * count_left + kr * kr * count_right
            # anchors bound every split's room; a level below the best value among anchors
            # with the overall largest room is dominated by that anchor and never built
            anchor_room = self.join(left, kl, last_l[kl], right, kr, last_r[kr])
            anchor_room[~valid] = -1
            anchor_value = left.values[kl, last_l[kl]] + right.values[kr, last_r[kr]] + add
            best_room = anchor_room.max(axis=1, keepdims=True)
            tight = valid & (anchor_room == best_room).all(axis=2)
            floor = np.where(tight, anchor_value, _NEG).max(axis=1)
            value = (left.values[kl][:, :, :, None] + right.values[kr][:, :, None, :]
                     + add[:, :, None, None])
            alive = (valid[:, :, None, None] & (value >= floor[:, None, None, None])
                     & (value > _NEG // 2))
            b, q, il, ir = np.nonzero(alive)
            found_k.append(k[b, 0])
            found_v.append(value[b, q, il, ir])
            found_room.append(self.join(left, kl[b, q], il, right, kr[b, q], ir))
        out = _prune(np.concatenate(found_k), np.concatenate(found_v),
                     np.concatenate(found_room), len(ks))
        out.room[0, 0] = self.empty_room(m_left + m_right)
        out.values[0, 0] = 0
        return out


def _prune(ks: np.ndarray, values: np.ndarray, room: np.ndarray, k_max: int) -> _Frontier:
    """Pareto frontiers per k of candidate (k, value, room vector) rows; row 0 left empty."""
    order = np.lexsort((-values, ks))
    ks, values, room = ks[order], values[order], room[order]
    width = room.shape[1]
    # an offset per k keeps the running max inside one k (int32 while it fits: 3x faster)
    dtype = np.int32 if (k_max + 1) * (width + 2) < 2**31 else np.int64
    offset = (ks * (width + 2)).astype(dtype)[:, None]
    cum = (np.maximum.accumulate(room.astype(dtype) + offset, axis=0) - offset).astype(np.int32)
    n = len(ks)
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = (values[1:] != values[:-1]) | (ks[1:] != ks[:-1])
    last_of_group = np.append(new_group[1:], True)
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(n), 0))
    before = cum[np.maximum(group_start - 1, 0)]
    first_of_k = (group_start == 0) | (ks[np.maximum(group_start - 1, 0)] != ks)
    before[first_of_k] = -1
    keep = last_of_group & (cum > before).any(axis=1)
    ks, values, cum = ks[keep], values[keep], cum[keep]
    starts = np.searchsorted(ks, np.arange(k_max + 1))
    slot = np.arange(len(ks)) - starts[ks]
    levels = max(int(slot.max(initial=0)) + 1, 1)
    out_values = np.full((k_max + 1, levels), _NEG, dtype=np.int64)
    out_room = np.full((k_max + 1, levels, width), -1, dtype=np.int32)
    out_values[ks, slot] = values
    out_room[ks, slot] = cum
    return _Frontier(out_values, out_room)


NODES = ("all", "prefix")


def validate_arguments(rounds: object, max_participation: object, min_separation: object, nodes: str
              ) -> tuple[int, int, int]:
    if nodes not in NODES:
        raise DpfleetError(f"nodes must be one of {', '.join(NODES)}, got {nodes!r}")
    rounds = check_int(rounds, "rounds", 1)
    max_participation = check_int(max_participation, "max_participation", 1)
    min_separation = 0 if min_separation is None else check_int(min_separation, "min_separation", 0)
    return rounds, max_participation, min_separation


def tree_sensitivity_squared(rounds: int, max_participation: int = 1,
                             min_separation: int | None = None,
                             restarts: Sequence[int] | None = None, *, nodes: str = "all") -> int:
    """Exact worst-case S over all patterns with <= MaxP participations and >= MinS between.

    `min_separation` is the number of rounds strictly between two participations of one device
    (None = 0: consecutive rounds allowed). `restarts` are the rounds at which a fresh tree
    starts (round 0 always does); the constraints hold across trees. A MaxP that MinS makes
    infeasible is capped at the feasible maximum. rho-zCDP = S / (2 z^2).

    `nodes`: "all" counts every complete dyadic block (Kairouz et al. App. D, TF Privacy,
    paper 002's tables; also valid for the efficient/Honaker estimator that uses every node).
    "prefix" counts only the blocks a streaming prefix-sum release ever uses (left children
    and tree roots): exact for the plain online tree (`tree_noise.TreeNoise`) and tighter.
    """
    rounds, max_participation, min_separation = validate_arguments(rounds, max_participation,
                                                          min_separation, nodes)
    return _sensitivity(rounds, max_participation, min_separation,
                        normalize_restarts(rounds, restarts), nodes)


@functools.lru_cache(maxsize=256)
def _sensitivity(rounds: int, max_participation: int, min_separation: int,
                 restarts: tuple[int, ...], nodes: str) -> int:
    pieces = tree_pieces(rounds, restarts)
    if max_participation == 1:  # the leftmost leaf of the tallest tree (either node set)
        return max(h for _, h in pieces) + 1
    solver = _Solver(max_participation, min_separation + 1, rounds)
    levels = [solver.leaf()]
    for height in range(1, max(h for _, h in pieces) + 1):
        half = 1 << (height - 1)
        levels.append(solver.merge(levels[-1], half, levels[-1], half, count_left=True,
                                   count_right=nodes == "all"))
    acc, size = solver.with_root(levels[pieces[0][1]]), 1 << pieces[0][1]
    for _, height in pieces[1:]:
        acc = solver.merge(acc, size, solver.with_root(levels[height]), 1 << height)
        size += 1 << height
    return int(acc.values[1:, 0].max())


def pattern_sensitivity_squared(participations: Sequence[Sequence[int]], rounds: int,
                                restarts: Sequence[int] | None = None, *,
                                nodes: str = "all") -> np.ndarray:
    """Exact S of given patterns (one list of rounds per device), vectorised over devices."""
    rounds = validate_arguments(rounds, 1, None, nodes)[0]
    pieces = tree_pieces(rounds, restarts)
    lengths = np.array([len(p) for p in participations], dtype=np.int64)
    device = np.repeat(np.arange(len(participations), dtype=np.int64), lengths)
    flat = [r for p in participations for r in p]
    at = np.asarray(flat, dtype=np.int64) if flat else np.zeros(0, dtype=np.int64)
    if at.size and (at.min() < 0 or at.max() >= rounds):
        raise DpfleetError(f"participation rounds must lie in [0, {rounds})")
    if len(np.unique(device * rounds + at)) != at.size:
        raise DpfleetError("a device takes part twice in the same round")
    starts = np.array([s for s, _ in pieces], dtype=np.int64)
    heights = np.array([h for _, h in pieces], dtype=np.int64)
    piece = np.searchsorted(starts, at, side="right") - 1
    start, height = starts[piece], heights[piece]
    total = np.zeros(len(participations), dtype=np.int64)
    for level in range(int(heights.max()) + 1):
        index = (at - start) >> level
        # "prefix": a right child is never part of a prefix; a piece's root always is
        inside = (height >= level) & ((nodes == "all") | (index % 2 == 0) | (height == level))
        key = device[inside] * rounds * rounds + start[inside] * rounds + index[inside]
        uniq, counts = np.unique(key, return_counts=True)
        total += np.bincount(uniq // (rounds * rounds), weights=counts * counts,
                             minlength=len(participations)).astype(np.int64)
    return total
