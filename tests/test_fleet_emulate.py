"""The emulated fleet against a real coordinator service on 127.0.0.1 (fleet/worker.py, emulate.py).

Real sockets, real signatures, real training; the fast variant runs one worker's event loop in
this process next to the server, the `fleet run` test runs both programs as subprocesses."""

from __future__ import annotations

import asyncio
import json
import queue
import time

import pytest
from service_fleet import tiny_cfg

from dpfleet.coordinator.accounting.ledger import account_participation_log
from dpfleet.edge.devices import Behaviour, DevicesSection
from dpfleet.fleet.clock import FleetClock
from dpfleet.fleet.emulate import fleet_keys, load_devices
from dpfleet.fleet.participant import DropOut
from dpfleet.fleet.worker import DeviceSpec, Hooks, WorkerSpec, _run
from dpfleet.secagg.registry import public_registry


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def check_committed_log(state, cfg, outcomes=None):
    """Each committed round once, at least the report goal, accounted as a fresh account of the
    log says; with the devices' own outcomes: exactly the devices that reported in the round's
    committed attempt, none of those that dropped, and no update lost."""
    log = lines(state / "participation.jsonl")
    assert [e["round"] for e in log] == list(range(cfg.rounds))
    assert all(len(e["devices"]) >= cfg.dp.report_goal for e in log)
    fresh = account_participation_log(state / "participation.jsonl", cfg.dp.noise_multiplier,
                                      cfg.dp.delta,  # secagg's ring noise converts by RDP
                                      "rdp" if cfg.dp.noise == "discrete" else "pld")
    privacy = json.loads((state / "privacy.json").read_text())
    assert privacy["epsilon"] == pytest.approx(fresh["epsilon"], rel=1e-9)
    if outcomes is None:
        return log
    for entry in log:
        number = entry["round"] + 1
        reported = {(d, a) for d, r, a, kind, *_ in outcomes if r == number and kind == "reported"}
        attempts = {a for d, a in reported if d in entry["devices"]}
        assert len(attempts) == 1  # one attempt committed
        (attempt,) = attempts
        sent = {d for d, a in reported if a == attempt}
        dropped = {d for d, r, a, kind, *_ in outcomes if (r, a, kind) == (number, attempt, "dropped")}
        assert set(entry["devices"]) == sent  # updates lost: 0, and nobody added
        assert not dropped & set(entry["devices"])
    return log


def test_hooks_drop_and_delay_by_the_devices_behaviour():
    clock = FleetClock(1e6, origin=time.time())
    always = Behaviour(DevicesSection(dropout_train=1.0), 0, 0)
    never = Behaviour(DevicesSection(latency_ms=1000.0, link_sigma=0.0), 0, 0)

    async def go():
        with pytest.raises(DropOut, match="train"):
            await Hooks(always, clock, 4000, {"round": 1, "attempt": 0})("train")
        began = clock.now()
        for phase in ("train", "report", "commit", "mask"):
            await Hooks(never, clock, 4000, {"round": 1, "attempt": 0})(phase)
        return clock.now() - began

    elapsed = asyncio.run(go())
    assert elapsed >= 6 * 1.0  # six transfers of >= 1 s simulated latency each (two downloads)


def run_one_worker(cfg, tmp_path, seed=3):
    """One fleet worker's event loop in this process next to a real service; (status, counts,
    outcomes)."""
    ids, examples, params = load_devices(cfg)
    keys = fleet_keys(tmp_path / "keys.json", len(ids))
    registry = public_registry(keys, ids)
    events = queue.Queue()

    async def main():
        from dpfleet.service.server import shutdown, start

        running = await start(cfg, tmp_path / "state", log=lambda s: None, registry=registry)
        spec = WorkerSpec(0, cfg, running.url, [
            DeviceSpec(i, ids[i], examples[i], keys[i].private_bytes_raw()) for i in range(len(ids))],
            pinned=registry, seed=seed, origin=time.time(), start_hour=0.0, time_scale=1.0,
            timer_period_s=0.0, model_bytes=4 * params)
        worker = asyncio.create_task(_run(spec, events))
        await asyncio.wait_for(asyncio.shield(running.task), 150)
        await asyncio.wait_for(worker, 30)
        status = running.driver.status()
        await shutdown(running)
        return status

    status = asyncio.run(main())
    messages = []
    while not events.empty():
        messages.append(events.get())
    final = [m for m in messages if m[0] == "final"]
    assert len(final) == 1
    return status, final[0][2], final[0][5], ids


def test_a_fleet_worker_with_dropouts_runs_a_service_run_to_the_end(tmp_path):
    cfg = tiny_cfg(rounds=3, devices={"dropout_train": 0.3, "dropout_report": 0.1, "latency_ms": 2.0},
                   service={"overselect": 1.0, "report_deadline_s": 6.0})
    status, counts, outcomes, ids = run_one_worker(cfg, tmp_path)
    assert status["rounds_committed"] == cfg.rounds and status["run_state"] == "finished"
    assert counts["registered"] == len(ids) and counts["done"] == len(ids)
    # an assignment still running when the run finished has no outcome (its task was ended)
    assert len(ids) + len(outcomes) >= counts["assigned"] >= len(outcomes) >= cfg.rounds * cfg.dp.report_goal
    kinds = [o[3] for o in outcomes]
    assert kinds.count("reported") >= cfg.rounds * cfg.dp.report_goal
    assert counts.get("dropped", 0) == kinds.count("dropped")
    check_committed_log(tmp_path / "state", cfg, outcomes)


