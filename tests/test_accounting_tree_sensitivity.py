"""Exact tree sensitivity: brute-force agreement, structural properties, adversarial inputs.

The references here are independent of the module: "all" nodes are every aligned dyadic block
inside each tree, "prefix" nodes are rebuilt from the streaming mechanism itself (the blocks
that cover [0, t) for every prefix t of each tree), and every allowed pattern is enumerated.
"""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.mechanisms.tree_sensitivity import (
    pattern_sensitivity_squared,
    tree_pieces,
    tree_sensitivity_squared,
)
from dpfleet.errors import DpfleetError


def segments(rounds, restarts):
    return itertools.pairwise([0, *sorted({r for r in restarts if r > 0}), rounds])


def all_nodes(rounds, restarts=()):
    return {(start + a, start + a + (1 << lvl)) for start, stop in segments(rounds, restarts)
            for lvl in range((stop - start).bit_length())
            for a in range(0, stop - start - (1 << lvl) + 1, 1 << lvl)}


def prefix_nodes(rounds, restarts=()):
    nodes = set()
    for start, stop in segments(rounds, restarts):
        for t in range(1, stop - start + 1):
            first = start
            for level in range(t.bit_length() - 1, -1, -1):
                if t >> level & 1:
                    nodes.add((first, first + (1 << level)))
                    first += 1 << level
    return nodes


NODE_SETS = {"all": all_nodes, "prefix": prefix_nodes}


def reference_s(pattern, nodes):
    return sum(sum(1 for p in pattern if a <= p < b) ** 2 for a, b in nodes)


def brute_force(rounds, max_participation, min_separation, restarts=(), nodes="all"):
    node_set = NODE_SETS[nodes](rounds, restarts)
    best = 0
    for k in range(1, max_participation + 1):
        for pattern in itertools.combinations(range(rounds), k):
            if all(b - a - 1 >= min_separation for a, b in itertools.pairwise(pattern)):
                best = max(best, reference_s(pattern, node_set))
    return best


small = st.integers(1, 13)


@settings(max_examples=150, deadline=None)
@given(rounds=small, maxp=st.integers(1, 5), mins=st.integers(0, 6),
       nodes=st.sampled_from(["all", "prefix"]), data=st.data())
def test_matches_brute_force(rounds, maxp, mins, nodes, data):
    restarts = data.draw(st.lists(st.integers(0, rounds - 1), max_size=3))
    assert tree_sensitivity_squared(rounds, maxp, mins, restarts, nodes=nodes) == brute_force(
        rounds, maxp, mins, restarts, nodes)


@pytest.mark.parametrize("nodes", ["all", "prefix"])
def test_matches_brute_force_exhaustively_up_to_10_rounds(nodes):
    for rounds in range(1, 11):
        for mins in range(rounds):
            for maxp in range(1, 5):
                assert tree_sensitivity_squared(rounds, maxp, mins, nodes=nodes) == brute_force(
                    rounds, maxp, mins, nodes=nodes), (rounds, maxp, mins)


@settings(max_examples=60, deadline=None)
@given(rounds=st.integers(1, 40), nodes=st.sampled_from(["all", "prefix"]), data=st.data())
def test_pattern_sensitivity_matches_reference(rounds, nodes, data):
    restarts = data.draw(st.lists(st.integers(0, rounds - 1), max_size=3))
    patterns = data.draw(st.lists(st.sets(st.integers(0, rounds - 1)).map(sorted), max_size=6))
    node_set = NODE_SETS[nodes](rounds, restarts)
    got = pattern_sensitivity_squared(patterns, rounds, restarts, nodes=nodes)
    assert list(got) == [reference_s(p, node_set) for p in patterns]


@settings(max_examples=30, deadline=None)
@given(rounds=st.integers(1, 300), maxp=st.integers(1, 8), mins=st.integers(0, 60))
def test_prefix_nodes_never_exceed_all_nodes(rounds, maxp, mins):
    prefix = tree_sensitivity_squared(rounds, maxp, mins, nodes="prefix")
    assert prefix <= tree_sensitivity_squared(rounds, maxp, mins)
    if maxp == 1 or mins + 1 >= rounds:  # one participation: the leftmost leaf, same depth
        assert prefix == tree_sensitivity_squared(rounds, 1)


