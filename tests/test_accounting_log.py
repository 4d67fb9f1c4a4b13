"""Accounting a run from participation.jsonl, and the `dpfleet account` CLI."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.cli import main
from dpfleet.coordinator.accounting.ledger import account_participation_log
from dpfleet.coordinator.accounting.zcdp import observe_participation, zcdp_from_noise
from dpfleet.coordinator.mechanisms.tree_sensitivity import pattern_sensitivity_squared
from dpfleet.errors import DpfleetError


def write_log(path, rounds):
    path.write_text("".join(json.dumps(r) + "\n" for r in rounds))
    return path


def log_from_patterns(patterns, rounds, restarts=()):
    """Records of a run in which device i took part in the rounds patterns[i]."""
    return [{"round": r, "devices": [f"dev{i}" for i, p in enumerate(patterns) if r in p],
             "restart": r in restarts} for r in range(rounds)]


def test_observed_min_separation_and_max_participation():
    recs = log_from_patterns([[0, 5, 9], [2, 4], [7]], 10, restarts=(0, 6))
    obs = observe_participation(recs)
    assert obs.rounds == 10 and obs.restarts == (6,)
    assert obs.max_participation == 3
    assert obs.min_separation == 1  # dev1 at rounds 2 and 4: one round between
    assert observe_participation(log_from_patterns([[1], [3]], 5)).min_separation is None


def test_account_log_reports_worst_case_and_worst_device(tmp_path):
    patterns = [[0, 8, 16, 24], [3, 12], [30]]
    log = write_log(tmp_path / "participation.jsonl", log_from_patterns(patterns, 32))
    out = account_participation_log(log, noise_multiplier=2.0, delta=1e-6)
    assert out["max_participation"] == 4 and out["min_separation"] == 7
    assert out["zcdp"] == pytest.approx(zcdp_from_noise(2.0, 32, 4, 7))
    dev = out["worst_device"]
    assert dev["device"] == "dev0" and dev["participations"] == 4
    assert dev["sensitivity_squared"] == pattern_sensitivity_squared([patterns[0]], 32)[0]
    assert dev["zcdp"] <= out["zcdp"] and dev["epsilon"] <= out["epsilon"]
    assert {"zcdp", "epsilon", "delta", "sensitivity_squared", "devices"} <= out.keys()


def test_prefix_of_the_log_accounts_an_earlier_model(tmp_path):
    log = write_log(tmp_path / "p.jsonl", log_from_patterns([[0, 8, 16, 24], [3, 12]], 32))
    early = account_participation_log(log, 2.0, 1e-6, rounds=10)
    assert early["rounds"] == 10 and early["max_participation"] == 2
    assert early["zcdp"] < account_participation_log(log, 2.0, 1e-6)["zcdp"]
    with pytest.raises(DpfleetError, match="more than the log holds"):
        account_participation_log(log, 2.0, 1e-6, rounds=33)


def test_restarts_from_the_log_change_the_accounting():
    patterns = [[0, 9]]
    plain = account_participation_log(log_from_patterns(patterns, 16), 1.0, 1e-6)
    restarted = account_participation_log(log_from_patterns(patterns, 16, (8,)), 1.0, 1e-6)
    assert restarted["restarts"] == [8] and plain["restarts"] == []
    assert restarted["worst_device"]["sensitivity_squared"] == 8  # two trees of depth 4
    assert plain["worst_device"]["sensitivity_squared"] == 12  # 5 + 5 + shared root (4 - 2)


def test_nobody_took_part_means_nothing_released():
    out = account_participation_log([{"round": 0, "devices": [], "restart": True}], 1.0, 1e-6)
    assert out["zcdp"] == 0 and out["epsilon"] == 0 and out["worst_device"] is None


@settings(max_examples=30, deadline=None)
@given(data=st.data(), rounds=st.integers(2, 40))
def test_worst_device_never_exceeds_the_observed_bound(data, rounds):
    patterns = data.draw(st.lists(st.sets(st.integers(0, rounds - 1), min_size=1).map(sorted),
                                  min_size=1, max_size=5))
    out = account_participation_log(log_from_patterns(patterns, rounds), 1.0, 1e-6, "rdp")
    assert out["worst_device"]["sensitivity_squared"] <= out["sensitivity_squared"]
    assert out["max_participation"] == max(len(p) for p in patterns)


@pytest.mark.parametrize(
    "records,needle",
    [
        ([], "empty"),
        ([{"round": 0}], "needs 'round' and 'devices'"),
        ([{"round": -1, "devices": []}], "bad round"),
        ([{"round": "0", "devices": []}], "bad round"),
        ([{"round": True, "devices": []}], "bad round"),
        ([{"round": 0, "devices": []}, {"round": 0, "devices": []}], "appears twice"),
        ([{"round": 0, "devices": []}, {"round": 2, "devices": []}], "misses rounds [1]"),
        ([{"round": 0, "devices": "abc"}], "list of string ids"),
        ([{"round": 0, "devices": [1, 2]}], "list of string ids"),
        ([{"round": 0, "devices": ["a", "a"]}], "listed twice"),
        ([{"round": 0, "devices": ["a"], "restart": "yes"}], "'restart'"),
        (["not a dict"], "needs 'round'"),
    ],
)
def test_malformed_logs_are_refused(records, needle):
    with pytest.raises(DpfleetError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        observe_participation(records)


def test_unreadable_log_files(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"round": 0, "devices": []}\n{oops\n')
    with pytest.raises(DpfleetError, match="p.jsonl:2: not JSON"):
        account_participation_log(bad, 1.0, 1e-6)
    with pytest.raises(DpfleetError, match="does not exist"):
        account_participation_log(tmp_path / "missing.jsonl", 1.0, 1e-6)


def run(capsys, *args):
    main(["account", *args])
    return capsys.readouterr().out


def test_cli_json_reproduces_pt_br(capsys):
    out = json.loads(run(capsys, "-z", "7", "-T", "3600", "-P", "3", "-S", "909", "--json"))
    assert out["sensitivity_squared"] == 44 and round(out["zcdp"], 2) == 0.45
    assert out["delta"] == 1e-10 and out["method"] == "pld" and out["epsilon"] > 0


def test_cli_text_and_methods(capsys):
    text = run(capsys, "--noise-multiplier", "8.83", "--rounds", "1600", "--delta", "1e-6",
               "--method", "rdp")
    assert "epsilon               1.7732" in text and "sensitivity^2 (C^2)   11" in text
    out = json.loads(run(capsys, "-z", "7", "-T", "1600", "--restarts", "128, 1152", "--json"))
    assert out["restarts"] == [128, 1152] and out["sensitivity_squared"] == 11


def test_cli_participation_log(tmp_path, capsys):
    log = write_log(tmp_path / "participation.jsonl", log_from_patterns([[0, 4], [2]], 6))
    out = json.loads(run(capsys, "-z", "1", "--participation-log", str(log), "--json"))
    assert out["min_separation"] == 3 and out["worst_device"]["device"] == "dev0"
    assert "worst actual device   dev0" in run(capsys, "-z", "1", "--participation-log", str(log))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["-z", "7"], "give --rounds"),
        (["-z", "0", "-T", "10"], "noise multiplier"),
        (["-z", "7", "-T", "10", "--delta", "2"], "delta must be in (0, 1)"),
        (["-z", "7", "-T", "10", "-P", "0"], "max_participation must be >= 1"),
        (["-z", "7", "-T", "10", "-S", "-2"], "min_separation must be >= 0"),
        (["-z", "7", "-T", "10", "--restarts", "4,x"], "comma-separated"),
        (["-z", "7", "-T", "10", "--restarts", "12"], "restart round 12"),
        (["-z", "7", "--participation-log", "nope.jsonl"], "does not exist"),
        (["-z", "7", "--participation-log", "x.jsonl", "-P", "2"], "come from the log"),
    ],
)
def test_cli_errors_are_one_line(capsys, args, needle):
    with pytest.raises(SystemExit) as exc:
        main(["account", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]
