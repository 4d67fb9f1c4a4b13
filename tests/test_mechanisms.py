"""Mechanism specs and their accounting: tree = the accountant, banded/BLT = brute force."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.accounting.ledger import account_worst_case
from dpfleet.coordinator.accounting.zcdp import zcdp_from_noise
from dpfleet.coordinator.mechanisms.blt import BLT, banded_toeplitz_matrix
from dpfleet.coordinator.mechanisms.matrix import MatrixMechanism
from dpfleet.coordinator.mechanisms.mf_optimize import optimize_blt, tree_loss
from dpfleet.coordinator.mechanisms.mf_sensitivity import (
    brute_force_sensitivity_squared,
    pattern_sensitivity_squared,
)
from dpfleet.coordinator.mechanisms.spec import (
    MAX_BANDS,
    MECHANISMS,
    MechanismSpec,
    noise_factor,
    optimize_mechanism,
    relative_noise,
    sensitivity_squared,
)
from dpfleet.coordinator.mechanisms.tree import TreeMechanism
from dpfleet.errors import DpfleetError

positive = st.floats(0.01, 2.0, allow_nan=False)
decay = st.floats(0.01, 0.99, allow_nan=False)


@st.composite
def specs(draw, max_rounds: int = 12):
    kind = draw(st.sampled_from(MECHANISMS))
    rounds = draw(st.integers(1, max_rounds))
    if kind == "tree":
        return MechanismSpec("tree", rounds)
    if kind == "banded":
        coef = draw(st.lists(positive, min_size=1, max_size=rounds))
        return MechanismSpec("banded", rounds, bands=len(coef), coefficients=tuple(coef))
    d = draw(st.integers(1, 3))
    return MechanismSpec("blt", rounds, theta=tuple(draw(st.lists(decay, min_size=d, max_size=d))),
                         omega=tuple(draw(st.lists(positive, min_size=d, max_size=d))))


def matrix(spec: MechanismSpec) -> np.ndarray:
    if spec.kind == "banded":
        return banded_toeplitz_matrix(np.asarray(spec.coefficients), spec.rounds)
    return BLT(np.asarray(spec.theta), np.asarray(spec.omega)).matrix(spec.rounds)


@given(specs(max_rounds=200))
@settings(max_examples=60, deadline=None)
def test_json_round_trip_is_exact(spec):
    text = json.dumps(spec.to_json())
    back = MechanismSpec.from_json(json.loads(text))
    assert back == spec and back.to_json() == spec.to_json()


@pytest.mark.parametrize("kwargs,needle", [
    ({"kind": "fft", "rounds": 4}, "unknown mechanism"),
    ({"kind": "tree", "rounds": 0}, "rounds must be >= 1"),
    ({"kind": "tree", "rounds": 4, "bands": 2}, "no bands"),
    ({"kind": "banded", "rounds": 4, "bands": 2, "coefficients": (1.0,)}, "one coefficient per band"),
    ({"kind": "banded", "rounds": 4, "bands": 5, "coefficients": (1.0,) * 5}, "bands <= rounds"),
    ({"kind": "banded", "rounds": 4, "bands": 1, "coefficients": (0.0,)}, "nonzero"),
    ({"kind": "banded", "rounds": 4, "bands": 1, "coefficients": (math.nan,)}, "finite"),
    ({"kind": "blt", "rounds": 4, "theta": (0.5,), "omega": ()}, "one length"),
    ({"kind": "blt", "rounds": 4, "theta": (1.0,), "omega": (0.1,)}, "theta in (0, 1)"),
    ({"kind": "blt", "rounds": 4, "theta": (0.5,), "omega": (-0.1,)}, "omega > 0"),
    ({"kind": "blt", "rounds": 4, "theta": "ab", "omega": (0.1,)}, "list of numbers"),
])
def test_bad_specs_are_refused(kwargs, needle):
    with pytest.raises(DpfleetError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        MechanismSpec(**kwargs)
    with pytest.raises(DpfleetError):
        MechanismSpec.from_json({**kwargs, "extra": 1})


@pytest.mark.parametrize("rounds,mins,maxp,restarts,adjacency", [
    (60, 3, 15, None, "zero-out"), (60, 2, 15, None, "zero-out"), (100, 9, 4, [50], "replace-one"),
    (1290, 170, 6, None, "zero-out"), (33, 0, 1, None, "zero-out"),
])
def test_tree_path_is_the_accountant_exactly(rounds, mins, maxp, restarts, adjacency):
    spec = optimize_mechanism("tree", rounds, mins, maxp)
    assert spec == MechanismSpec("tree", rounds)
    z = 7.0
    acc = account_worst_case(z, rounds, maxp, mins, restarts, adjacency=adjacency)
    assert sensitivity_squared(spec, mins, maxp, restarts=restarts, adjacency=adjacency) \
        == acc["sensitivity_squared"]
    rho = zcdp_from_noise(z, rounds, maxp, mins, restarts, adjacency=adjacency, mechanism=TreeMechanism())
    assert rho == acc["zcdp"] == zcdp_from_noise(z, rounds, maxp, mins, restarts, adjacency=adjacency)
    with pytest.raises(DpfleetError, match="positive"):  # no noise has no zCDP to state
        zcdp_from_noise(0.0, rounds, maxp, mins)


@given(specs(), st.integers(0, 4), st.integers(1, 12), st.floats(0.3, 20))
@settings(max_examples=120, deadline=None)
def test_mf_zcdp_is_brute_force_sensitivity_over_2z2(spec, mins, maxp, z):
    if spec.kind == "tree":
        return
    brute = brute_force_sensitivity_squared(matrix(spec), mins + 1, maxp)
    s = sensitivity_squared(spec, mins, maxp)
    exact = (spec.bands <= mins + 1 if spec.kind == "banded"
             else sum(spec.omega) <= 1)  # then the BLT's coefficients are non-increasing
    if spec.kind == "banded" and not exact:
        coef = np.asarray(spec.coefficients)
        exact = bool(np.all(np.diff(coef) <= 0))
    if exact:
        assert s == pytest.approx(brute, rel=1e-9)
    else:  # the majorant bound: never below the truth
        assert s >= brute * (1 - 1e-9)
    rho = zcdp_from_noise(z, spec.rounds, maxp, mins, mechanism=MatrixMechanism(spec))
    assert rho == pytest.approx(s / (2 * z * z), rel=1e-12)


@pytest.mark.parametrize("kind,rounds,mins,maxp", [
    (kind, *shape) for shape in [(12, 2, 4), (10, 0, None)] for kind in ("banded", "blt")
] + [("banded", 14, 4, 2),
     # ~8 s (two BLT optimisations); [blt-12-2-4] runs the same path (a 2-buffer BLT with
     # min separation and a participation cap) in the default suite
     pytest.param("blt", 14, 4, 2, marks=pytest.mark.slow)])
def test_optimised_specs_sensitivity_is_brute_force_and_deterministic(kind, rounds, mins, maxp):
    spec = optimize_mechanism(kind, rounds, mins, maxp)
    optimize_mechanism.cache_clear()
    assert optimize_mechanism(kind, rounds, mins, maxp) == spec  # recomputed, not the cache
    if kind == "banded":
        assert spec.bands == min(mins + 1, rounds, MAX_BANDS)
    brute = brute_force_sensitivity_squared(matrix(spec), mins + 1, maxp, upper_bound=True)
    assert sensitivity_squared(spec, mins, maxp) == pytest.approx(brute, rel=1e-9)
    # less model noise than the tree at equal zCDP, and the figure is mf_optimize's loss ratio
    rel = relative_noise(spec, mins, maxp)
    assert 0 < rel < 1


def test_relative_noise_is_the_loss_ratio_of_mf_optimize():
    spec = optimize_mechanism("blt", 60, 2, 15)
    best = min((optimize_blt(60, 3, 15, buffers=d) for d in (1, 2, 3, 4)), key=lambda r: r.loss)
    assert relative_noise(spec, 2, 15) == pytest.approx(math.sqrt(best.loss / tree_loss(60, 3, 15)),
                                                        rel=1e-9)
    assert noise_factor(MechanismSpec("tree", 60)) == 1.0
    # the tree's worst prefix (popcount 5 at t = 31) against the BLT's: z * factor is the model noise
    assert noise_factor(spec) == pytest.approx(relative_noise(spec, 2, 15) * math.sqrt(292 / (
        sensitivity_squared(spec, 2, 15))), rel=1e-9)


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_attack_accounting_with_a_larger_min_separation_than_enforced_understates(kind):
    """A run whose timer enforced MinS 1 but is accounted with MinS 4: the claimed sensitivity is
    smaller than what a device the timer let through actually exposes."""
    rounds, enforced, claimed, maxp = 14, 1, 4, 5
    spec = optimize_mechanism(kind, rounds, enforced, maxp)
    c = matrix(spec)
    truth = brute_force_sensitivity_squared(c, enforced + 1, maxp, upper_bound=True)
    honest = sensitivity_squared(spec, enforced, maxp)
    wrong = sensitivity_squared(spec, claimed, maxp)
    assert honest == pytest.approx(truth, rel=1e-9)
    # a pattern the enforced timer allows (every other round, from round 0), 5 participations
    attack = pattern_sensitivity_squared(c, [0, 2, 4, 6, 8])
    assert attack > wrong * 1.2 and attack <= honest * (1 + 1e-9)
    rho_claimed, rho_enforced = (zcdp_from_noise(5.0, rounds, maxp, m, mechanism=MatrixMechanism(spec))
                                 for m in (claimed, enforced))
    assert rho_claimed < attack / 50 <= rho_enforced * (1 + 1e-9)


def test_bad_inputs():
    spec = MechanismSpec("tree", 10)
    with pytest.raises(DpfleetError, match="unknown mechanism"):
        optimize_mechanism("dct", 10, 1, 2)
    with pytest.raises(DpfleetError, match="restarts"):
        sensitivity_squared(optimize_mechanism("banded", 10, 1, 2), 1, 2, restarts=[5])
    with pytest.raises(DpfleetError, match="MechanismSpec"):
        sensitivity_squared({"kind": "tree"}, 1, 2)
    with pytest.raises(DpfleetError, match="max_participation"):
        sensitivity_squared(spec, 1, 0)
    with pytest.raises(DpfleetError, match="positive"):
        zcdp_from_noise(-1.0, spec.rounds, 2, 1)
