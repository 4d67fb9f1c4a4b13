"""`fleet emulate --backend ray`: the fleet's workers on Ray actors (a local Ray, 2 CPUs) against
a real coordinator service on 127.0.0.1; a SIGKILLed actor is restarted with its devices and the
run still finishes and accounts; `fleet run --backend ray` end to end as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import run_here
from service_fleet import tiny_cfg
from test_cli_errors import assert_clean_error
from test_fleet_cli import tiny_toml
from test_fleet_emulate import ServerThread, check_committed_log

from dpfleet.errors import DpfleetError
from dpfleet.fleet.emulate import fleet_keys, load_devices
from dpfleet.secagg.registry import public_registry


def test_address_without_ray_backend_is_one_clean_line(tmp_path):
    proc = run_here("fleet", "emulate", str(tiny_toml(tmp_path)), "--coordinator",  # in process: the
                    "http://127.0.0.1:9", "--address", "10.0.0.1:6379")  # same line, no torch import
    assert_clean_error(proc, "--address is a Ray cluster's address")


def fleet_parts(cfg, tmp_path):
    ids, examples, params = load_devices(cfg)
    keys = fleet_keys(tmp_path / "keys.json", len(ids))
    return ids, examples, keys, public_registry(keys, ids), params


@pytest.mark.slow  # ~60 s: Ray actors import torch, and the killed round waits its deadline
def test_ray_fleet_finishes_a_service_run_and_restarts_a_killed_actor(ray_local, tmp_path):
    from dpfleet.edge.wire.admin_client import AdminClient, AdminTarget
    from dpfleet.fleet.ray_workers import ActorWorker, RayFleet

    cfg = tiny_cfg(rounds=3, devices={"latency_ms": 1000.0, "link_sigma": 0.0},
                   service={"overselect": 1.0, "report_deadline_s": 5.0})
    ids, examples, keys, registry, params = fleet_parts(cfg, tmp_path)
    server = ServerThread(cfg, tmp_path / "state", registry)
    notes: list[str] = []
    fleet = RayFleet(cfg, server.admin["url"], ids, examples, keys, registry, processes=2, seed=4,
                     model_bytes=4 * params, start_hour=0.0, log=notes.append)
    admin = AdminClient(AdminTarget(server.admin["url"], server.admin["token"]))
    fleet.start()
    try:
        assert all(isinstance(p, ActorWorker) for p in fleet.procs.values())
        pids = {p.pid for p in fleet.procs.values()}
        assert os.getpid() not in pids and len(pids) == 2  # two actor processes, not this one
        killed_in = None
        deadline = time.monotonic() + 180
        while killed_in is None and time.monotonic() < deadline:
            fleet.poll(0.2)
            status = admin.status()
            if status["phase"] == "training" and status["devices"]["training"]:
                os.kill(fleet.procs[0].pid, signal.SIGKILL)
                killed_in = status["round"]
        assert killed_in is not None, "no round was seen in training"
        while not fleet.done and time.monotonic() < deadline + 180:
            fleet.poll(0.5)
        assert fleet.done
        assert server.finished(30)
    finally:
        fleet.stop()
        status = server.close()
    summary = fleet.summary(0.0)
    assert summary["restarts"] == 1 and any("died with exit code -1" in n for n in notes)
    assert fleet.procs[0].pid not in pids  # the restarted worker is a new actor process
    assert summary["placement"]["backend"] == "ray" and summary["placement"]["hosts"]
    assert status["run_state"] == "finished" and status["rounds_committed"] == cfg.rounds
    check_committed_log(tmp_path / "state", cfg)
    assert summary["counts"]["done"] == len(ids) and summary["counts"]["registered"] >= len(ids)
    assert any(r > killed_in for _, r, *_ in summary["outcomes"])  # rounds ran after the kill
    reported = {d for d, _, _, kind, *_ in summary["outcomes"] if kind == "reported"}
    assert reported <= set(ids) and len(reported) >= cfg.dp.report_goal


@pytest.mark.slow
def test_a_cluster_without_a_free_cpu_is_a_clear_error(ray_local, tmp_path):
    from dpfleet.fleet.ray_workers import RayFleet

    cfg = tiny_cfg(rounds=1)
    ids, examples, keys, registry, params = fleet_parts(cfg, tmp_path)
    fleet = RayFleet(cfg, "http://127.0.0.1:9", ids, examples, keys, registry, processes=3,
                     seed=4, model_bytes=4 * params, start_hour=0.0, log=lambda s: None,
                     place_timeout=15.0)
    try:
        with pytest.raises(DpfleetError, match="needs one free CPU per --processes"):
            fleet.start()  # 2 CPUs, 3 workers: the third is never placed
    finally:
        fleet.stop()


@pytest.mark.slow  # ~90 s: a coordinator subprocess, and a fleet subprocess starting its own Ray
def test_fleet_run_with_the_ray_backend_end_to_end(tmp_path):
    pytest.importorskip("ray")
    state = tmp_path / "state"
    proc = subprocess.run(
        [sys.executable, "-m", "dpfleet", "fleet", "run", str(tiny_toml(tmp_path, rounds=2)),
         "--state", str(state), "--processes", "2", "--backend", "ray"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    fleet_log = (tmp_path / "state_fleet" / "emulate.log").read_text()
    assert proc.returncode == 0, proc.stderr[-2000:] + fleet_log[-2000:]
    assert "finished: 2 of 2 rounds committed" in proc.stdout
    assert "2 Ray actors" in fleet_log and fleet_log.count("Ray actor on") == 2
    summary = json.loads((tmp_path / "state_fleet" / "summary.json").read_text())
    assert summary["placement"]["backend"] == "ray" and summary["restarts"] == 0
    assert len([x for x in (state / "participation.jsonl").read_text().splitlines() if x]) == 2


def test_a_generated_population_is_refused_by_the_fleet(tmp_path):
    cfg = tiny_cfg(data={"generated_population": 1000})
    with pytest.raises(DpfleetError, match="emulates the real clients only"):
        load_devices(cfg)
