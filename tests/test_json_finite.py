"""eps that overflows the PLD is finite (analytic Gaussian), and no file or --json output holds
`Infinity` / `NaN` (not JSON): they are written as null."""

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.accounting.analytic_gaussian import analytic_gaussian_epsilon, log_delta
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp
from dpfleet.coordinator.cli.account import account
from dpfleet.coordinator.state.run_dir import RunDir
from dpfleet.jsonio import dumps


def strict_loads(text: str):
    """json.loads that refuses Infinity / NaN, as every non-Python reader does."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_account_json_of_the_overflowing_case_is_finite_and_valid():
    out = CliRunner().invoke(account, ["-z", "1.602", "-T", "56", "-P", "200", "-S", "0",
                                    "--json"])
    assert out.exit_code == 0, out.output
    result = strict_loads(out.output)
    assert result["epsilon"] == pytest.approx(715.59, abs=0.01)  # the exact value, issue 10


@settings(deadline=None, max_examples=25)
@given(st.floats(0.01, 50.0), st.sampled_from([1e-5, 1e-8, 1e-10]))
def test_analytic_gaussian_agrees_with_the_pld_where_both_work(rho, delta):
    exact, pld = analytic_gaussian_epsilon(rho, delta), epsilon_from_zcdp(rho, delta, "pld")
    assert exact <= pld * (1 + 1e-9) + 1e-9  # the PLD rounds pessimistically
    assert pld == pytest.approx(exact, rel=2e-4)


@pytest.mark.parametrize("rho", [300.0, 512.78, 5e3, 1e5])
def test_huge_rho_eps_is_exact_at_its_delta(rho):
    eps = epsilon_from_zcdp(rho, 1e-10, "pld")
    assert math.isfinite(eps) and eps > rho  # at least the rho of the zCDP statement
    assert eps <= rho + 2 * math.sqrt(rho * math.log(1e10))  # below the zCDP bound
    assert math.log(1e-10) >= log_delta(math.sqrt(2 * rho), eps)  # a valid (eps, delta)
    assert eps == pytest.approx(analytic_gaussian_epsilon(rho, 1e-10), rel=2e-4)  # and tight


def test_dumps_writes_null_for_non_finite_values():
    obj = {"a": math.inf, "b": [float("nan"), -math.inf, 1.5], "c": np.float32("inf"),
           "d": (np.float64(2.0), np.int64(3)), "e": np.array([1.0, np.inf])}
    assert strict_loads(dumps(obj)) == {"a": None, "b": [None, None, 1.5], "c": None,
                                        "d": [2.0, 3], "e": [1.0, None]}


def test_run_directory_json_is_strict(tmp_path):
    run = RunDir(tmp_path / "run")
    run.append("metrics.jsonl", {"round": 1, "epsilon": math.inf, "loss": float("nan")})
    run.write_json("privacy.json", {"epsilon": math.inf})
    line = (tmp_path / "run" / "metrics.jsonl").read_text().strip()
    assert strict_loads(line) == {"round": 1, "epsilon": None, "loss": None}
    assert strict_loads((tmp_path / "run" / "privacy.json").read_text()) == {"epsilon": None}


def _values():
    from hypothesis import strategies as st

    leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=8),
                     st.floats(allow_nan=True, allow_infinity=True),
                     st.floats(width=32).map(np.float32), st.floats().map(np.float64),
                     st.integers(-100, 100).map(np.int64))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=4), inner, max_size=4)), max_leaves=20)


def test_the_fast_path_writes_exactly_what_the_finite_walk_writes():
    """`dumps` skips the `finite` walk for plain data: on any mix of plain and numpy values,
    finite and non-finite floats, it writes the same text as walking first, and never NaN."""
    from hypothesis import given, settings

    from dpfleet.jsonio import dumps, finite

    @settings(max_examples=300, deadline=None)
    @given(_values())
    def check(value):
        text = dumps(value)
        assert text == json.dumps(finite(value), allow_nan=False)
        strict_loads(text)  # valid JSON: no NaN / Infinity token

    check()


def test_numpy_arrays_and_numpy_scalars_never_leak_nan_through_the_fast_path():
    """Attack on the fast path: non-finite values hidden in numpy arrays (any float width,
    0-d too) and float64 scalars (a `float` subclass json writes natively), nested in
    dicts / lists / tuples, come out as null and the text is strict JSON."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from dpfleet.jsonio import dumps

    special = st.sampled_from([np.nan, np.inf, -np.inf, 0.5, -2.0])
    arrays = st.tuples(st.sampled_from([np.float16, np.float32, np.float64]),
                       st.lists(special, min_size=0, max_size=5), st.booleans()).map(
        lambda t: np.array(t[1][0] if t[2] and t[1] else t[1], dtype=t[0]))
    leaf = st.one_of(arrays, special.map(np.float64), special)
    tree = st.recursive(leaf, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=3), inner, max_size=3)), max_leaves=12)

    @settings(max_examples=300, deadline=None)
    @given(tree)
    def check(value):
        text = dumps(value)
        strict_loads(text)  # refuses a NaN / Infinity token (a dict key "NaN" is fine)

    check()
