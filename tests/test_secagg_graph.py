"""Masking graphs and the choice of k and t."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.secagg.graph import Graph, plan_graph, threshold_for


@st.composite
def harary(draw):
    n = draw(st.integers(4, 120))
    return Graph(n, draw(st.sampled_from(range(2, n - 1, 2))), draw(st.integers(0, 10**6)))


def _connected(nbrs: list[frozenset[int]]) -> bool:
    seen, stack = {0}, [0]
    while stack:
        for v in nbrs[stack.pop()] - seen:
            seen.add(v)
            stack.append(v)
    return len(seen) == len(nbrs)


@settings(max_examples=80, deadline=None)
@given(harary())
def test_harary_graph_is_k_regular_symmetric_and_connected(graph):
    nbrs = [graph.neighbours(u) for u in range(graph.n)]
    for u, around in enumerate(nbrs):
        assert len(around) == graph.k and u not in around
        assert all(u in nbrs[v] for v in around)
    assert _connected(nbrs)
    assert graph.kind == "harary"


def test_relabelling_depends_on_the_seed_and_complete_graph_is_everyone():
    a, b = Graph(50, 4, seed=1), Graph(50, 4, seed=2)
    assert any(a.neighbours(u) != b.neighbours(u) for u in range(50))
    assert Graph(5, 4).neighbours(2) == {0, 1, 3, 4} and Graph(5, 4).complete


@pytest.mark.parametrize("n,k", [(1, 0), (10, 3), (10, 10), (10, 0), (10, -2)])
def test_invalid_graphs(n, k):
    with pytest.raises(ValueError):
        Graph(n, k)


def _tail(k: int, p: float, t: int) -> float:
    """P[Bin(k, p) >= t] with exact rational arithmetic: an independent reference."""
    q = Fraction(p)
    return float(sum(math.comb(k, i) * q**i * (1 - q) ** (k - i) for i in range(t, k + 1)))


@pytest.mark.parametrize("n,dropout,corruption", [
    (100, 0.0, 0.05), (100, 0.1, 0.05), (500, 0.3, 0.05), (1000, 0.1, 0.1), (1000, 0.3, 0.05),
])
def test_plan_meets_its_stated_bounds_and_is_minimal(n, dropout, corruption):
    plan = plan_graph(n, "harary", dropout, corruption)
    k, t = plan.k, plan.threshold
    assert plan.bounded and k < n - 1 and k % 2 == 0
    assert _tail(k, dropout, k - t + 1) <= 2**-20 / n  # fewer than t live neighbours
    assert _tail(k, corruption, t) <= 2**-40 / n  # t corrupt neighbours
    assert n * (dropout + corruption) ** (k / 2) <= 2**-40  # survivors stay connected
    smaller = k - 2
    assert (threshold_for(smaller, n, dropout, corruption) is None
            or n * (dropout + corruption) ** (smaller / 2) > 2**-40)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 400), st.sampled_from(["harary", "complete"]),
       st.floats(0, 0.3), st.floats(0, 0.2))
def test_every_plan_beats_a_split_view_or_refuses(n, kind, dropout, corruption):
    """2t > k + c and t > c in every plan (split view: two lists, each needing t holders, the
    c corrupt ones answering both); where no such t exists planning refuses."""
    try:
        plan = plan_graph(n, kind, dropout, corruption)
    except ValueError as exc:
        assert "no threshold" in str(exc)
        return
    assert 2 * plan.threshold > plan.k + plan.corrupt
    assert plan.corrupt < plan.threshold <= plan.k


def test_small_rounds_assume_a_fixed_number_of_colluders_on_the_complete_graph():
    plan = plan_graph(10, "harary", 0.1, 0.05)
    assert (plan.k, plan.corrupt, plan.threshold, plan.bounded) == (9, 1, 6, False)
    plan = plan_graph(50, "harary", 0.1, 0.05)  # the n = 50: t was 21 of 49
    assert (plan.k, plan.corrupt, plan.threshold) == (49, 3, 27)
    assert plan_graph(300, "complete", 0.1, 0.05).k == 299
    with pytest.raises(ValueError, match="no threshold"):
        plan_graph(3, "complete", 0.0, 0.5)


def test_bad_plan_arguments():
    for kwargs in ({"n": 1}, {"n": 10, "kind": "ring"}, {"n": 10, "dropout": 1.0}):
        with pytest.raises(ValueError):
            plan_graph(**kwargs)
