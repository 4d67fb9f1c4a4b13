"""The run's live accountant: observed MinS / MaxP, eps per round, and the budget check."""

import math

import dp_accounting
import pytest
from dp_accounting import rdp
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.coordinator.accounting.ledger import account_participation_log
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_for_epsilon
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant
from dpfleet.errors import DpfleetError


def replay(acc: RunAccountant, log: list[dict]) -> list[dict]:
    return [acc.record(rec["devices"], rec["restart"]) for rec in log]


logs = st.integers(1, 16).flatmap(lambda rounds: st.lists(
    st.fixed_dictionaries({"devices": st.lists(st.sampled_from("abcdefg"), max_size=4, unique=True),
                           "restart": st.booleans()}),
    min_size=rounds, max_size=rounds))


@settings(max_examples=30, deadline=None)
@given(records=logs)
def test_live_accounting_equals_the_participation_log_accountant(records):
    log = [{"round": r, **rec} for r, rec in enumerate(records)]
    acc = RunAccountant(2.0, 1e-6)
    states = replay(acc, log)
    for r in (0, len(log) // 2, len(log) - 1):
        ref = account_participation_log(log, 2.0, 1e-6, "rdp", rounds=r + 1)  # RDP: cheap
        assert states[r]["zcdp"] == pytest.approx(ref["zcdp"])
        assert states[r]["max_participation"] == ref["max_participation"]
        assert states[r]["min_separation"] == ref["min_separation"]
    # eps as privacy.json converts the log's zCDP: PLD
    assert states[-1]["epsilon"] == pytest.approx(epsilon_from_zcdp(ref["zcdp"], 1e-6))
    assert acc.restarts == list(ref["restarts"])


@pytest.mark.parametrize(("z", "eps"), [(8.83, 1.77), (1.13, 18.71)])
def test_disjoint_rounds_report_paper_000_single_participation_rdp(z, eps):
    acc = RunAccountant(z, 1e-6)
    for r in range(1600):  # 100 fresh devices each round
        state = acc.record([f"{r}/{i}" for i in range(100)], restart=False)
    by_rdp = epsilon_from_zcdp(state["zcdp"], 1e-6, "rdp")  # paper 000 converts by RDP
    assert round(by_rdp, 2) == eps and state["max_participation"] == 1
    # dp-accounting's own single-epoch tree aggregation RDP, as the skeleton used per round
    ref = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    ref.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(z, 1600))
    assert by_rdp == pytest.approx(ref.get_epsilon(1e-6), rel=1e-9)
    assert state["epsilon"] == epsilon_from_zcdp(state["zcdp"], 1e-6) < by_rdp  # the run's: PLD


def test_budget_is_checked_with_the_devices_of_the_next_round():
    budget = 20.0
    acc = RunAccountant(1.0, 1e-6, budget_epsilon=budget)
    assert acc.rho_budget == pytest.approx(zcdp_for_epsilon(budget, 1e-6, "pld"))

    def pattern(r):  # six devices, two per round, each back every third round
        return [f"d{2 * r % 6}", f"d{(2 * r + 1) % 6}"]

    log = []
    while not acc.would_exceed(pattern(len(log)), False):
        acc.record(pattern(len(log)), False)
        log.append({"round": len(log), "devices": pattern(len(log)), "restart": False})
    assert len(log) == 7  # an 8th round would take S from 9 to 20 (eps 18.2 -> 30.6)
    assert account_participation_log(log, 1.0, 1e-6)["epsilon"] <= budget  # the report's PLD
    assert epsilon_from_zcdp(acc.zcdp_after(pattern(len(log)), False), 1e-6) > budget


def test_zero_noise_means_infinite_epsilon_without_a_crash():
    acc = RunAccountant(0.0, 1e-6)
    state = acc.record(["a"], False)
    assert state["zcdp"] == math.inf and state["epsilon"] == math.inf
    assert acc.record([], False)["max_participation"] == 1
    with pytest.raises(DpfleetError, match="budget needs"):
        RunAccountant(0.0, 1e-6, budget_epsilon=1.0)


def test_nobody_took_part_means_nothing_was_released():
    acc = RunAccountant(1.0, 1e-6)
    assert acc.record([], True) == {"zcdp": 0.0, "epsilon": 0.0, "sensitivity_squared": 0,
                                    "min_separation": None, "max_participation": 0}
