"""The one mechanism interface (issue 31): every registered mechanism's privacy event is the
Gaussian the run accountant converts, and the registry is the single list configs, the planner
and `dpfleet account` see."""

import functools
import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp
from dpfleet.coordinator.mechanisms.base import Mechanism
from dpfleet.coordinator.mechanisms.registry import build, entries, is_built_in, names, rebuild
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant


@functools.cache
def _built(kind, rounds, mins, maxp):
    """One mechanism per shape: BLT's optimisation is most of a build's cost and the property
    below varies z freely over each shape."""
    return build(kind, rounds, mins, maxp)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["tree", "banded", "blt", "independent"]), z=st.floats(0.5, 8),
       rounds=st.sampled_from([2, 5, 13, 24]), mins=st.sampled_from([0, 1, 5]),
       maxp=st.sampled_from([1, 2, 4]))
@pytest.mark.slow
def test_the_mechanisms_event_is_the_gaussian_the_accountant_converts(kind, z, rounds, mins, maxp):
    """PLD of the event (dp_accounting) and the accountant's eps of rho = sens^2 / (2 z^2) agree."""
    mechanism = _built(kind, rounds, mins, maxp)
    s = mechanism.sensitivity_squared(rounds, mins, maxp)
    event = mechanism.event(z, rounds, mins, maxp)
    assert isinstance(event, dp_accounting.GaussianDpEvent)
    assert event.noise_multiplier == pytest.approx(z / math.sqrt(s), rel=1e-12)
    ours = epsilon_from_zcdp(s / (2 * z * z), 1e-6)
    # a grid relative to eps: the loss range grows with eps, so an absolute 1e-4 grid cost seconds
    # per large-eps example while the comparison is relative
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4 * max(1.0, ours))
    pld.compose(event)
    assert pld.get_epsilon(1e-6) == pytest.approx(ours, rel=2e-3, abs=2e-3)


def test_no_participation_is_a_no_op_event_and_no_noise_is_non_private():
    tree = build("tree", 8, 0, 1)
    assert isinstance(tree.event(1.0, 8, None, 0), dp_accounting.NoOpDpEvent)
    assert isinstance(tree.event(0.0, 8, None, 1), dp_accounting.NonPrivateDpEvent)


@pytest.mark.parametrize("kind", ["tree", "banded", "blt", "independent"])
def test_every_registered_mechanism_rebuilds_from_its_identity(kind):
    """What a resume does: the same fingerprint from the recorded identity, and a changed strategy
    a different one."""
    mechanism = build(kind, 12, 2, 3)
    again = rebuild(kind, mechanism.identity())
    assert again.fingerprint() == mechanism.fingerprint() and is_built_in(again)
    other = build(kind, 12, 5, 2)
    assert (other.fingerprint() == mechanism.fingerprint()) == (kind in ("tree", "independent"))


def test_the_registry_lists_every_mechanism_once_in_a_stable_order():
    assert names()[:3] == ("tree", "banded", "blt") and "independent" in names()
    assert len(set(names())) == len(names()) == len(entries())
    assert all(issubclass(e.cls, Mechanism) for e in entries())


class Mine(Mechanism):
    name = "mine"

    def identity(self):
        return {}

    def sensitivity_squared(self, rounds, min_separation, max_participation, restarts=()):
        return float("nan") if max_participation else 0.0

    def stream(self, dim, std, key, segment=0, purpose="model"):
        raise AssertionError("not drawn")


def test_a_callers_mechanism_is_declared_and_a_nan_sensitivity_is_refused():
    from dpfleet.errors import DpfleetError

    assert not is_built_in(Mine())
    acc = RunAccountant(1.0, 1e-6, mechanism=Mine(), declared=True)
    with pytest.raises(DpfleetError, match=r"'mine'.*returned nan"):
        acc.record(["a"], False)


def test_an_installed_plugin_mechanism_is_nameable_from_a_config(monkeypatch, tmp_path):
    """A package's `dpfleet.mechanisms` entry point registers its mechanism: the config (hence
    `dpfleet simulate` and the service) can name it; a broken plugin is one clear error."""
    import importlib.metadata
    import sys

    from dpfleet.coordinator.config import parse_config
    from dpfleet.coordinator.mechanisms import registry
    from dpfleet.errors import DpfleetError

    (tmp_path / "my_noise.py").write_text(
        "from dpfleet.coordinator.mechanisms.independent import IndependentMechanism\n"
        "from dpfleet.coordinator.mechanisms.registry import register\n"
        "class Mine(IndependentMechanism):\n    name = 'mine'\n"
        "register('mine', Mine, lambda r, s, p: Mine(), lambda identity: Mine(), 'a plugin')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    point = importlib.metadata.EntryPoint("mine", "my_noise", registry.ENTRY_POINTS)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [point] if group == registry.ENTRY_POINTS else [])
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    try:
        assert "mine" in registry.names() and not is_built_in(build("mine", 4, 0, 1))
        assert parse_config({"dp": {"mechanism": "mine"}}).dp.mechanism == "mine"
        broken = importlib.metadata.EntryPoint("broken", "no_such_module_here", registry.ENTRY_POINTS)
        monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [broken])
        with pytest.raises(DpfleetError, match="plugin 'broken' .* does not load: ModuleNotFoundError"):
            registry.names()
    finally:
        sys.modules.pop("my_noise", None)
