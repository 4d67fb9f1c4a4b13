"""A result that means nothing says so (issue 33): noise that drowns every update (at plan time),
a model at or below the unigram baseline, eps above dp.warn_epsilon, each one line in the CLI
summary, summary.json and `Result.warnings`; a budget no round fits is one error line, exit 2."""

import json
import math
import re

import pytest

import dpfleet.coordinator.run as coordinator_run
from dpfleet.cli import main
from dpfleet.coordinator.accounting import ledger
from dpfleet.coordinator.accounting.zcdp import epsilon_from_zcdp, zcdp_for_epsilon
from dpfleet.coordinator.config import parse_config, validate
from dpfleet.coordinator.run_privacy.result_warnings import (
    NOISE_PER_REPORT_LIMIT,
    plan_warnings,
    result_warnings,
)
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.errors import DpfleetError

TINY = {
    "rounds": 3,
    "eval_every": 3,
    "seed": 5,
    "data": {"dataset": "shakespeare", "max_clients": 12, "eval_examples": 200, "max_examples": 16},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"lr": 1.0, "batch_size": 16},
    "dp": {"noise_multiplier": 0.1, "clip_norm": 0.5, "report_goal": 4, "momentum": 0.5},
}  # z / M 0.025: under the noise limit
FINE = {"accuracy": 0.20}, {"accuracy": 0.073}, {"epsilon": 8.0, "delta": 1e-6}


def cfg_with(**dp):
    return parse_config({**TINY, "dp": {**TINY["dp"], **dp}})


def test_noise_warning_fires_from_the_limit_and_not_for_the_main_jobs_noise():
    assert plan_warnings(cfg_with(noise_multiplier=1.977, report_goal=319)) == []  # the main job
    assert plan_warnings(cfg_with(noise_multiplier=0.0)) == []  # no noise: the caveats say it
    at_limit = plan_warnings(cfg_with(noise_multiplier=4 * NOISE_PER_REPORT_LIMIT, report_goal=4))
    assert len(at_limit) == 1 and at_limit[0].startswith("noise drowns the updates")
    just_under = cfg_with(noise_multiplier=4 * NOISE_PER_REPORT_LIMIT * 0.99, report_goal=4)
    assert plan_warnings(just_under) == []


def test_below_unigram_is_at_or_below_the_baseline():
    cfg = cfg_with()
    assert result_warnings(cfg, *FINE) == []
    tie = result_warnings(cfg, {"accuracy": 0.073}, {"accuracy": 0.073}, FINE[2])
    assert len(tie) == 1 and tie[0].startswith("below the unigram baseline: held-out accuracy 0.0730")
    assert result_warnings(cfg, {"accuracy": 0.0731}, {"accuracy": 0.073}, FINE[2]) == []
    assert result_warnings(cfg, {"accuracy": math.nan}, {"accuracy": 0.073}, FINE[2]) == []


def test_epsilon_warning_uses_the_threshold_and_the_total_with_other_releases():
    over = result_warnings(cfg_with(), FINE[0], FINE[1], {"epsilon": 10.01, "delta": 1e-6})
    assert len(over) == 1
    assert over[0].startswith("eps above dp.warn_epsilon: eps = 10.01 at delta = 1e-06 > 10")
    assert result_warnings(cfg_with(), FINE[0], FINE[1], {"epsilon": 10.0, "delta": 1e-6}) == []
    assert result_warnings(cfg_with(warn_epsilon=0), FINE[0], FINE[1], {"epsilon": 66.0}) == []
    assert result_warnings(cfg_with(), FINE[0], FINE[1], {"epsilon": math.inf}) == []  # caveats' job
    vocabulary = {"epsilon": 9.0, "delta": 1e-6, "total_with_vocabulary": {"epsilon": 12.0}}
    (line,) = result_warnings(cfg_with(), FINE[0], FINE[1], vocabulary)
    assert "eps = 12.00 (with the DP vocabulary)" in line
    with pytest.raises(DpfleetError, match="dp.warn_epsilon must be >= 0"):
        validate(cfg_with(warn_epsilon=-1))


def test_budget_no_round_fits_is_an_error_and_one_that_fits_is_not():
    first = epsilon_from_zcdp(0.5, 1e-6)  # tree, z = 1, one round: sens^2 1, rho 1 / 2
    RunAccountant(1.0, 1e-6, budget_epsilon=first * 1.001).check_first_round()
    with pytest.raises(DpfleetError, match=r"dp.budget_epsilon = 0.5 stops the run before round 1: "
                                           r"one round already costs eps 4.89 at delta 1e-06"):
        RunAccountant(1.0, 1e-6, budget_epsilon=0.5).check_first_round()
    spent = zcdp_for_epsilon(first * 1.001, 1e-6) - 0.4  # the vocabulary leaves less than a round
    with pytest.raises(DpfleetError, match="with the DP vocabulary's share"):
        RunAccountant(1.0, 1e-6, budget_epsilon=first * 1.001, vocabulary={
            "noise": (0.5 / spent) ** 0.5, "zcdp": spent, "delta": 1e-7}).check_first_round()


