"""Operating the fleet and the coordinator as a person does (issue 32): where `fleet emulate`
keeps its private keys, a fleet whose coordinator stopped, Ctrl-C (exit 130, nothing left
running, no traceback), and `service report` on a finished state directory.

Real subprocesses and sockets on 127.0.0.1 only; every file lives in tmp_path."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_fleet_cli import committed, gone, tiny_toml

REPO = Path(__file__).resolve().parents[1]


def dpfleet(*args: object) -> list[str]:
    return [sys.executable, "-m", "dpfleet", *map(str, args)]


def refused_url() -> str:
    """A loopback URL with nothing listening (the port the OS just gave us, closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None,
             out: Path | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}: "
                                 f"{out.read_text() if out else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {out.read_text() if out else ''}")


def worker_pids(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"^worker \d+: pid (\d+)", text, re.M)]


def start_serve(config: Path, state: Path, log: Path) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as sink:
        serve = subprocess.Popen(dpfleet("service", "serve", config, "--state", state),
                                 stdout=sink, stderr=subprocess.STDOUT)
    wait_for(lambda: (state / "admin.json").is_file(), 240, "serve to write admin.json", serve, log)
    return serve, json.loads((state / "admin.json").read_text())["url"]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


# ------------------------------------------------------------------ 1. the fleet's keys


@pytest.mark.slow
def test_emulate_writes_its_keys_0600_into_its_own_folder_never_the_cwd(tmp_path):
    config = tiny_toml(tmp_path)  # tmp_path/fleet.toml
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    url = refused_url()
    proc = subprocess.run(dpfleet("fleet", "emulate", config, "--coordinator", url, "--processes",
                                  1, "--no-progress", "--coordinator-timeout", 1),
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    # nothing listens: one line, exit 2, once the devices (and their keys) were prepared
    assert proc.returncode == 2, proc.stderr
    assert f"error: no coordinator answers at {url} (connection refused)" in proc.stderr
    assert "Traceback" not in proc.stderr
    # the keys are in the fleet's own folder (what `fleet run --state runs/fleet` uses), not in
    # the current folder: the only thing there is the runs/ folder (.gitignore'd)
    assert sorted(os.listdir(cwd)) == ["runs"]
    folder = cwd / "runs" / "fleet_fleet"
    keys = folder / "fleet_keys.json"
    assert keys.stat().st_mode & 0o777 == 0o600
    assert folder.stat().st_mode & 0o777 == 0o700
    assert len(json.loads(keys.read_text())["keys"]) == 8  # the tiny config's 8 train clients
    assert (folder / "fleet_public.json").is_file()
    assert f"public keys in {Path('runs') / 'fleet_fleet' / 'fleet_public.json'}" in proc.stderr


def test_gitignore_covers_keys_runs_and_state_outputs():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["fleet_keys.json", "examples/fleet_keys-2.json", "runs/fleet_fleet/fleet_keys.json",
             "fleet_public.json", "state/state.sqlite", "my_state/admin.json",
             "runs/fleet/privacy.json", "state_fleet/emulate.log"]
    proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", *paths],
                          capture_output=True, text=True)
    assert sorted(proc.stdout.split()) == sorted(paths), proc.stdout + proc.stderr
    # and not the project's own files
    keep = ["examples/fleet.toml", "fleet/cli.py", "tests/test_fleet_operator.py"]
    proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", *keep],
                          capture_output=True, text=True)
    assert proc.stdout == ""


# ------------------------------------------------------------------ 2. a coordinator that is gone


