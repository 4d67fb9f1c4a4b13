"""What the admin and the public see: the privacy report from the service's own committed log,
the public status (released aggregates and counts only: never a device's id or data) that the
status page (`status_page.py`) renders."""

from __future__ import annotations

from dpfleet.coordinator.accounting.privacy_report import render_privacy_report
from dpfleet.coordinator.engine.field_metrics import last_evaluated, tff_figures
from dpfleet.service.rounds import ApiError, HttpCollector


def privacy_report(driver: HttpCollector) -> str:
    """privacy_report.md: the finished run's, or one accounted now from the committed rounds
    (the store's release rows, never the engine's memory), rendered in memory."""
    final = driver.store.path / "privacy_report.md"
    if driver.run_state == "finished" and final.is_file():
        return final.read_text()
    if driver.current is not None and driver.current.state == "closing":
        raise ApiError(503, "committing", "a round is being committed; ask again in a moment",
                       {"Retry-After": "1"})
    return render_privacy_report(driver.engine.privacy(committed=driver.store.releases()))


def public_status(driver: HttpCollector) -> dict:
    """The status page's data; `caveats` first: a run that is not fully private says so (caveats.py)."""
    from dpfleet.coordinator.run_privacy.caveats import caveat_fields, config_facts

    status = driver.status()
    history = driver.history_json()
    return {
        **caveat_fields(config_facts(driver.cfg)),
        "run_state": status["run_state"], "round": status["round"], "phase": status["phase"],
        "rounds_committed": status["rounds_committed"], "rounds_failed": status["rounds_failed"],
        "rounds_planned": status["rounds_planned"], "epsilon": status["epsilon"],
        "delta": status["delta"], "last_accuracy": status["last_accuracy"],
        # round 0 (the starting model, no privacy cost) and the unigram baseline: what the rounds add
        "initial_accuracy": (driver.engine.initial or {}).get("accuracy"),
        "unigram_accuracy": driver.b.baseline.get("accuracy"),
        # the finished model's suggestion strip and the most-frequent-word strip's (held-out words)
        **keyboard_status((driver.outcome or {}).get("keyboard")),
        # TFF's three next-word accuracies of the last evaluated released model, and the unigram
        # and most-frequent-word baselines' (fitted on held-out users at boot)
        "tff": tff_figures(last_evaluated(driver.engine.metrics), driver.b.baseline),
        "devices": status["devices"],
        "rounds": [{k: h[k] for k in ("round", "status", "clients", "epsilon", "accuracy")}
                   for h in history["rounds"]],
        "participation_histogram": history["participation_histogram"],
        "device_states": history["device_states"], "phase_seconds": status["phase_seconds"],
        "uptime_s": status["uptime_s"],
        "release": status["release"],  # serve --policy: released, or refused and why (one line)
    }


def keyboard_status(block: dict | None) -> dict:
    """The status page's keyboard figures of a finished run (None before the finish, and for a
    run whose tokenizer gives no strip): top-3 word recall and keystroke savings of the model's
    strip and of the most-frequent-word strip."""
    block = block or {}
    model, base = block.get("model") or {}, block.get("most_frequent_words") or {}
    return {"top3_recall": model.get("top3_recall"), "keystroke_savings": model.get("keystroke_savings"),
            "baseline_top3_recall": base.get("top3_recall"),
            "baseline_keystroke_savings": base.get("keystroke_savings")}
