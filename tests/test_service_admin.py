"""The admin JSON endpoints exactly as PROTOCOL.md lists them (the ops branch renders them):
status fields, pause (no round opens, devices are told "paused") / resume, stop (an open round
fails cleanly, a restart on the same state continues to the end), the privacy report from the
committed log mid-run and at the end, and the public status (no device ids). Also the CLI's
one-line errors for a bad --listen and a finished state."""

import asyncio
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from service_fleet import fleet_data, run_devices, tiny_cfg
from test_service_security import raw

from dpfleet.cli import main
from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.service.server import shutdown, start

STATUS_KEYS = {"run_state", "round", "phase", "rounds_committed", "rounds_failed", "rounds_planned",
               "epsilon", "delta", "last_accuracy", "devices", "phase_seconds", "started_at",
               "uptime_s", "release"}


async def wait_for(predicate, timeout=60.0, poll=0.05):
    for _ in range(int(timeout / poll)):
        if predicate():
            return
        await asyncio.sleep(poll)
    raise TimeoutError


def test_pause_resume_report_and_status(tmp_path):
    cfg = tiny_cfg(rounds=3)
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        running = await start(cfg, tmp_path / "state", log=lambda s: None)
        url, driver = running.url, running.driver
        admin = {"Authorization": f"Bearer {running.token}"}

        async def call(method, path):
            status, body, _ = await raw(url, method, path, headers=admin)
            assert status == 200, body
            return body

        devices = asyncio.create_task(run_devices(url, keys, examples))
        await wait_for(lambda: driver.store.last_committed() >= 1)
        paused = json.loads(await call("POST", "/v1/admin/pause"))
        await wait_for(lambda: driver.current is None)  # the open round finishes
        committed = driver.store.last_committed()
        await asyncio.sleep(1.5)
        still = driver.store.last_committed()
        mid_report = (await call("GET", "/v1/admin/report")).decode()
        resumed = json.loads(await call("POST", "/v1/admin/resume"))
        await asyncio.wait_for(asyncio.shield(running.task), 120)
        status = json.loads(await call("GET", "/v1/admin/status"))
        history = json.loads(await call("GET", "/v1/admin/history"))
        report = (await call("GET", "/v1/admin/report")).decode()
        public = json.loads((await raw(url, "GET", "/v1/public/status"))[1])
        page = (await raw(url, "GET", "/"))[1].decode()
        await asyncio.wait_for(devices, 30)
        await shutdown(running)
        return paused, committed, still, mid_report, resumed, status, history, report, public, page

    paused, committed, still, mid_report, resumed, status, history, report, public, page = \
        asyncio.run(main())
    assert set(paused) == STATUS_KEYS and paused["run_state"] == "paused"
    assert still == committed  # nothing opened while paused
    assert "Privacy report" in mid_report
    assert resumed["run_state"] == "running"
    assert status["run_state"] == "finished" and status["rounds_committed"] == 3
    assert status["epsilon"] > 0 and status["rounds_planned"] == 3
    assert set(status["devices"]) == {"registered", "waiting", "training", "refused_timer"}
    assert [h["round"] for h in history["rounds"]] == [1, 2, 3]
    assert sum(history["participation_histogram"].get(k, 0) * int(k)
               for k in history["participation_histogram"]) == 9  # 3 rounds x 3 devices
    assert report == (tmp_path / "state" / "privacy_report.md").read_text()
    assert not any(u in json.dumps(public) or u in page for u in users)
    assert public["rounds_committed"] == 3


def test_stop_fails_the_open_round_and_a_restart_continues(tmp_path):
    cfg = tiny_cfg(rounds=6)  # rounds follow each other fast: leave time to catch one open
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}

    async def main():
        running = await start(cfg, tmp_path / "state", log=lambda s: None)
        driver = running.driver
        stop = asyncio.Event()
        devices = asyncio.create_task(run_devices(running.url, keys, examples, stop=stop))
        await wait_for(lambda: driver.store.last_committed() >= 1 and driver.current is not None,
                       poll=0.002)
        status, body, _ = await raw(running.url, "POST", "/v1/admin/stop",
                                    headers={"Authorization": f"Bearer {running.token}"})
        first = json.loads(body)["run_state"]
        await asyncio.wait_for(asyncio.shield(running.task), 90)
        history = list(driver.history)
        await shutdown(running)
        stop.set()
        await asyncio.wait_for(devices, 90)
        again = await start(cfg, tmp_path / "state", log=lambda s: None)
        devices = asyncio.create_task(run_devices(again.url, keys, examples))
        await asyncio.wait_for(asyncio.shield(again.task), 120)
        releases = again.driver.store.releases()
        final = again.driver.status()
        await asyncio.wait_for(devices, 90)
        await shutdown(again)
        return first, history, releases, final

    first, history, releases, final = asyncio.run(main())
    assert first == "stopping"
    assert history[-1]["status"] == "failed" and history[-1]["reason"] == "the coordinator stopped"
    assert [r["round"] for r in releases] == [1, 2, 3, 4, 5, 6]
    assert final["run_state"] == "finished"


def test_serve_errors_are_one_line(tmp_path, capsys):
    config = tmp_path / "c.toml"
    secret = {"noise_seed": -1}  # serve refuses research mode's seeded noise
    config.write_text(to_toml(tiny_cfg(rounds=1, dp=secret).resolved()))
    dropout = tmp_path / "d.toml"  # a key moved to [devices]
    dropout.write_text(to_toml(tiny_cfg(rounds=1, dp=secret, aggregation={
        "kind": "secagg", "signed": True}).resolved()).replace("[aggregation]\n",
                                                                "[aggregation]\ndropout = 0.2\n"))
    cases = {
        (str(config), "--listen", "0.0.0.0:0"): "needs --tls-cert",
        (str(config), "--listen", "localhost"): "HOST:PORT",
        (str(tmp_path / "none.toml"),): "not found",
        (str(dropout),): "config key 'aggregation.dropout' moved to 'devices.dropout_secagg'",
        (str(config), "--tls-cert", str(config)): "both --tls-cert and --tls-key",
    }
    for i, (args, message) in enumerate(cases.items()):
        with pytest.raises(SystemExit) as exit_:
            main(["service", "serve", *args, "--state", str(tmp_path / f"s{i}")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("error: ") and message in err, err
        assert err.count("\n") == 1  # one line, no traceback