def test_per_round_epsilon_is_the_reports_conversion_and_converted_once(monkeypatch):
    calls = []
    real = ledger.epsilon_from_zcdp
    monkeypatch.setattr(ledger, "epsilon_from_zcdp", lambda *a: calls.append(a) or real(*a))
    ledger.epsilon_of.cache_clear()
    acc = RunAccountant(1.37, 1e-6)  # a z no other test converts (the cache is per process)
    spent = [acc.record([f"d{r}"], False)["epsilon"] for r in range(6)]  # disjoint
    assert spent[-1] == acc.figures()["epsilon"] == epsilon_from_zcdp(acc.figures()["zcdp"], 1e-6, "pld")
    assert spent[-1] < epsilon_from_zcdp(acc.figures()["zcdp"], 1e-6, "rdp")  # PLD, not RDP
    pld_calls = [c for c in calls if c[2] == "pld"]
    assert len(pld_calls) == len(set(spent))  # one conversion per distinct rho, then the cache
    replay = acc.fresh()
    assert [replay.record([f"d{r}"], False)["epsilon"] for r in range(6)] == spent
    assert len([c for c in calls if c[2] == "pld"]) == len(pld_calls)  # a replay converts nothing
    rdp = RunAccountant(1.37, 1e-6, conversion="rdp")
    assert rdp.record(["d"], False)["epsilon"] == epsilon_from_zcdp(1 / (2 * 1.37 ** 2), 1e-6, "rdp")


def test_a_meaningless_run_says_so_in_the_cli_summary_json_and_result(tmp_path, monkeypatch, capsys):
    """z / M = 2 (noise drowns the updates, from the plan on), a 3-round tiny model (below the
    unigram), warn_epsilon below its eps: three lines, the same in all three places; the progress
    bar ends at privacy.json's eps."""
    results = []
    real_run = coordinator_run.run
    monkeypatch.setattr(coordinator_run, "run",
                        lambda *a, **k: results.append(real_run(*a, **k)) or results[-1])
    config = tmp_path / "meaningless.toml"
    config.write_text(to_toml({**TINY, "dp": {**TINY["dp"], "noise_multiplier": 8.0, "warn_epsilon": 0.1}}))
    main(["simulate", str(config), "--out", str(tmp_path / "run")])
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    eps = json.loads((tmp_path / "run" / "privacy.json").read_text())["epsilon"]
    assert re.findall(r"eps=([0-9.]+)", captured.err)[-1] == f"{eps:.2f}"  # the bar's is the report's
    (result,) = results
    assert [w.split(":")[0] for w in result.warnings] == [
        "noise drowns the updates", "below the unigram baseline", "eps above dp.warn_epsilon"]
    assert list(result.warnings) == summary["warnings"]
    assert [line[22:] for line in out if line.startswith("WARNING ")] == summary["warnings"]
    assert f"warning: {result.warnings[0]}" in out  # said at plan time, before any training
    assert out.index(f"warning: {result.warnings[0]}") < next(i for i, line in enumerate(out)
                                                               if line.startswith("finishing:"))


def test_budget_before_round_one_is_one_error_line_via_the_cli(tmp_path, capsys):
    config = tmp_path / "budget.toml"
    config.write_text(to_toml({**TINY, "dp": {**TINY["dp"], "noise_multiplier": 1.0, "budget_epsilon": 0.5}}))
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(config), "--out", str(tmp_path / "run"), "--quiet"])
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: dp.budget_epsilon = 0.5 stops the run before "
                                               "round 1: one round already costs eps 4.89"), err
    assert not (tmp_path / "run" / "summary.json").exists()


def test_serve_says_the_noise_warning_when_it_starts(tmp_path):
    from service_fleet import tiny_cfg

    from dpfleet.service.boot import boot

    cfg = tiny_cfg(rounds=1, dp={"noise_multiplier": 50.0})
    lines = []
    boot(cfg, tmp_path / "state", log=lines.append).store.close()
    (warning,) = [line for line in lines if line.startswith("warning:")]
    assert warning == f"warning: {plan_warnings(cfg)[0]}"
