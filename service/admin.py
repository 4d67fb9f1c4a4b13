"""What the admin and the public see: the privacy report from the service's own committed log,
the public status (released aggregates and counts only: never a device's id or data) that the
status page (`status_page.py`) renders."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from dpfleet.coordinator.accounting.run_accountant import write_run_privacy
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
    """The status page's data; `caveats` first: a run that is not fully private says so (caveats.py)."""
    from dpfleet.coordinator.accounting.caveats import caveat_fields, config_facts

    status = driver.status()
    history = driver.history_json()
    return {
        **caveat_fields(config_facts(driver.cfg)),
        "run_state": status["run_state"], "round": status["round"], "phase": status["phase"],
        "rounds_committed": status["rounds_committed"], "rounds_failed": status["rounds_failed"],
        "rounds_planned": status["rounds_planned"], "epsilon": status["epsilon"],
        "delta": status["delta"], "last_accuracy": status["last_accuracy"],
        "devices": status["devices"],
        "rounds": [{k: h[k] for k in ("round", "status", "clients", "epsilon", "accuracy")}
                   for h in history["rounds"]],
        "participation_histogram": history["participation_histogram"],
        "device_states": history["device_states"], "phase_seconds": status["phase_seconds"],
        "uptime_s": status["uptime_s"],
    }

