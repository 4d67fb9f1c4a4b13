"""`dpfleet service status | pause | resume | stop | report` against a live admin API.

The server is `admin_standin.StandInCoordinator` (a real aiohttp server on loopback standing in
for `dpfleet service serve`, so that every answer can be controlled; the real service is in
test_admin_cli_service.py); the CLI runs through dpfleet's own `main` (in-process, or as a
subprocess where the test is about what a user sees: one line, exit 2, no traceback).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from admin_standin import StandInCoordinator, make_cert, one_error_line, run

from dpfleet.service.cli_admin import REPORT_MARK


def run_subprocess(*args: str) -> subprocess.CompletedProcess:
    """`dpfleet service ARGS` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "dpfleet", "service", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def coord():
    with StandInCoordinator() as c:
        yield c


@pytest.fixture
def token_file(tmp_path, coord):
    path = tmp_path / "token"
    path.write_text(coord.token + "\n")
    return path


def test_status_table_from_state(capsys, tmp_path, coord):
    coord.write_admin_json(tmp_path / "state")
    code, out, err = run(capsys, "status", "--state", str(tmp_path / "state"))
    assert code == 0, err
    rows = {ln[:18].strip(): ln[18:] for ln in out.splitlines()[:7]}
    assert rows["run state"] == "running"
    assert rows["round"] == "8  phase secagg_shares"
    assert rows["devices"] == "412 waiting, 100 training, 37 refused by timer (1000 registered)"
    assert rows["rounds"] == "7 committed, 1 failed, 20 planned"
    assert rows["eps spent so far"] == "2.7180 at delta 1e-06"
    assert rows["last accuracy"] == "0.1044"
    assert rows["coordinator"] == f"{coord.url}  (up 1h 02m 05s)"
    # aligned: every value starts in the same column; the phase table lists every phase
    starts = {len(ln) - len(ln[18:].lstrip()) for ln in out.splitlines()[:7]}
    assert starts == {18}
    assert out.splitlines()[7] == "mean time per phase"
    assert out.splitlines()[8:] == ["  select             0.120 s", "  secagg_keys        1.500 s",
                                    "  secagg_shares      0.800 s", "  secagg_masked      3.250 s",
                                    "  secagg_unmask      0.400 s"]


