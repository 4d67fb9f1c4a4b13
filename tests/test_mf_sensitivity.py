"""Min-separation sensitivity of matrix-factorization strategies: efficient formulas vs brute force.

The reference is independent of the formulas: every admissible pattern is enumerated (and the
enumeration itself is checked against itertools), and ||C u||^2 is computed densely. The attack
tests show a device that breaks the separation the timers enforce exposes more than accounted.
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.mechanisms.blt import BLT, banded_toeplitz_matrix
from dpfleet.coordinator.mechanisms.mf_sensitivity import (
    banded_sensitivity_squared,
    banded_sensitivity_squared_bound,
    brute_force_sensitivity_squared,
    gap_from_min_separation,
    max_over_patterns,
    pattern_sensitivity_squared,
    patterns,
    toeplitz_matrix,
    toeplitz_minsep_sensitivity_squared,
    true_max_participations,
)
from dpfleet.errors import DpfleetError

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def setting(draw, max_n=10):
    n = draw(st.integers(1, max_n))
    gap = draw(st.integers(1, n))
    k = draw(st.integers(1, n))
    return n, gap, k


def monotone_coefs(draw, n):
    steps = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
    return np.cumprod(np.array(steps))  # non-negative, non-increasing, coef[0] <= 1


@pytest.mark.parametrize("n,gap,k", [(7, 1, 7), (9, 2, 3), (10, 3, 10), (8, 8, 1)])
def test_enumeration_is_every_admissible_pattern(n, gap, k):
    want = {c for m in range(1, k + 1) for c in itertools.combinations(range(n), m)
            if all(b - a >= gap for a, b in itertools.pairwise(c))}
    got = list(patterns(n, gap, k))
    assert len(got) == len(set(got)) and set(got) == want


@SETTINGS
@given(st.data(), setting())
def test_toeplitz_formula_equals_brute_force_for_monotone_coefs(data, nk):
    n, gap, k = nk
    coef = monotone_coefs(data.draw, n)
    c = toeplitz_matrix(coef, n)
    assert toeplitz_minsep_sensitivity_squared(coef, n, gap, k) == pytest.approx(
        brute_force_sensitivity_squared(c, gap, k), rel=1e-12, abs=1e-12)


@SETTINGS
@given(st.data(), setting())
def test_toeplitz_formula_is_an_upper_bound_for_any_coefs(data, nk):
    n, gap, k = nk
    coef = np.array(data.draw(st.lists(st.floats(-2, 2), min_size=n, max_size=n)))
    bound = toeplitz_minsep_sensitivity_squared(coef, n, gap, k)
    # |X| brute force bounds the true sensitivity; the majorant bound must dominate even that
    assert bound >= brute_force_sensitivity_squared(toeplitz_matrix(coef, n), gap, k,
                                                    upper_bound=True) - 1e-9


@SETTINGS
@given(st.data(), setting())
def test_banded_formula_equals_brute_force_for_any_banded_c(data, nk):
    n, gap, k = nk
    bands = data.draw(st.integers(1, gap))
    entries = data.draw(st.lists(st.floats(-3, 3), min_size=n * n, max_size=n * n))
    c = np.tril(np.array(entries).reshape(n, n)) * (np.subtract.outer(np.arange(n), np.arange(n))
                                                   < bands)
    exact = banded_sensitivity_squared(c, gap, k)
    # columns of admissible rounds are disjoint, so X[pi, pi] is diagonal: |X| changes nothing
    assert exact == pytest.approx(brute_force_sensitivity_squared(c, gap, k, upper_bound=True),
                                  rel=1e-12, abs=1e-12)
    assert banded_sensitivity_squared_bound(c, gap, k) >= exact - 1e-12


def test_banded_bound_is_loose_when_the_last_columns_are_short():
    # banded Toeplitz: the last columns lose their lower entries; k max-norm columns do not fit
    c = banded_toeplitz_matrix(np.array([1.0, 0.9, 0.8]), 5)
    exact, bound = banded_sensitivity_squared(c, 3, 2), banded_sensitivity_squared_bound(c, 3, 2)
    assert exact == pytest.approx(brute_force_sensitivity_squared(c, 3, 2))
    assert exact == pytest.approx(2.45 + 1.81) and bound == pytest.approx(2 * 2.45)


@SETTINGS
@given(st.data(), st.integers(1, 10))
def test_single_participation_is_the_max_column_norm(data, n):
    entries = data.draw(st.lists(st.floats(0, 3), min_size=n * n, max_size=n * n))
    c = np.tril(np.array(entries).reshape(n, n))
    col = float((c * c).sum(axis=0).max())
    assert brute_force_sensitivity_squared(c, n) == pytest.approx(col)  # gap = n: one round only
    assert brute_force_sensitivity_squared(c, 1, 1) == pytest.approx(col)
    coef = monotone_coefs(data.draw, n)
    assert toeplitz_minsep_sensitivity_squared(coef, n, n) == pytest.approx(float(coef @ coef))


@SETTINGS
@given(st.data(), setting(max_n=12))
def test_vector_dynamic_program_equals_enumeration(data, nk):
    n, gap, k = nk
    values = np.array(data.draw(st.lists(st.floats(-5, 5), min_size=n, max_size=n)))
    want = max([0.0] + [float(values[list(p)].sum()) for p in patterns(n, gap, k)])
    assert max_over_patterns(values, gap, k) == pytest.approx(want, abs=1e-12)


def test_blt_sensitivity_grows_with_participations_and_shrinks_with_separation():
    blt = BLT(np.array([0.95, 0.6]), np.array([0.2, 0.3]))
    n = 12
    sens = {(g, k): toeplitz_minsep_sensitivity_squared(blt.coefs(n), n, g, k)
            for g in (1, 2, 4) for k in (1, 2, 3)}
    assert sens[(1, 1)] == sens[(4, 1)] == pytest.approx(float(blt.coefs(n) @ blt.coefs(n)))
    assert sens[(2, 1)] < sens[(2, 2)] < sens[(2, 3)]
    assert sens[(1, 3)] > sens[(2, 3)] > sens[(4, 3)]


@pytest.mark.parametrize("kind", ["blt", "banded"])
def test_attack_a_device_closer_than_the_enforced_separation_exposes_more(kind):
    """The accountant must use the separation the timers enforce: a device that gets in more
    often than that (here every round) contributes more than the accounted sensitivity."""
    n, gap, k = 12, 4, 3
    if kind == "blt":
        coef = BLT(np.array([0.9, 0.5]), np.array([0.25, 0.25])).coefs(n)
        accounted = toeplitz_minsep_sensitivity_squared(coef, n, gap, k)
    else:
        coef = np.array([1.0, 0.7, 0.5, 0.3])
        accounted = banded_sensitivity_squared(banded_toeplitz_matrix(coef, n), gap, k)
    c = toeplitz_matrix(coef, n)
    assert accounted == pytest.approx(brute_force_sensitivity_squared(c, gap, k))
    honest = max(pattern_sensitivity_squared(c, p) for p in patterns(n, gap, k))
    cheat = pattern_sensitivity_squared(c, [0, 1, 2])  # k rounds, separation 1 < gap
    assert honest == pytest.approx(accounted)
    # on the value: 1.48x (BLT) and 2.1x (banded) the accounted sens^2, i.e. a z that is
    # sqrt(1.48) too small for the claimed rho
    assert cheat > 1.4 * accounted
    # it is exactly the worst case of the separation it actually achieved
    assert cheat == pytest.approx(toeplitz_minsep_sensitivity_squared(coef, n, 1, k))


def test_inputs_that_the_formulas_do_not_cover_are_refused():
    c = banded_toeplitz_matrix(np.array([1.0, 0.5, 0.5]), 6)
    with pytest.raises(DpfleetError, match="bands"):
        banded_sensitivity_squared(c, 2, 3)
    negative = banded_toeplitz_matrix(np.array([1.0, -0.5]), 4)
    with pytest.raises(DpfleetError, match="negative"):
        brute_force_sensitivity_squared(negative, 1, 4)
    with pytest.raises(DpfleetError, match="lower-triangular"):
        brute_force_sensitivity_squared(np.ones((3, 3)), 1)
    with pytest.raises(DpfleetError, match="gap"):
        toeplitz_minsep_sensitivity_squared(np.ones(3), 3, 0)


def test_conventions():
    assert gap_from_min_separation(0) == 1 and gap_from_min_separation(3) == 4
    assert true_max_participations(10, 3) == 4 and true_max_participations(10, 3, 2) == 2
