"""The planner's upper bound on the tree's S: never below any pattern an adversary can choose,
exact at one participation, tight where it replaces the exact program, and a plan at production
size that finishes with its bounded rows said."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.cli import main
from dpfleet.coordinator.accounting import planner
from dpfleet.coordinator.accounting.zcdp import noise_for_zcdp
from dpfleet.coordinator.mechanisms.tree_bound import tree_sensitivity_bound
from dpfleet.coordinator.mechanisms.tree_sensitivity import (
    pattern_sensitivity_squared,
    tree_sensitivity_squared,
)


@settings(max_examples=200, deadline=None)
@given(rounds=st.integers(1, 160), maxp=st.integers(1, 9), mins=st.integers(0, 30),
       nodes=st.sampled_from(["all", "prefix"]), data=st.data())
def test_the_bound_is_never_below_the_worst_pattern(rounds, maxp, mins, nodes, data):
    restarts = data.draw(st.lists(st.integers(0, rounds - 1), max_size=3))
    exact = tree_sensitivity_squared(rounds, maxp, mins, restarts, nodes=nodes)
    bound = tree_sensitivity_bound(rounds, maxp, mins, restarts, nodes=nodes)
    assert bound >= exact
    if maxp == 1:  # one participation: the deepest leaf, as the exact program
        assert bound == exact


def spaced(rounds: int, gap: int, count: int, first: int, jitter: np.ndarray) -> list[int]:
    """`count` participations from `first`, each at least `gap` after the last (plus jitter)."""
    out, at = [], first
    for extra in jitter[:count]:
        if at >= rounds:
            break
        out.append(int(at))
        at += gap + int(extra)
    return out


@settings(max_examples=60, deadline=None)
@given(rounds=st.integers(2_000, 100_000), mins=st.integers(0, 40), maxp=st.integers(1, 20_000),
       seed=st.integers(0, 2**32 - 1))
def test_no_pattern_at_production_size_exceeds_the_bound(rounds, mins, maxp, seed):
    """Where the exact program is too slow to be the reference: an adversary's patterns (as dense
    as MinS allows, aligned to a power of two, or with random slack) stay within the bound."""
    rng = np.random.default_rng(seed)
    gap = mins + 1
    most = min(maxp, -(-rounds // gap))
    patterns = [spaced(rounds, gap, most, 0, np.zeros(most, int)),
                spaced(rounds, gap, most, 1 << int(rng.integers(0, rounds.bit_length() - 1)),
                       np.zeros(most, int)),
                spaced(rounds, gap, most, int(rng.integers(0, gap)), rng.integers(0, 3, most))]
    worst = int(pattern_sensitivity_squared(patterns, rounds).max())
    assert worst <= tree_sensitivity_bound(rounds, maxp, mins)


@pytest.mark.parametrize(("mins", "maxp", "within"), [
    # the bounded rows of `dpfleet plan -N 1e6 -T 1e5` (the exact program: 242 s at MaxP 7,693)
    (62, 1_588, 1.008), (24, 4_000, 1.002), (9, 10_000, 1.001), (3, 25_000, 1.0),
    (12, 7_693, 1.002), (99, 1_000, 1.004),
])
def test_the_bound_is_tight_where_it_replaces_the_exact_program(mins, maxp, within):
    """Against the densest patterns (every MinS + 1 rounds from one of the first rounds: a lower
    bound on the exact S) at 10^5 rounds: the plan's S is at most `within` x the exact one."""
    rounds = 100_000
    dense = [spaced(rounds, mins + 1, maxp, first, np.zeros(maxp, int))
             for first in range(0, mins + 1, max(1, (mins + 1) // 8))]
    lower = int(pattern_sensitivity_squared(dense, rounds).max())
    assert lower <= tree_sensitivity_bound(rounds, maxp, mins) <= within * lower


def test_a_bounded_plan_row_is_at_least_as_private_as_its_target(monkeypatch):
    """With the switch lowered, a row the exact program can still check: its z meets the target at
    the bound, so at the exact S the plan's zCDP is below the target, never above."""
    exact = planner.plan_row(50_000, 2_000, 2_500, 0.5)
    monkeypatch.setattr(planner, "EXACT_MAX_PARTICIPATION", 10)
    bounded = planner.plan_row(50_000, 2_000, 2_500, 0.5)
    assert exact.sensitivity_exact and not bounded.sensitivity_exact
    assert bounded.max_participation == exact.max_participation > 10
    assert bounded.sensitivity_squared >= exact.sensitivity_squared
    assert bounded.noise_multiplier >= noise_for_zcdp(0.5, exact.sensitivity_squared)
    assert bounded.sensitivity_squared / (2 * bounded.noise_multiplier ** 2) == pytest.approx(0.5)


@pytest.mark.slow
def test_a_production_size_plan_finishes_and_says_which_rows_are_bounds(tmp_path, capsys):
    """`dpfleet plan -N 1e6 -T 1e5` hung (rows up to MaxP 25,000, and BLT's and banded's
    optimisations took minutes each); now its rows above the switch are the bound, marked in the
    table and in plan.json, and auto leaves the optimised mechanisms out, saying so."""
    out = tmp_path / "plan"
    main(["plan", "-N", "1000000", "-T", "100000", "--target-zcdp", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert "<= : an upper bound on the exact sens^2" in text
    assert "banded and blt are not optimised for 100,000 rounds under auto" in text
    record = json.loads((out / "plan.json").read_text())
    rows = record["rows"]
    assert {r["sensitivity_exact"] for r in rows} == {True, False}
    for r in rows:
        assert r["sensitivity_exact"] == (r["max_participation"] <= planner.EXACT_MAX_PARTICIPATION)
        assert r["zcdp"] == pytest.approx(1.0)
    assert record["mechanisms_not_optimised"] == ["banded", "blt"]
    assert [m["mechanism"] for m in record["mechanisms"]] == ["tree"]


def test_a_plan_marks_only_its_bounded_rows(capsys):
    """A plan whose grid crosses the switch: the table marks the rows above it `<=`, the others
    are the exact program's."""
    main(["plan", "-N", "20000", "-T", "8000", "--target-zcdp", "1", "--mechanism", "tree", "--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["sensitivity_exact"] for r in rows] == [
        r["max_participation"] <= planner.EXACT_MAX_PARTICIPATION for r in rows]
    assert not rows[-1]["sensitivity_exact"] and rows[0]["sensitivity_exact"]
    exact = planner.plan_row(20000, 8000, rows[0]["report_goal"], 1.0)
    assert rows[0]["sensitivity_squared"] == exact.sensitivity_squared