def test_prefix_nodes_on_a_published_row():
    # pt-BR (3600 rounds, MinS 909, MaxP 3): 44 over all nodes, 36 over the prefix nodes
    assert tree_sensitivity_squared(3600, 3, 909, nodes="prefix") == 36


def test_pieces_are_the_binary_expansion_per_tree():
    assert tree_pieces(3600) == [(0, 11), (2048, 10), (3072, 9), (3584, 4)]
    assert tree_pieces(10, [0, 4, 4]) == [(0, 2), (4, 2), (8, 1)]


@pytest.mark.parametrize("rounds", [1, 2, 3, 1024, 1600, 3600])
def test_single_participation_is_the_tallest_tree_depth(rounds):
    assert tree_sensitivity_squared(rounds) == math.floor(math.log2(rounds)) + 1


def test_restarts_reduce_single_participation_to_the_deepest_tree():
    # adaptive clipping's restarts 128 + 1024 i: trees of 128, 1024, 448 rounds
    assert tree_sensitivity_squared(1600, 1, None, [128, 1152]) == 11
    assert tree_sensitivity_squared(1000, 1, None, [128]) == 10  # 872 rounds: depth 10


def test_participations_in_different_trees_add_up():
    # two participations in two trees of 8 rounds never share a node: 4 + 4
    assert tree_sensitivity_squared(16, 2, 7, [8]) == 8
    # without the restart: depth 5 each, and the shared root counts 2^2 instead of 1 + 1
    assert tree_sensitivity_squared(16, 2, 7) == 12


def test_consecutive_rounds_in_one_tree_add_coherently():
    # T = 4, all rounds: leaves 4 * 1, two pairs 2 * 4, root 16 (breaks MaxP * depth = 12)
    assert tree_sensitivity_squared(4, 4, 0) == 28


@settings(max_examples=40, deadline=None)
@given(rounds=st.integers(1, 300), maxp=st.integers(1, 12), mins=st.integers(0, 120))
def test_monotone_and_bounded(rounds, maxp, mins):
    s = tree_sensitivity_squared(rounds, maxp, mins)
    assert tree_sensitivity_squared(rounds, maxp + 1, mins) >= s  # more participations
    assert tree_sensitivity_squared(rounds, maxp, mins + 1) <= s  # more separation
    assert tree_sensitivity_squared(rounds + 1, maxp, mins) >= s  # more rounds
    depth = math.floor(math.log2(rounds)) + 1
    feasible = min(maxp, (rounds - 1) // (mins + 1) + 1)  # participations MinS allows
    assert max(feasible, depth) <= s <= feasible**2 * depth
    if mins + 1 >= rounds:
        assert s == depth


def test_separation_beyond_the_run_means_single_participation():
    assert tree_sensitivity_squared(100, 50, 99) == tree_sensitivity_squared(100) == 7


def test_results_are_exact_integers_for_large_inputs():
    s = tree_sensitivity_squared(1024, 1024, 0)
    # every round: level l has 2^(10-l) nodes with 2^l participations each
    assert s == sum(2 ** (10 - lvl) * 4**lvl for lvl in range(11))
    assert isinstance(s, int)


@pytest.mark.parametrize(
    "args",
    [(0,), (-3,), (1.5,), ("10",), (True,), (10, 0), (10, -1), (10, 2.0), (10, 2, -1),
     (10, 2, 1.5), (10, 2, 1, [10]), (10, 2, 1, [-1]), (10, 2, 1, ["a"])],
)
def test_bad_arguments_raise_dpfleet_error(args):
    with pytest.raises(DpfleetError):
        tree_sensitivity_squared(*args)


def test_unknown_node_set_is_refused():
    with pytest.raises(DpfleetError, match="nodes must be one of"):
        tree_sensitivity_squared(10, 2, 1, nodes="left")


def test_numpy_integers_are_accepted():
    assert tree_sensitivity_squared(np.int64(930), np.int32(4), np.int64(212)) == 47


def test_pattern_sensitivity_rejects_bad_patterns():
    with pytest.raises(DpfleetError):
        pattern_sensitivity_squared([[0, 10]], 10)
    with pytest.raises(DpfleetError):
        pattern_sensitivity_squared([[3, 3]], 10)
    with pytest.raises(DpfleetError):
        pattern_sensitivity_squared([[-1]], 10)