def test_status_json_by_url_and_token_file(capsys, coord, token_file):
    code, out, err = run(capsys, "status", "--url", coord.url, "--token-file", str(token_file),
                         "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["rounds_committed"] == 7 and got == coord.status


@pytest.mark.parametrize(("command", "state"), [("pause", "paused"), ("resume", "running"),
                                                 ("stop", "stopping")])
def test_control_commands_change_the_run_state(capsys, tmp_path, coord, command, state):
    coord.status["run_state"] = "paused" if command == "resume" else "running"
    coord.write_admin_json(tmp_path)
    code, out, err = run(capsys, command, "--state", str(tmp_path))
    assert code == 0, err
    assert coord.status["run_state"] == state and ("POST", f"/v1/admin/{command}") in coord.calls
    assert out.strip() == (f"{state}: round 8 (phase secagg_shares), 7 committed, "
                           "1 failed of 20 planned")
    code, out, _ = run(capsys, command, "--state", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["rounds_committed"] == 7


def test_report_prints_writes_and_json(capsys, tmp_path, coord):
    coord.write_admin_json(tmp_path)
    code, out, _ = run(capsys, "report", "--state", str(tmp_path))
    assert code == 0 and out == coord.report
    dest = tmp_path / "report.md"
    code, out, _ = run(capsys, "report", "--state", str(tmp_path), "--out", str(dest))
    marked = f"<!-- {REPORT_MARK} -->\n{coord.report}"  # markdown renders the mark as nothing
    assert code == 0 and dest.read_text() == marked and str(dest) in out
    code, out, _ = run(capsys, "report", "--state", str(tmp_path), "--out", str(dest))  # its own: again
    assert code == 0 and dest.read_text() == marked
    for theirs in (tmp_path / "privacy.json", tmp_path / "notes.md"):  # never a file it did not write
        theirs.write_text("{}")
        code, _, err = run(capsys, "report", "--state", str(tmp_path), "--out", str(theirs))
        assert code == 2 and "exists and is not a file this command wrote" in err
        assert theirs.read_text() == "{}"
    code, out, _ = run(capsys, "report", "--state", str(tmp_path), "--json")
    got = json.loads(out)
    assert code == 0 and got["rounds_committed"] == 7 and got["report"] == coord.report


@pytest.mark.slow
def test_wrong_token_is_one_line_exit_2_and_changes_nothing(tmp_path, coord):
    """An attacker with a wrong token cannot pause the run: the state stays `running`."""
    bad = tmp_path / "bad-token"
    bad.write_text("0" * 64)
    proc = run_subprocess("pause", "--url", coord.url, "--token-file", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "refused the admin token (401)" in one_error_line(proc.stderr)
    assert coord.status["run_state"] == "running"
    # the real token differs by one character: still refused
    bad.write_text(coord.token[:-1] + ("0" if coord.token[-1] != "0" else "1"))
    proc = run_subprocess("stop", "--url", coord.url, "--token-file", str(bad), "--json")
    assert proc.returncode == 2 and coord.status["run_state"] == "running"
    assert "401" in one_error_line(proc.stderr)


@pytest.mark.slow
def test_state_without_admin_json(tmp_path):
    (tmp_path / "state").mkdir()
    proc = run_subprocess("status", "--state", str(tmp_path / "state"))
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "has no admin.json" in line and "dpfleet service serve CONFIG --state" in line
    proc = run_subprocess("status", "--state", str(tmp_path / "missing"), "--json")
    assert proc.returncode == 2 and "does not exist" in one_error_line(proc.stderr)


def test_connection_refused_names_the_pid(capsys, tmp_path):
    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "admin.json").write_text(json.dumps(
        {"url": f"http://127.0.0.1:{port}", "token": "t" * 64, "pid": dead.pid, "tls_cert": None}))
    code, out, err = run(capsys, "status", "--state", str(tmp_path))
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert "is the coordinator running?" in line
    assert f"admin.json pid {dead.pid}, which is no longer running" in line
    # the same with this (live) process's pid
    (tmp_path / "admin.json").write_text(json.dumps(
        {"url": f"http://127.0.0.1:{port}", "token": "t" * 64, "pid": os.getpid(), "tls_cert": None}))
    _, _, err = run(capsys, "status", "--state", str(tmp_path))
    assert f"pid {os.getpid()}, which is still running" in one_error_line(err)


def test_tls_pinned_certificate(capsys, tmp_path):
    cert, key = make_cert(tmp_path, "coordinator")
    other, _ = make_cert(tmp_path, "impostor")
    with StandInCoordinator(tls=(cert, key)) as coord:
        coord.write_admin_json(tmp_path / "state", tls_cert=str(cert))
        code, out, err = run(capsys, "status", "--state", str(tmp_path / "state"), "--json")
        assert code == 0 and json.loads(out)["rounds_committed"] == 7, err
        # a relative tls_cert is relative to the state directory
        (tmp_path / "state" / "cert.pem").write_bytes(cert.read_bytes())
        coord.write_admin_json(tmp_path / "state", tls_cert="cert.pem")
        assert run(capsys, "status", "--state", str(tmp_path / "state"))[0] == 0
        # another certificate pinned: the connection is refused before the token is sent
        calls = len(coord.calls)
        coord.write_admin_json(tmp_path / "state", tls_cert=str(other))
        code, _, err = run(capsys, "status", "--state", str(tmp_path / "state"))
        assert code == 2 and "does not verify" in one_error_line(err) and str(other) in err
        assert len(coord.calls) == calls
        token = tmp_path / "token"
        token.write_text(coord.token)
        code, _, err = run(capsys, "pause", "--url", coord.url, "--token-file", str(token))
        assert code == 2 and "--tls-cert" in one_error_line(err)
        assert coord.status["run_state"] == "running"
        code, _, err = run(capsys, "pause", "--url", coord.url, "--token-file", str(token),
                           "--tls-cert", str(cert))
        assert code == 0 and coord.status["run_state"] == "paused", err
        # plain http to the TLS port
        code, _, err = run(capsys, "status", "--url", coord.url.replace("https", "http"),
                           "--token-file", str(token))
        assert code == 2 and "http/https" in one_error_line(err)


def test_timeout(capsys, tmp_path):
    with StandInCoordinator(delay_s=1.5) as coord:
        coord.write_admin_json(tmp_path)
        code, _, err = run(capsys, "status", "--state", str(tmp_path), "--timeout", "0.3")
    assert code == 2 and "did not answer GET /v1/admin/status within 0.3 s" in one_error_line(err)


def test_busy_coordinator_is_asked_again(capsys, tmp_path, coord):
    coord.write_admin_json(tmp_path)
    coord.busy = 2
    code, out, err = run(capsys, "report", "--state", str(tmp_path))
    assert code == 0 and out == coord.report and coord.busy == 0, err
    coord.busy = 10**6
    code, _, err = run(capsys, "report", "--state", str(tmp_path), "--timeout", "1")
    assert code == 2 and "is busy (a round is being committed)" in one_error_line(err)


def test_not_a_coordinator(capsys, tmp_path, coord, token_file):
    del coord.status["rounds_committed"]
    code, _, err = run(capsys, "status", "--url", coord.url, "--token-file", str(token_file))
    assert code == 2 and "lacks rounds_committed" in one_error_line(err)


@pytest.mark.parametrize(("setup", "args", "needle"), [
    (lambda d: (d / "admin.json").write_text("{not json"), ["--state", "{d}"], "not readable JSON"),
    (lambda d: (d / "admin.json").write_text('{"url": "http://127.0.0.1:1"}'), ["--state", "{d}"],
     "expected string fields 'url' and 'token'"),
    (lambda d: (d / "admin.json").write_text('{"url": "127.0.0.1:1", "token": "x"}'),
     ["--state", "{d}"], "expected a URL like"),
    (lambda d: (d / "admin.json").write_text(
        '{"url": "https://127.0.0.1:1", "token": "x", "tls_cert": "nope.pem"}'),
     ["--state", "{d}"], "nope.pem not found"),
    (lambda d: (d / "token").write_text("\n"), ["--url", "http://127.0.0.1:1", "--token-file", "{d}/token"],
     "is empty"),
    (lambda d: None, ["--url", "http://127.0.0.1:1", "--token-file", "{d}/none"], "not found"),
    (lambda d: None, ["--url", "http://127.0.0.1:1"], "--url and --token-file go together"),
    (lambda d: None, [], "which coordinator?"),
    (lambda d: None, ["--state", "{d}", "--url", "http://127.0.0.1:1"], "not both"),
    (lambda d: (d / "token").write_text("x"),
     ["--url", "http://127.0.0.1:1", "--token-file", "{d}/token", "--timeout", "0"], "--timeout"),
])
def test_user_mistakes(capsys, tmp_path, setup, args, needle):
    setup(tmp_path)
    code, out, err = run(capsys, "status", *[a.format(d=tmp_path) for a in args])
    assert code == 2 and out == "" and needle in one_error_line(err)


def test_help_explains(capsys):
    for command in ("status", "pause", "resume", "stop", "report"):
        code, out, _ = run(capsys, command, "--help")
        assert code == 0 and "--state" in out and "--token-file" in out and "--json" in out
    assert "refused by their timer" in run(capsys, "status", "--help")[1]


def test_service_is_the_command_and_coordinator_a_hidden_deprecated_alias(tmp_path):
    """`dpfleet service` runs the HTTP service (the package `dpfleet.coordinator` is the privacy
    core, not this); `dpfleet coordinator` still works, says once on stderr that it is now
    `dpfleet service`, and is not listed."""
    from cli_helpers import run_here

    (tmp_path / "state").mkdir()
    new = run_here("service", "status", "--state", str(tmp_path / "state"))
    assert new.returncode == 2
    assert new.stderr.splitlines() == [new.stderr.strip()]  # one line: the error, nothing else
    assert "has no admin.json" in new.stderr and "dpfleet service serve CONFIG --state" in new.stderr
    old = run_here("coordinator", "status", "--state", str(tmp_path / "state"))
    assert old.returncode == 2
    lines = old.stderr.splitlines()
    assert lines[0] == "warning: `dpfleet coordinator` is deprecated; use `dpfleet service`"
    assert lines[1:] == new.stderr.splitlines()  # then the same command, the same error line
    listed = [line.split()[0] for line in run_here("--help").stdout.split("Commands:")[1].splitlines()
              if line.startswith("  ")]
    assert "service" in listed and "coordinator" not in listed
