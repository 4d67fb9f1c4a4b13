"""What the admin and the public see: the privacy report from the service's own committed log,
the public status (released aggregates and counts only: never a device's id or data) and a
minimal read-only status page (the ops branch renders the full one from the same JSON)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from dpfleet.coordinator.run_accounting import write_run_privacy
from dpfleet.service.rounds import ApiError, RoundDriver


def privacy_report(driver: RoundDriver) -> str:
    """privacy_report.md: the finished run's, or one accounted now from the committed rounds
    (participation exported from the store's release rows, never from memory)."""
    final = driver.store.path / "privacy_report.md"
    if driver.run_state == "finished" and final.is_file():
        return final.read_text()
    if driver.current is not None and driver.current.state == "closing":
        raise ApiError(503, "committing", "a round is being committed; ask again in a moment",
                       {"Retry-After": "1"})
    eng = driver.engine
    exported = driver.store.export_participation()
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(exported, Path(tmp) / "participation.jsonl")
        write_run_privacy(Path(tmp), driver.cfg, eng.participation, eng.accountant,
                          len(driver.b.users), model_noise_multiplier=eng.z_model,
                          stopped_early=None, vocabulary=eng.vocabulary)
        return (Path(tmp) / "privacy_report.md").read_text()


def public_status(driver: RoundDriver) -> dict:
    status = driver.status()
    history = driver.history_json()
    return {
        "run_state": status["run_state"], "round": status["round"], "phase": status["phase"],
        "rounds_committed": status["rounds_committed"], "rounds_failed": status["rounds_failed"],
        "rounds_planned": status["rounds_planned"], "epsilon": status["epsilon"],
        "delta": status["delta"], "last_accuracy": status["last_accuracy"],
        "devices": status["devices"],
        "rounds": [{k: h[k] for k in ("round", "status", "clients", "epsilon", "accuracy")}
                   for h in history["rounds"]],
        "participation_histogram": history["participation_histogram"],
    }


STATUS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>dpfleet coordinator</title></head>
<body><h1>dpfleet coordinator</h1><pre id="s">loading...</pre>
<script>
fetch('/v1/public/status').then(r => r.json()).then(j => {
  document.getElementById('s').textContent = JSON.stringify(j, null, 2); });
</script></body></html>
"""