@pytest.mark.slow  # ~40-60 s: a coordinator and a fleet, one round committed, then the kill
def test_emulate_exits_within_10_s_with_one_line_when_its_coordinator_is_killed(tmp_path):
    config = tiny_toml(tmp_path, rounds=200)  # far more rounds than the test lets run
    state = tmp_path / "state"
    serve, url = start_serve(config, state, tmp_path / "serve.log")
    out = tmp_path / "emulate.out"
    try:
        with open(out, "w") as sink:
            fleet = subprocess.Popen(dpfleet("fleet", "emulate", config, "--coordinator", url,
                                             "--fleet-dir", tmp_path / "fleet", "--processes", 1,
                                             "--no-progress"),
                                     stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            wait_for(lambda: committed(state) >= 1, 240, "a committed round", fleet, out)
            serve.kill()  # gone at once, as after a crash
            serve.wait(30)
            began = time.monotonic()
            rc = fleet.wait(60)
            elapsed = time.monotonic() - began
        finally:
            stop(fleet)
    finally:
        stop(serve)
    text = out.read_text()
    assert rc == 2, text
    assert elapsed <= 10.0, (elapsed, text)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    assert errors[0].startswith(f"error: the coordinator at {url} stopped answering "
                                "(connection refused); the fleet stopped"), text
    assert "Traceback" not in text
    assert all(gone(p) for p in worker_pids(text)), text


def test_a_watch_that_saw_the_run_finish_ends_quietly(tmp_path):
    """After the coordinator said its run is finished, its going away is the normal end."""
    from dpfleet.errors import DpfleetError
    from dpfleet.fleet.emulate import CoordinatorWatch

    now = [0.0]
    watch = CoordinatorWatch(refused_url(), gone_after_s=3.0, clock=lambda: now[0])
    assert watch.check() is False  # refused, but not for 3 s yet
    now[0] = 3.5
    with pytest.raises(DpfleetError, match=r"no coordinator answers at .* \(connection refused\)"):
        watch.check()
    watch = CoordinatorWatch(refused_url(), gone_after_s=3.0, clock=lambda: now[0])
    watch.answered = watch.finished = True
    now[0] = 10.0
    assert watch.check() is False
    now[0] = 13.5
    assert watch.check() is True
    never = CoordinatorWatch(refused_url(), gone_after_s=0.0, clock=lambda: now[0])
    now[0] = 1e6
    assert never.check() is False  # 0: waits for ever


def test_the_watch_reads_the_rounds_the_fleets_bar_counts():
    """The fleet's progress is the coordinator's rounds committed of planned (its public status),
    read also with --coordinator-timeout 0 (which never gives up on it)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dpfleet.fleet.emulate import CoordinatorWatch

    body = json.dumps({"run_state": "running", "rounds_committed": 4, "rounds_planned": 10}).encode()

    class Status(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            assert self.path == "/v1/public/status"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Status) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            for timeout in (5.0, 0.0):
                watch = CoordinatorWatch(f"http://127.0.0.1:{server.server_port}", gone_after_s=timeout)
                assert watch.rounds is None
                assert watch.check() is False
                assert watch.rounds == (4, 10)
        finally:
            server.shutdown()


# ------------------------------------------------------------------ 4. Ctrl-C exits 130


@pytest.mark.slow
def test_ctrl_c_stops_coordinator_serve_with_130_and_the_resume_hint(tmp_path):
    """A real SIGINT to `service serve` mid-run: exit 130 (before: 0), the status line, the
    command that continues, no traceback; the same command then starts again on the state."""
    config = tiny_toml(tmp_path, rounds=200)  # the run cannot finish before the signal
    state = tmp_path / "state"
    serve, _ = start_serve(config, state, tmp_path / "serve.log")
    try:
        serve.send_signal(signal.SIGINT)
        rc = serve.wait(60)
    finally:
        stop(serve)
    text = (tmp_path / "serve.log").read_text()
    assert rc == 130, text
    assert "0 of 200 rounds committed, 0 failed" in text, text
    assert f"interrupted; continue with: dpfleet service serve {config} --state {state}" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    again, _ = start_serve(config, state, tmp_path / "serve2.log")  # continues on the same state
    stop(again)
    second = (tmp_path / "serve2.log").read_text()
    assert "coordinator listening on" in second and "error" not in second, second


@pytest.mark.slow
def test_ctrl_c_stops_fleet_emulate_and_its_workers_with_130(tmp_path):
    config = tiny_toml(tmp_path)
    out = tmp_path / "emulate.out"
    with open(out, "w") as sink:  # its own process group, as a terminal's foreground job
        proc = subprocess.Popen(dpfleet("fleet", "emulate", config, "--coordinator", refused_url(),
                                        "--fleet-dir", tmp_path / "fleet", "--processes", 2,
                                        "--no-progress", "--coordinator-timeout", 0),
                                stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path,
                                start_new_session=True)
    try:
        pids = wait_for(lambda: len(worker_pids(out.read_text())) == 2 and worker_pids(
            out.read_text()), 240, "two workers", proc, out)
        time.sleep(3.0)  # the workers are importing / running their devices
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole group, workers included
        rc = proc.wait(60)
    finally:
        stop(proc)
    text = out.read_text()
    assert rc == 130, text
    assert "interrupted: the fleet stopped; rerun the same command to continue" in text
    assert str(tmp_path / "fleet" / "fleet_keys.json") in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert all(gone(p) for p in pids), text


@pytest.mark.slow  # ~30-60 s: fleet run starts a coordinator and a fleet before the Ctrl-C
def test_ctrl_c_stops_fleet_run_with_130_and_the_resume_hint(tmp_path):
    from test_fleet_cli import pids_in

    config = tiny_toml(tmp_path, rounds=200)
    state = tmp_path / "state"
    out = tmp_path / "run.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen(dpfleet("fleet", "run", config, "--state", state, "--processes", 1,
                                        "--grace", 20),
                                stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path,
                                start_new_session=True)
    try:
        wait_for(lambda: committed(state) >= 1, 240, "a committed round", proc, out)
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(90)
    finally:
        stop(proc)
    text = out.read_text()
    assert rc == 130, text
    assert f"interrupted; continue with: dpfleet fleet run {config} --state {state}" in text
    assert re.search(r"^(stopping|stopped): \d+ of 200 rounds committed", text, re.M), text
    assert "Traceback" not in text
    pids = pids_in(text)
    assert len(pids) == 2 and all(gone(p) for p in pids), text


# ------------------------------------------------------------------ 3. report of a finished run


def finished_state(tmp_path) -> Path:
    """A coordinator state whose 1-round run finished (in-process service, real devices)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from service_fleet import fleet_data, serve_to_end, tiny_cfg

    cfg = tiny_cfg(rounds=1)
    users, examples = fleet_data(cfg, tmp_path / "fleet")
    keys = {u: Ed25519PrivateKey.generate() for u in users}
    state = tmp_path / "state"
    assert asyncio.run(serve_to_end(cfg, state, keys, examples, devices_s=30))["run_state"] == "finished"
    return state


def test_report_of_a_finished_state_directory_needs_no_coordinator(capsys, tmp_path):
    from admin_standin import run

    state = finished_state(tmp_path)
    assert not (state / "admin.json").exists()  # no coordinator runs there any more
    code, out, err = run(capsys, "report", "--state", str(state))
    assert code == 0, err
    assert out.rstrip("\n") == (state / "privacy_report.md").read_text().rstrip("\n")
    privacy = json.loads((state / "privacy.json").read_text())
    code, out, err = run(capsys, "report", "--state", str(state), "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["rounds_committed"] == 1 and got["epsilon"] == privacy["epsilon"] > 0
    assert got["delta"] == privacy["delta"]
    assert got["report"] == (state / "privacy_report.md").read_text()
    code, out, err = run(capsys, "report", "--state", str(state), "--out",
                         str(tmp_path / "r.md"))
    written = (tmp_path / "r.md").read_text()
    assert code == 0 and written.split("\n", 1)[1] == (state / "privacy_report.md").read_text()
    # a state that is not finished still needs its coordinator: the same clear error as before
    code, out, err = run(capsys, "report", "--state", str(tmp_path / "empty"))
    assert code == 2 and "no coordinator is running there" in err
    # status is a live view: it still says no coordinator runs there
    code, out, err = run(capsys, "status", "--state", str(state))
    assert code == 2 and "no coordinator is running there" in err
