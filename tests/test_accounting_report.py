"""privacy_report.md in the shape of paper 002 App. C."""

import json

import pytest

from dpfleet.coordinator.accounting.privacy_report import summarize_privacy, write_privacy_report
from dpfleet.coordinator.accounting.zcdp import account_participation_log, zcdp_from_noise
from dpfleet.errors import DpfleetError

SETTING = {"noise_multiplier": 2.0, "delta": 1e-6, "clip_norm": 0.3, "report_goal": 2,
           "population": 8, "timer_min_separation": 3, "timer_period": "4 rounds",
           "rounds": 40}


@pytest.fixture
def run_dir(tmp_path):
    # 8 devices in 4 fixed pairs, cycled: every device every 4th round (MinS 3), restart at 16
    with (tmp_path / "participation.jsonl").open("w") as fh:
        for r in range(24):
            pair = r % 4
            fh.write(json.dumps({"round": r, "devices": [f"d{2 * pair}", f"d{2 * pair + 1}"],
                                 "restart": r == 16}) + "\n")
    return tmp_path


def test_report_has_the_app_c_sections_and_numbers(run_dir):
    path = write_privacy_report(run_dir, SETTING)
    assert path == run_dir / "privacy_report.md"
    text = path.read_text()
    for heading in ("## 1. DP setting", "## 2. Instantiating the DP definition",
                    "## 3. Privacy accounting details", "*Unit of privacy*",
                    "*Adjacency*: Zero-out", "*Type of accounting*", "*Accounting assumptions*",
                    "*Formal DP statement*", "## Parameters"):
        assert heading in text
    observed = account_participation_log(run_dir / "participation.jsonl", 2.0, 1e-6)
    assert f"rho = {observed['zcdp']:.4g}" in text and f"eps = {observed['epsilon']:.4g}" in text
    assert "| MinS | 3 | 3 |" in text and "| MaxP | 6 | 10 |" in text
    assert "| tree restarts | 16 | 16 |" in text
    assert "| clip norm | 0.3 |" in text and "| population | 8 |" in text
    assert "(4 rounds)" in text and "Warning" not in text


def test_summary_numbers(run_dir):
    summary = summarize_privacy(run_dir, SETTING)
    obs, timer = summary["observed"], summary["timer"]
    assert summary["headline"] is obs
    assert (obs["rounds"], obs["min_separation"], obs["max_participation"]) == (24, 3, 6)
    assert timer["rounds"] == 40 and timer["max_participation"] == 10
    assert timer["zcdp"] == pytest.approx(zcdp_from_noise(2.0, 40, 10, 3, [16]))
    assert obs["zcdp"] <= timer["zcdp"]


def test_replace_one_and_user_level(run_dir):
    zero = summarize_privacy(run_dir, SETTING)["headline"]["zcdp"]
    text_setting = {**SETTING, "adjacency": "replace-one", "unit": "user", "secagg": True}
    assert summarize_privacy(run_dir, text_setting)["headline"]["zcdp"] == pytest.approx(4 * zero)
    text = write_privacy_report(run_dir, text_setting).read_text()
    assert "User-level DP" in text and "Replace-one" in text and "secure aggregation" in text


def test_timer_violation_is_flagged(run_dir):
    text = write_privacy_report(run_dir, {**SETTING, "timer_min_separation": 5}).read_text()
    assert "**Warning**: the observed MinS (3) is below the timer's (5)" in text


def test_without_log_the_timer_worst_case_is_the_headline(tmp_path):
    summary = summarize_privacy(tmp_path, {**SETTING, "restarts": [8]})
    assert summary["observed"] is None and summary["headline"] is summary["timer"]
    assert summary["timer"]["restarts"] == [8]
    assert "| rounds | - | 40 |" in write_privacy_report(tmp_path, SETTING).read_text()


@pytest.mark.parametrize(
    "setting,needle",
    [
        ({"delta": 1e-6}, "misses noise_multiplier"),
        ({**SETTING, "noise_multiplyer": 2.0}, "unknown privacy-report setting keys"),
        ({**SETTING, "unit": "household"}, "unit must be one of"),
        ({**SETTING, "adjacency": "swap"}, "adjacency must be one of"),
        ({**SETTING, "tree_nodes": "some"}, "tree_nodes must be one of"),
        ({**SETTING, "timer_min_separation": -1}, "timer_min_separation must be >= 0"),
        ({**SETTING, "timer_min_separation": "3"}, "must be an integer"),
        ({**SETTING, "delta": 0}, "delta"),
        ({**SETTING, "method": "moments"}, "unknown accounting method"),
    ],
)
def test_bad_settings_are_refused(run_dir, setting, needle):
    with pytest.raises(DpfleetError, match=needle):
        write_privacy_report(run_dir, setting)


def test_nothing_to_account_and_missing_run_dir(tmp_path):
    no_timer = {k: v for k, v in SETTING.items() if k != "timer_min_separation"}
    with pytest.raises(DpfleetError, match="nothing to account"):
        write_privacy_report(tmp_path, no_timer)
    with pytest.raises(DpfleetError, match="does not exist"):
        write_privacy_report(tmp_path / "nope", SETTING)
