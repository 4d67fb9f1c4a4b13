"""The operator CLI and the status page against the real coordinator: `dpfleet service serve`
in a subprocess (it writes STATE/admin.json), real devices (fleet/link.py) training over loopback
in a thread, and `dpfleet service status | pause | resume | report | stop` in this process."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from admin_standin import one_error_line, run
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from service_fleet import fleet_data, run_devices, tiny_cfg

from dpfleet.coordinator.state.run_dir import to_toml


def _wait(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _status(capsys, state) -> dict:
    code, out, err = run(capsys, "status", "--state", str(state), "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_cli_operates_a_real_coordinator(capsys, tmp_path):
    # far more rounds than the test lets commit: `stop` must find the run going, whatever the
    # machine's speed (with 6 rounds a fast run had finished before the stop arrived)
    cfg = tiny_cfg(rounds=200, eval_every=1, dp={"noise_seed": -1})  # serve: secret noise only
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(cfg.resolved()))
    state = tmp_path / "state"
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    serve = subprocess.Popen([sys.executable, "-m", "dpfleet", "service", "serve", str(config),
                              "--state", str(state)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (state / "admin.json").is_file() or serve.poll() is not None, 180,
              "serve to write admin.json")
        assert serve.poll() is None, serve.communicate()
        admin = json.loads((state / "admin.json").read_text())
        assert admin["pid"] == serve.pid and (state / "admin.json").stat().st_mode & 0o077 == 0

        bad = tmp_path / "token"  # a wrong token: 401, one line, and the run is not paused
        bad.write_text(admin["token"][::-1])
        code, out, err = run(capsys, "pause", "--url", admin["url"], "--token-file", str(bad))
        assert code == 2 and out == "" and "refused the admin token (401)" in one_error_line(err)
        st = _status(capsys, state)  # no device yet: round 1 waits for check-ins
        assert st["run_state"] == "running"
        assert (st["rounds_committed"], st["rounds_planned"], st["round"]) == (0, 200, 1)
        code, out, _ = run(capsys, "pause", "--state", str(state))
        assert code == 0 and out.startswith("paused: round 1")
        assert _status(capsys, state)["run_state"] == "paused"
        code, out, _ = run(capsys, "resume", "--state", str(state), "--json")
        assert code == 0 and json.loads(out)["run_state"] == "running"

        # devices train; the status follows the run
        keys = {u: Ed25519PrivateKey.generate() for u in users}
        stop_devices = threading.Event()

        def devices():
            async def main():
                stop = asyncio.Event()
                task = asyncio.create_task(run_devices(admin["url"], keys, examples, stop=stop))
                while not stop_devices.is_set() and not task.done():
                    await asyncio.sleep(0.1)
                stop.set()
                task.cancel()
            asyncio.run(main())

        fleet = threading.Thread(target=devices, daemon=True)
        fleet.start()
        st = _wait(lambda: (s := _status(capsys, state))["rounds_committed"] >= 2 and s, 180,
                   "two committed rounds")
        code, table, _ = run(capsys, "status", "--state", str(state))
        shown = re.search(r"(\d+) committed", table)  # rounds go on while we read
        assert code == 0 and shown and int(shown.group(1)) >= st["rounds_committed"]
        assert st["epsilon"] > 0 and st["last_accuracy"] is not None
        code, report, _ = run(capsys, "report", "--state", str(state))
        assert code == 0 and "# Privacy report" in report and "eps = " in report

        with urllib.request.urlopen(admin["url"] + "/", timeout=30) as resp:
            page = resp.read().decode()
        assert "<svg" in page and not any(u in page for u in users)

        code, out, _ = run(capsys, "stop", "--state", str(state), "--json")
        stopped = json.loads(out)
        assert code == 0 and stopped["run_state"] == "stopping"
        assert stopped["rounds_committed"] >= st["rounds_committed"]
        assert serve.wait(60) == 0, serve.communicate()[1][-6000:]
        stop_devices.set()
        fleet.join(30)
        # serve removed admin.json on the way out: the CLI says nobody is running there
        code, _, err = run(capsys, "status", "--state", str(state))
        assert code == 2 and "no coordinator is running there" in one_error_line(err)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()

