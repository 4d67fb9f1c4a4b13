"""zCDP <-> (eps, delta) conversions and the noise calibration."""

import math

import dp_accounting
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.accounting.ledger import account_worst_case
from dpfleet.coordinator.accounting.zcdp import (
    METHODS,
    epsilon_from_zcdp,
    noise_for_zcdp,
    zcdp_for_epsilon,
    zcdp_from_noise,
    zcdp_from_sensitivity,
)
from dpfleet.errors import DpfleetError

rhos = st.floats(1e-4, 20.0)
deltas = st.sampled_from([1e-5, 1e-6, 1e-8, 1e-10])


@settings(max_examples=25, deadline=None)
@given(rho=rhos, delta=deltas)
def test_pld_is_tightest_and_bound_loosest(rho, delta):
    pld, rdp, bound = (epsilon_from_zcdp(rho, delta, m) for m in METHODS)
    assert 0 < pld <= rdp <= bound


@settings(max_examples=25, deadline=None)
@given(rho=rhos, delta=deltas)
def test_pld_matches_the_exact_gaussian_from_above(rho, delta):
    exact = dp_accounting.get_epsilon_gaussian(1 / math.sqrt(2 * rho), delta)
    pld = epsilon_from_zcdp(rho, delta, "pld")
    assert exact - 1e-9 <= pld <= exact * (1 + 1e-4) + 1e-9


@settings(max_examples=20, deadline=None)
@given(rho=rhos, delta=deltas, method=st.sampled_from(METHODS))
def test_epsilon_grows_with_rho_and_shrinks_with_delta(rho, delta, method):
    eps = epsilon_from_zcdp(rho, delta, method)
    assert epsilon_from_zcdp(rho * 1.5, delta, method) > eps
    assert epsilon_from_zcdp(rho, delta * 10, method) < eps


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("eps,delta", [(4.49, 1e-10), (1.77, 1e-6), (30.0, 1e-8)])
def test_zcdp_for_epsilon_inverts(method, eps, delta):
    rho = zcdp_for_epsilon(eps, delta, method)
    assert epsilon_from_zcdp(rho, delta, method) <= eps + 1e-9
    assert epsilon_from_zcdp(rho * (1 + 1e-5), delta, method) > eps


def test_noise_calibration_round_trips():
    s = 44
    z = noise_for_zcdp(0.45, s)
    assert zcdp_from_sensitivity(z, s) == pytest.approx(0.45)
    assert zcdp_from_noise(z, 3600, 3, 909) == pytest.approx(0.45)


def test_zcdp_scales_with_inverse_square_noise_and_replace_one_quadruples():
    base = zcdp_from_noise(7, 930, 4, 212)
    assert zcdp_from_noise(14, 930, 4, 212) == pytest.approx(base / 4)
    assert zcdp_from_noise(7, 930, 4, 212, adjacency="replace-one") == pytest.approx(4 * base)


def test_zero_zcdp_is_zero_epsilon():
    assert epsilon_from_zcdp(0.0, 1e-6) == 0.0


def test_worst_case_summary_has_the_cli_keys():
    out = account_worst_case(7, 3600, 3, 909, None, 1e-10)
    assert {"zcdp", "epsilon", "delta", "sensitivity_squared"} <= out.keys()
    assert out["sensitivity_squared"] == 44 and out["delta"] == 1e-10


@pytest.mark.parametrize(
    "call",
    [
        lambda: epsilon_from_zcdp(1.0, 0.0),
        lambda: epsilon_from_zcdp(1.0, 1.0),
        lambda: epsilon_from_zcdp(1.0, -1e-5),
        lambda: epsilon_from_zcdp(-1.0, 1e-5),
        lambda: epsilon_from_zcdp(float("nan"), 1e-5),
        lambda: epsilon_from_zcdp(1.0, 1e-5, "moments"),
        lambda: zcdp_from_sensitivity(0.0, 10),
        lambda: zcdp_from_sensitivity(float("inf"), 10),
        lambda: zcdp_from_sensitivity("seven", 10),
        lambda: zcdp_from_sensitivity(1.0, -1),
        lambda: noise_for_zcdp(0.0, 10),
        lambda: zcdp_for_epsilon(-1.0, 1e-5),
        lambda: zcdp_for_epsilon(1.0, 2.0),
        lambda: zcdp_from_noise(7, 100, 2, 3, adjacency="swap"),
        lambda: account_worst_case(7, 100, delta=0.5, method="bogus"),
    ],
)
def test_bad_inputs_raise_dpfleet_error(call):
    with pytest.raises(DpfleetError):
        call()
