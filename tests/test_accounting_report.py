"""privacy_report.md in the shape of paper 002 App. C: one renderer over the run's privacy summary,
for every mechanism (issue 31). The summary comes from the run accountant fed a participation
pattern; its figures are checked against the independent log accountant (`account_participation_log`)."""

import json

import pytest

from dpfleet.coordinator.accounting.ledger import account_participation_log
from dpfleet.coordinator.accounting.privacy_report import render_privacy_report
from dpfleet.coordinator.accounting.zcdp import zcdp_from_sensitivity
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.participation import Participation
from dpfleet.coordinator.mechanisms.registry import build
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant, run_privacy

CFG = {"rounds": 40, "data": {"max_clients": 8},
       "participation": {"mode": "uniform", "min_separation": 3, "max_participation": 10},
       "dp": {"noise_multiplier": 2.0, "clip_norm": 0.3, "report_goal": 2, "delta": 1e-6}}
ENFORCED = {"min_separation": 3, "max_participation": 10, "participation": "uniform"}


def pattern():
    """8 devices in 4 fixed pairs, cycled: every device every 4th round (MinS 3), restart at 16."""
    return [{"round": r, "devices": [f"d{2 * (r % 4)}", f"d{2 * (r % 4) + 1}"], "restart": r == 16}
            for r in range(24)]


def summary(mechanism="tree", enforced=ENFORCED, vocabulary=None, **dp):
    cfg = parse_config({**CFG, "dp": {**CFG["dp"], **dp}})
    acc = RunAccountant(2.0, 1e-6, mechanism=build(mechanism, 40, 3, 10), vocabulary=vocabulary)
    for entry in pattern():
        acc.record(entry["devices"], entry["restart"] and mechanism == "tree")
    participation = Participation(cfg.participation, 8, 2, 40, 0)
    return run_privacy(cfg, participation, acc, 8, model_noise_multiplier=2.0, stopped_early=None,
                       optimised_for=enforced, vocabulary=vocabulary)


def test_report_has_the_app_c_sections_and_the_log_accountants_numbers(tmp_path):
    p = summary()
    log = tmp_path / "participation.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in pattern()))
    observed = account_participation_log(log, 2.0, 1e-6)
    assert (p["zcdp"], p["epsilon"], p["sensitivity_squared"]) == (
        observed["zcdp"], observed["epsilon"], observed["sensitivity_squared"])
    text = render_privacy_report(p)
    for heading in ("## 1. DP setting", "## 2. Instantiating the DP definition",
                    "## 3. Privacy accounting details", "*Unit of privacy*",
                    "*Adjacency*: Zero-out", "*Type of accounting*", "*Accounting assumptions*",
                    "*Formal DP statement*", "## Parameters"):
        assert heading in text
    assert f"rho = {p['zcdp']:.4g}" in text and f"eps = {p['epsilon']:.4g}" in text
    assert "| MinS | 3 | 3 |" in text and "| MaxP | 6 | 10 |" in text
    assert "| restarts (fresh noise segments) | 16 | 16 |" in text
    assert "| clip norm | 0.3 |" in text and "| population | 8 |" in text
    assert "online binary tree" in text and "Warning" not in text


def test_the_enforced_worst_case_is_the_mechanisms_over_the_planned_rounds():
    p = summary()
    enforced = p["timer_worst_case"]
    tree = build("tree", 40, 3, 10)
    assert (enforced["rounds"], enforced["min_separation"], enforced["max_participation"]) == (40, 3, 10)
    assert enforced["zcdp"] == zcdp_from_sensitivity(2.0, tree.sensitivity_squared(40, 3, 10, [16]))
    assert p["zcdp"] <= enforced["zcdp"]


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_matrix_mechanisms_render_through_the_same_report(kind):
    p = summary(kind)
    mechanism = build(kind, 40, 3, 10)
    assert p["sensitivity_squared"] == mechanism.sensitivity_squared(24, 3, 6)
    text = render_privacy_report(p)
    assert mechanism.describe() in text and f"rho = {p['zcdp']:.4g}" in text
    assert f"| mechanism fingerprint | {mechanism.fingerprint()[:16]} |" in text


def test_timer_violation_is_flagged():
    text = render_privacy_report(summary(enforced={**ENFORCED, "min_separation": 5}))
    assert "**Warning**: the observed MinS (3) is below the enforced one (5)" in text


@pytest.mark.parametrize("kind", ["tree", "banded", "blt"])
def test_a_dp_vocabulary_composes_with_the_runs_own_mechanism(kind):
    """Attack 3 of issue 31: a banded / BLT run reported total_with_vocabulary from the TREE's
    zCDP (5.5 instead of 2.48) and its report omitted the vocabulary."""
    vocab = {"zcdp": 0.05, "delta": 1e-9, "mechanism": "Gaussian partition selection",
             "words_per_user": 8, "noise": 10 ** 0.5, "threshold": 9.0, "kept": 100, "candidates": 900}
    p = summary(kind, vocabulary=vocab)
    assert p["total_with_vocabulary"]["zcdp"] == pytest.approx(p["zcdp"] + 0.05, rel=1e-12)
    if kind != "tree":
        tree = summary("tree", vocabulary=vocab)
        assert p["total_with_vocabulary"]["zcdp"] != pytest.approx(tree["total_with_vocabulary"]["zcdp"])
    text = render_privacy_report(p)
    assert "## Vocabulary (DP partition selection)" in text
    assert f"**{p['total_with_vocabulary']['epsilon']:.4g}**" in text


def test_no_round_and_no_noise_say_so():
    cfg = parse_config(CFG)
    participation = Participation(cfg.participation, 8, 2, 40, 0)
    acc = RunAccountant(2.0, 1e-6)
    p = run_privacy(cfg, participation, acc, 8, model_noise_multiplier=2.0, stopped_early="budget",
                    optimised_for=ENFORCED)
    assert p["epsilon"] == 0 and "No round ran" in render_privacy_report(p)
