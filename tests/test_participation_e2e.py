"""The round engine with device timers, the coordinator's refusal, adaptive clipping, the privacy
report and the budget stop, on tiny real Shakespeare runs."""

import json

import pytest

from dpfleet.cli import main
from dpfleet.coordinator.accounting.ledger import account_participation_log
from dpfleet.coordinator.accounting.zcdp import model_noise_multiplier, observe_participation
from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.state.run_dir import to_toml

TINY = {
    "rounds": 12,
    "eval_every": 12,
    "seed": 5,
    "data": {"dataset": "shakespeare", "max_clients": 12, "eval_examples": 200, "max_examples": 16},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 16, "hidden_dim": 32, "projection_dim": 16},
    "client": {"lr": 1.0, "batch_size": 16},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 4, "momentum": 0.5},
}
# 12 devices, 4 per round, a 30-minute timer at 10-minute rounds (nominal MinS 2 = the most 12
# devices allow), devices available 60% of the time: rounds wait, and the coordinator refuses
# devices whose timer expired during a wait but that took part fewer than 3 rounds ago.
TIMER = {**TINY, "participation": {"mode": "timer", "timer_period": 0.5, "round_minutes": 10.0},
         "devices": {"availability": 0.6, "diurnal_amplitude": 0.3},
         "dp": {**TINY["dp"], "adaptive_clipping": True, "clip_count_stddev": 1.0,
                "restart_rounds": [4, 8]}}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def timer_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("timer") / "run"
    return run_simulation(parse_config(TIMER), out, progress=False, log=lambda s: None)


def test_timer_run_enforces_min_separation_and_waits(timer_run):
    log = read_jsonl(timer_run.run_dir / "participation.jsonl")
    obs = observe_participation(log)
    assert obs.rounds == 12 and obs.min_separation == 2 and obs.max_participation == 4
    metrics = timer_run.metrics
    assert sum(m["waited_hours"] for m in metrics) > 0 and sum(m["refused"] for m in metrics) > 0
    clock = [m["clock_hours"] for m in metrics]
    assert clock == sorted(clock) and clock[-1] >= 11 * 10 / 60
    summary = json.loads((timer_run.run_dir / "summary.json").read_text())
    assert summary["simulated_hours"] > clock[-1] and summary["stopped_early"] is None


def test_restart_rounds_in_the_log_and_clip_adopted_only_there(timer_run):
    log = read_jsonl(timer_run.run_dir / "participation.jsonl")
    assert [rec["round"] for rec in log if rec["restart"]] == [4, 8]
    m = timer_run.metrics
    assert [r for r in range(1, 12) if m[r]["clip"] != m[r - 1]["clip"]] == [4, 8]
    assert m[4]["clip"] == m[3]["clip_estimate"] and m[8]["clip"] == m[7]["clip_estimate"]
    assert m[0]["clip"] == 0.5
    state = json.loads((timer_run.run_dir / "checkpoint" / "server_state.json").read_text())
    assert state["clip_estimator"]["estimate"] == m[-1]["clip_estimate"]


def test_adaptive_run_is_accounted_with_z_and_noised_with_z_delta(timer_run):
    z_delta = model_noise_multiplier(1.0, 1.0)
    privacy = timer_run.privacy
    assert privacy["noise_multiplier"] == 1.0 and privacy["model_noise_multiplier"] == z_delta
    for rec in timer_run.metrics:
        assert rec["noise_std"] == pytest.approx(z_delta * rec["clip"], rel=1e-6)
    ref = account_participation_log(timer_run.run_dir / "participation.jsonl", 1.0, 1e-6)
    assert privacy["zcdp"] == ref["zcdp"] == ref["sensitivity_squared"] / 2  # S / (2 z^2)
    assert privacy["epsilon"] == ref["epsilon"]  # PLD
    # the last round's eps is the report's own (PLD), not the looser RDP figure (issue 33)
    assert timer_run.metrics[-1]["epsilon"] == privacy["epsilon"] < privacy["epsilon_rdp"]


def test_privacy_report_has_the_observed_and_timer_numbers(timer_run):
    text = (timer_run.run_dir / "privacy_report.md").read_text()
    p = timer_run.privacy
    assert f"rho = {p['zcdp']:.4g}" in text and f"eps = {p['epsilon']:.4g}" in text
    worst = p["timer_worst_case"]
    assert (worst["min_separation"], worst["max_participation"]) == (2, 4)
    assert "| MinS | 2 | 2 |" in text and "| MaxP | 4 | 4 |" in text
    assert "| restarts (fresh noise segments) | 4, 8 | 4, 8 |" in text
    assert "0.5 h = 3 rounds of 10 min: nominal MinS 2; enforced MinS 2" in text
    assert "| adaptive clipping | yes" in text


def test_budget_stops_before_the_round_that_would_pass_it(tmp_path, capsys):
    # disjoint, z = 1: eps (PLD, delta 1e-6) is 4.89 after 1 round, 7.29 after 2 and 3, and 9.2
    # after 4 (a new tree level), so a budget of 7.5 stops before round 4
    values = {**TINY, "rounds": 8, "data": {**TINY["data"], "max_clients": 40},
              "dp": {**TINY["dp"], "report_goal": 5, "budget_epsilon": 7.5}}
    config = tmp_path / "budget.toml"
    config.write_text(to_toml(values))
    main(["simulate", str(config), "--out", str(tmp_path / "run"), "--quiet"])
    out = capsys.readouterr().out
    assert "stopped early         stopped before round 4: it would pass the privacy budget" in out
    assert "eps = 7.29 at delta = 1e-06 (PLD" in out
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_completed"] == 3 and "privacy budget" in summary["stopped_early"]
    assert len(read_jsonl(run / "participation.jsonl")) == 3
    privacy = json.loads((run / "privacy.json").read_text())
    assert privacy["epsilon"] <= 7.5 < 9.0 and privacy["stopped_early"] == summary["stopped_early"]
    assert "eps = 7.286" in (run / "privacy_report.md").read_text()


def test_no_noise_and_an_exhausted_population_stop_cleanly(tmp_path):
    # z = 0 (eps = inf, no crash); every device may take part once: 12 devices fill 3 rounds
    values = {**TINY, "rounds": 5, "dp": {**TINY["dp"], "noise_multiplier": 0.0},
              "participation": {"mode": "uniform", "max_participation": 1}}
    result = run_simulation(parse_config(values), tmp_path / "run", progress=False, log=lambda s: None)
    assert len(result.metrics) == 3 and "only 0 devices may take part in round 3" in result.stopped_early
    assert result.privacy["epsilon"] == float("inf") and result.metrics[-1]["epsilon"] == float("inf")
    assert "not differentially private" in (result.run_dir / "privacy_report.md").read_text()
