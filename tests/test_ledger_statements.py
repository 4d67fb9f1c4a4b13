"""Every eps dpfleet prints comes from a privacy ledger (`accounting.ledger`): the figures of
`dpfleet account` (-z / -T and --participation-log), `dpfleet plan` (a grid and --trace) and a
run's projection, pinned to the values they printed before they were routed through the ledger
(to 1e-9 relative: `EPS`);
the rule that no library module converts zCDP to eps but the ledger; and a mechanism's own
`event()` as the ledger's training event, refused when it claims less than its sensitivity."""

import ast
import json
from pathlib import Path

import dp_accounting
import pytest
from test_api import CONFIG, USERS, TinyLM, WordIds
from test_launch_plan import write_five

import dpfleet
from dpfleet.cli import main
from dpfleet.coordinator.accounting import ledger
from dpfleet.coordinator.mechanisms.base import gaussian_event
from dpfleet.coordinator.mechanisms.tree import TreeMechanism
from dpfleet.errors import DpfleetError
from dpfleet.extensions import Mechanism

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("coordinator", "edge", "export", "secagg", "service", "fleet", "public")
# the zCDP -> eps conversions and dp_accounting's accountants: only the ledger calls them (zcdp.py
# defines the conversion and its inverse)
CONVERSIONS = ("epsilon_from_zcdp", "analytic_gaussian_epsilon", "PLDAccountant", "RdpAccountant")
# a pinned eps's tolerance: the PLD conversion's FFTs and exps round differently on another CPU (1 ulp
# on an AMD EPYC with AVX2 against the Intel Xeon with AVX-512 the pins were recorded on); any
# change to what is accounted moves eps by far more
EPS = {"rel": 1e-9, "abs": 0}
ALLOWED = {("coordinator/accounting/ledger.py", None),
           ("coordinator/accounting/zcdp.py", "epsilon_from_zcdp"),
           ("coordinator/accounting/zcdp.py", "zcdp_for_epsilon")}


def _json(capsys, args: list[str]) -> dict:
    main(args)
    return json.loads(capsys.readouterr().out)


def test_account_worst_case_prints_the_pinned_eps(capsys):
    # tree, T = 8, MaxP 2, MinS 3: sens^2 10 (hand: the worst pair of 2 leaves' root paths),
    # rho = 10 / (2 * 2^2) = 1.25; eps by PLD at 1e-6 as printed before the ledger
    out = _json(capsys, ["account", "-z", "2", "-T", "8", "--max-participation", "2",
                         "--min-separation", "3", "--delta", "1e-6", "--json"])
    assert (out["sensitivity_squared"], out["zcdp"]) == (10, 1.25)
    assert out["epsilon"] == pytest.approx(8.306225456309951, **EPS)


def test_account_participation_log_prints_the_pinned_eps(tmp_path, capsys):
    log = tmp_path / "participation.jsonl"
    log.write_text('{"round":0,"devices":["a","b"]}\n{"round":1,"devices":["c"]}\n'
                   '{"round":2,"devices":["a"]}\n')
    out = _json(capsys, ["account", "-z", "2", "--participation-log", str(log), "--delta", "1e-6", "--json"])
    # device a in rounds 0 and 2: MaxP 2, MinS 1, sens^2 3 over 3 rounds, rho = 3 / 8
    assert (out["sensitivity_squared"], out["zcdp"]) == (3, 0.375)
    assert out["epsilon"] == out["worst_device"]["epsilon"] == pytest.approx(4.151816840394691, **EPS)


def test_plan_prints_the_pinned_eps(capsys):
    out = _json(capsys, ["plan", "-N", "200", "-T", "10", "--target-zcdp", "0.5", "--delta", "1e-6",
                         "--json"])
    assert out["epsilon"] == pytest.approx(4.88655430032725, **EPS)


def test_plan_over_a_trace_prints_the_pinned_eps(tmp_path, capsys):
    trace = write_five(tmp_path / "five.jsonl")
    out = _json(capsys, ["plan", "--trace", str(trace), "--days", "0.25", "--round-minutes", "60",
                 "--target-zcdp", "0.5", "--delta", "1e-6", "--json"])
    chosen = out["chosen"]
    assert chosen["epsilon"] == chosen["realised_epsilon"] == pytest.approx(4.886554300327249, **EPS)


def test_a_hypothetical_release_is_a_one_entry_ledger():
    # rho 0.5 stated as the Gaussian of multiplier 1 / sqrt(2 rho) = 1: the plan's eps above
    assert ledger.stated_epsilon(0.5, 1e-6, "pld") == pytest.approx(4.88655430032725, **EPS)
    assert ledger.stated_epsilon(0.0, 1e-6, "pld") == 0.0


def _conversions(path: Path):
    """(line, innermost function or None) of each call of a conversion in the file at `path`."""
    def visit(node: ast.AST, owner: str | None):  # one walk, the innermost def carried down
        for child in ast.iter_child_nodes(node):
            func = child.func if isinstance(child, ast.Call) else None
            if (getattr(func, "id", None) or getattr(func, "attr", None)) in CONVERSIONS:
                yield child.lineno, owner
            yield from visit(child, child.name if isinstance(child, ast.FunctionDef) else owner)

    yield from visit(ast.parse(path.read_text()), None)


def test_no_library_module_converts_zcdp_to_eps_but_the_ledger():
    offenders = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            offenders += [f"{rel}:{line}" for line, fn in _conversions(path)
                          if (rel, None) not in ALLOWED and (rel, fn) not in ALLOWED]
    assert offenders == []


class UnderReports(Mechanism):
    """The tree's sensitivity, but an event() that claims half the noise's privacy loss."""

    name = "under-reports"

    def identity(self):
        return {}

    def sensitivity_squared(self, rounds, min_separation, max_participation, restarts=()):
        return TreeMechanism().sensitivity_squared(rounds, min_separation, max_participation, restarts)

    def event(self, noise_multiplier, rounds, min_separation, max_participation, restarts=()):
        s = self.sensitivity_squared(rounds, min_separation, max_participation, restarts)
        return gaussian_event(noise_multiplier * 2.0, s)

    def stream(self, dim, std, key, segment=0, purpose="model"):
        return TreeMechanism().stream(dim, std, key, segment, purpose)


def test_a_built_in_speaks_its_own_event_and_it_is_the_gaussian_of_its_sensitivity():
    tree = TreeMechanism()
    entry = ledger.mechanism_entry(tree, 2.0, 10.0, (8, 3, 2, ()))
    assert entry.event == gaussian_event(2.0, 10.0) == dp_accounting.GaussianDpEvent(2.0 / 10.0**0.5)
    assert entry.zcdp == 1.25


def test_attack_a_mechanism_whose_event_under_reports_is_refused(tmp_path):
    refused = "under-reports.*event.*claims rho 0.03125.*sensitivity implies 0.125"
    with pytest.raises(DpfleetError, match=refused):
        ledger.mechanism_entry(UnderReports(), 2.0, 1.0, (1, None, 1, ()))
    config = {**CONFIG, "rounds": 2, "dp": {**CONFIG["dp"], "noise_seed": 7},
              "participation": {"mode": "uniform", "min_separation": 1}}
    with pytest.raises(DpfleetError, match="under-reports.*event"):
        dpfleet.simulate(config, model=TinyLM(), users=USERS, tokenizer=WordIds(), progress=False,
                         run_dir=tmp_path / "run", noise=UnderReports())
    assert not (tmp_path / "run" / "privacy.json").exists()
