"""Issue 12 item 8 (the fast subset): `dpfleet service serve` is killed with SIGKILL at
several points of a round (round just opened, commit files fsynced, inside the commit
transaction, right after the commit) and restarted on the same state while the devices keep
going: the run completes, no round is committed twice, no two releases share a noise position
on different sums, and the accounting equals a fresh account of the committed log. The kill
points come from the service's fault hook (`service/faults.py`, DPFLEET_SERVICE_FAULT)."""

import asyncio
import dataclasses
import json
import os
import socket
import sys

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from service_fleet import fleet_data, run_devices, tiny_cfg

from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant
from dpfleet.coordinator.state.release_log import check_no_reuse
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.coordinator.state.state_store import StateStore
from dpfleet.service.faults import ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve_once(config, state, port, fault, started: dict | None = None):
    """`dpfleet service serve` as a process until it exits: (return code, stderr); with
    `fault` its DPFLEET_SERVICE_FAULT; `started["pid"]` is its pid once it runs. A test that fails
    meanwhile (asyncio.run cancels this task) or a timeout kills the process: a failed test
    never leaves a coordinator running."""
    env = {**os.environ, ENV: fault} if fault else {k: v for k, v in os.environ.items() if k != ENV}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from dpfleet.cli import main; main()", "service", "serve",
        str(config), "--state", str(state), "--listen", f"127.0.0.1:{port}", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    if started is not None:
        started["pid"] = proc.pid
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 240)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, err.decode()


def kill_and_restart(tmp_path, faults, rounds, **sections):
    cfg = tiny_cfg(rounds=rounds, **{"service": {"checkin_retry_s": 0.2, "report_deadline_s": 20.0},
                                     **sections})
    cfg = dataclasses.replace(cfg, dp=dataclasses.replace(cfg.dp, noise_seed=-1))  # serve: secret noise
    config = tmp_path / "config.toml"
    config.write_text(to_toml(cfg.resolved()))
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    kw = {}
    if cfg.aggregation.kind == "secagg":
        from dpfleet.fleet.participant import local_policy

        kw = {"pinned": {u: k.public_key().public_bytes_raw() for u, k in keys.items()},
              "policy": lambda n: local_policy(cfg.dp.report_goal, cfg.aggregation.graph,
                                               cfg.aggregation.corruption, n)}

    async def main():
        stop = asyncio.Event()
        devices = asyncio.create_task(run_devices(url, keys, examples, stop=stop, **kw))
        codes = []
        try:
            for fault in [*faults, None]:
                code, err = await serve_once(config, tmp_path / "state", port, fault)
                codes.append(code)
                assert code in (0, -9), err[-2000:]
        finally:
            stop.set()
            await asyncio.wait_for(devices, 60)
        return codes

    return cfg, asyncio.run(main())


def check_run(cfg, state):
    store = StateStore(state, cfg.resolved())
    try:
        assert store.finished
        releases = store.releases()
        assert [r["round"] for r in releases] == list(range(1, cfg.rounds + 1))  # once each
        check_no_reuse(releases)
        committed = [r for (r,) in store.db.execute(
            "SELECT round FROM rounds WHERE status = 'committed' ORDER BY round")]
        assert committed == [r["round"] for r in releases]
        # the run's own conversion (PLD; RDP for the discrete Gaussian in a SecAgg ring), which its
        # metrics and privacy.json state
        method = json.loads((state / "privacy.json").read_text()).get("method", "pld")
        fresh = RunAccountant(cfg.dp.noise_multiplier, cfg.dp.delta, conversion=method)
        for r in releases:
            spent = fresh.record(r["participants"], r["restart"])
        metrics = store.log("metrics")
        assert [m["round"] for m in metrics] == [r["round"] for r in releases]
        assert metrics[-1]["epsilon"] == pytest.approx(spent["epsilon"], rel=1e-12)
        assert [set(m) for m in [store.participation()[r["round"]] for r in releases]] == \
               [set(r["participants"]) for r in releases]
    finally:
        store.close()
    privacy = json.loads((state / "privacy.json").read_text())
    assert privacy["rounds"] == cfg.rounds
    participation = [json.loads(x) for x in (state / "participation.jsonl").read_text().splitlines()]
    assert [p["devices"] for p in participation] == [r["participants"] for r in releases]
    log = [json.loads(x) for x in (state / "service.log").read_text().splitlines()]
    logged = [e["round"] for e in log if e["event"] == "commit"]  # the log trails the database
    assert len(logged) == len(set(logged)) and set(logged) <= {r["round"] for r in releases}


@pytest.mark.slow  # ~20 s: two killed coordinators and a restart (the default suite keeps
# test_kill_each_commit_point's after_commit)
def test_kill_9_at_open_and_mid_commit_then_the_run_completes(tmp_path):
    faults = ["opened:1", "device_counters:1"]
    cfg, codes = kill_and_restart(tmp_path, faults, rounds=2)
    assert codes == [-9, -9, 0]
    check_run(cfg, tmp_path / "state")


@pytest.mark.slow
def test_kill_9_at_four_points_then_the_run_completes(tmp_path):
    faults = ["opened:2", "files_fsynced:1", "device_counters:2", "after_commit:1"]
    cfg, codes = kill_and_restart(tmp_path, faults, rounds=5)
    assert codes == [-9] * len(faults) + [0]
    check_run(cfg, tmp_path / "state")


@pytest.mark.slow
def test_kill_9_in_secagg_phases_then_the_run_completes(tmp_path):
    faults = ["secagg_keys:1", "secagg_masked:1", "before_commit:1"]
    cfg, codes = kill_and_restart(
        tmp_path, faults, rounds=2, aggregation={"kind": "secagg", "signed": True},
        service={"checkin_retry_s": 0.2, "report_deadline_s": 20.0, "secagg_phase_deadline_s": 10.0})
    assert codes == [-9] * len(faults) + [0]
    check_run(cfg, tmp_path / "state")