def test_signed_secagg_rounds_reach_every_selected_device(tmp_path):
    """Over-selected devices that were not waiting in a held check-in when the round opened get
    their SecAgg assignment at their next check-in (the service once answered them "round full",
    and SecAgg rounds failed for want of commitments)."""
    cfg = tiny_cfg(rounds=3, aggregation={"kind": "secagg", "signed": True},
                   devices={"latency_ms": 2.0},
                   # devices spend longer asleep between check-ins (1.5 s) than held in one (1.2 s)
                   service={"overselect": 1.0, "secagg_phase_deadline_s": 6.0,
                            "checkin_retry_s": 1.5, "checkin_window_s": 0.2})
    status, counts, outcomes, ids = run_one_worker(cfg, tmp_path)
    assert status["rounds_committed"] == cfg.rounds and status["rounds_failed"] == 0
    assert counts["assigned"] >= len(outcomes) and counts.get("secagg_done", 0) >= 3 * 3
    assert not [o for o in outcomes if o[3] not in ("secagg_done", "stale")]
    check_committed_log(tmp_path / "state", cfg)


class ServerThread:
    """A real coordinator service on 127.0.0.1 in its own thread and event loop (the test's main
    thread runs the fleet's parent loop, which blocks)."""

    def __init__(self, cfg, state, registry):
        import concurrent.futures
        import threading

        from dpfleet.service.server import shutdown, start

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._shutdown = shutdown
        self.running = asyncio.run_coroutine_threadsafe(
            start(cfg, state, log=lambda s: None, registry=registry), self.loop).result(120)
        self.admin = {"url": self.running.url, "token": self.running.token}
        self._futures = concurrent.futures

    def finished(self, timeout: float) -> bool:
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(asyncio.shield(self.running.task), timeout), self.loop)
        try:
            fut.result(timeout + 5)
            return True
        except (TimeoutError, self._futures.TimeoutError):
            return False

    def close(self) -> dict:
        async def stop():
            status = self.running.driver.status()
            await self._shutdown(self.running)
            return status

        status = asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        return status


@pytest.mark.slow  # ~40 s: spawned workers import torch, and the killed round waits its deadline
def test_sigkill_of_a_worker_mid_round_the_run_still_finishes_and_accounts(tmp_path):
    import os
    import signal

    from dpfleet.edge.wire.admin_client import AdminClient, AdminTarget
    from dpfleet.fleet.emulate import Fleet

    # transfers of 1 s each keep the assigned devices busy long enough to be killed mid-round
    cfg = tiny_cfg(rounds=3, devices={"latency_ms": 1000.0, "link_sigma": 0.0},
                   service={"overselect": 1.0, "report_deadline_s": 5.0})
    ids, examples, params = load_devices(cfg)
    keys = fleet_keys(tmp_path / "keys.json", len(ids))
    registry = public_registry(keys, ids)
    server = ServerThread(cfg, tmp_path / "state", registry)
    notes: list[str] = []
    fleet = Fleet(cfg, server.admin["url"], ids, examples, keys, registry, processes=2, seed=4,
                  model_bytes=4 * params, start_hour=0.0, log=notes.append)
    admin = AdminClient(AdminTarget(server.admin["url"], server.admin["token"]))
    fleet.start()
    try:
        killed_in = None
        deadline = time.monotonic() + 120
        while killed_in is None and time.monotonic() < deadline:
            fleet.poll(0.2)
            status = admin.status()
            if status["phase"] == "training" and status["devices"]["training"]:
                victim = fleet.procs[0]
                os.kill(victim.pid, signal.SIGKILL)
                killed_in = status["round"]
        assert killed_in is not None, "no round was seen in training"
        while not fleet.done and time.monotonic() < deadline + 120:
            fleet.poll(0.5)
        assert fleet.done
        assert server.finished(30)
    finally:
        fleet.stop()
        status = server.close()
    summary = fleet.summary(0.0)
    assert summary["restarts"] == 1 and any("died with exit code -9" in n for n in notes)
    assert status["run_state"] == "finished" and status["rounds_committed"] == cfg.rounds
    check_committed_log(tmp_path / "state", cfg)
    # the killed worker's devices came back (restarted with their timers) and saw the run's end
    assert summary["counts"]["done"] == len(ids)
    assert any(r > killed_in for _, r, *_ in summary["outcomes"])  # rounds ran after the kill


def test_fleet_workers_replay_the_participation_trace(tmp_path):
    # the key simulate reads: only the first 3 devices' trace lines (the report goal) are ever
    # available, so only they check in, and every round commits exactly them
    ids, _, _ = load_devices(tiny_cfg())
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in [
        {"format": "dpfleet-trace", "version": 1, "duration": 10_000_000},
        *({"id": f"d{i}", "intervals": [[0, 10_000_000]] if i < 3 else []} for i in range(len(ids)))]))
    cfg = tiny_cfg(rounds=2, participation={"mode": "timer", "timer_period": 0.0},
                   devices={"trace": str(trace)})
    status, counts, outcomes, ids = run_one_worker(cfg, tmp_path)
    assert status["rounds_committed"] == cfg.rounds
    assert {o[0] for o in outcomes} == set(ids[:3])
    log = check_committed_log(tmp_path / "state", cfg, outcomes)
    assert [sorted(e["devices"]) for e in log] == [sorted(ids[:3])] * cfg.rounds
