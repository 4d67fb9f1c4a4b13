"""Regression, found by benchmarks/fleet_faults.py: `coordinator serve` killed with SIGKILL right
after a round's release transaction committed (store fault point "committed") but before the
round's metrics row was written. The restart must boot (it crashed with KeyError 'epsilon' on
the metrics stub of that round, so the run could never continue) and finish the run with the
round released once and the accounting equal to a fresh account of the committed log."""

import json

import pytest
from test_service_kill import kill_and_restart

from dpfleet.coordinator.accounting import account_participation_log
from dpfleet.coordinator.release_log import check_no_reuse
from dpfleet.coordinator.state_store import StateStore


def test_kill_9_between_release_and_metrics_row_then_the_run_completes(tmp_path):
    cfg, codes = kill_and_restart(tmp_path, ["committed:1"], rounds=2)
    assert codes == [-9, 0]
    store = StateStore(tmp_path / "state", cfg.resolved())
    try:
        assert store.finished
        releases = store.releases()
        metrics_rounds = [m["round"] for m in store.log("metrics")]
    finally:
        store.close()
    assert [r["round"] for r in releases] == [1, 2]
    check_no_reuse(releases)
    assert metrics_rounds == [2]  # round 1's row was cut off by the kill; its release was not
    log = [{"round": r["round"] - 1, "devices": r["participants"], "restart": r["restart"]}
           for r in releases]
    fresh = account_participation_log(log, cfg.dp.noise_multiplier, cfg.dp.delta)
    privacy = json.loads((tmp_path / "state" / "privacy.json").read_text())
    assert privacy["epsilon"] == pytest.approx(fresh["epsilon"], rel=1e-12)
