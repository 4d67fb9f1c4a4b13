"""The wire protocol module on its own (`dpfleet.edge.wire`): each message's builder and parser
agree, a malformed message is one `WireError` line with the coordinator's status and code, a
request naming another protocol version is refused (over the wire: test_service_hardening.py;
the link's side: test_fleet_link.py), and the emulated fleet imports nothing of the service (the
protocol is all the two share)."""

import ast
import json
import struct
from pathlib import Path

import pytest

from dpfleet.edge.wire import messages as msg
from dpfleet.edge.wire import protocol as wire

ROOT = Path(__file__).resolve().parent.parent


def test_builders_and_parsers_agree_on_every_device_message():
    key = bytes(range(32))
    body = msg.register_body("u7", key)
    assert body == {"device_id": "u7", "public_key": key.hex()}
    assert msg.parse_register(body) == ("u7", key)
    checkin = msg.parse_checkin(msg.checkin_body(charging=True, idle=True, unmetered=False,
                                                 runtime="onnx", timer_expires_at=12.5))
    assert checkin == msg.Checkin({"charging": True, "idle": True, "unmetered": False}, "onnx", 12.5)
    assert not checkin.eligible
    headers = msg.report_headers(0.25, True, 3.5)
    assert headers[wire.H_NORM] == "0.25" and headers[wire.H_CLIPPED] == "1"
    assert msg.parse_stats(headers) == msg.ReportStats(0.25, True, 3.5)
    mail = [b"", b"a", b"\x00" * 70000]
    framed = wire.join_frames(mail)
    assert framed[:9] == struct.pack("<I", 0) + struct.pack("<I", 1) + b"a"
    assert wire.split_frames(framed) == mail
    assert msg.parse_error(json.dumps(msg.error_body("stale_round", "round 3 is not open")).encode()
                           ) == ("stale_round", "round 3 is not open")
    assert msg.parse_error(b"<html>busy</html>") == ("error", "<html>busy</html>")
    assert wire.round_path(3, "secagg", 2, after=7) == "/v1/rounds/3/secagg?attempt=2&after=7"
    assert wire.round_path(3, "report", 2) == "/v1/rounds/3/report?attempt=2"
    job = msg.assignment(round=1, attempt=2, position=0, model_sha256="m", plan_sha256="p",
                         client_seed=5, aggregation="plain", secagg=None, deadlines={"report": 9.0},
                         time_scale=1.0)
    assert "devices" not in job and "bundle" not in job  # plain rounds name no co-participant
    assert msg.parse_checkin_reply(job) is job


@pytest.mark.parametrize("parse, given, code, line", [
    (msg.parse_register, {"device_id": 7, "public_key": "00" * 32}, "bad_register",
     "register needs {device_id: str, public_key: 32-byte hex}"),
    (msg.parse_register, {"device_id": "u", "public_key": "00" * 31}, "bad_register",
     "register needs {device_id: str, public_key: 32-byte hex}"),
    (msg.parse_session, {"x25519": ["00"]}, "bad_session",
     "session needs {x25519: 32-byte public key hex}"),
    (msg.parse_checkin, {"eligibility": {}, "runtime": "tflite", "timer_expires_at": None},
     "bad_checkin", "check-in needs eligibility {charging, idle, unmetered}, runtime in "
                    "('eager', 'onnx', 'executorch'), timer_expires_at"),
    (msg.parse_checkin, {"eligibility": {}, "runtime": "eager", "timer_expires_at": "soon"},
     "bad_checkin", "check-in needs eligibility {charging, idle, unmetered}, runtime in "
                    "('eager', 'onnx', 'executorch'), timer_expires_at"),
    (msg.parse_stats, {wire.H_NORM: "-1"}, "bad_report", "X-Dpfleet-Norm must be >= 0"),
    (msg.parse_stats, {wire.H_LOSS: "low"}, "bad_report",
     "X-Dpfleet-Norm / X-Dpfleet-Loss must be numbers"),
    (lambda q: msg.parse_cursor(q), {"after": "-x"}, "bad_cursor", "after must be an integer"),
    (lambda q: msg.parse_round("3", q), {"attempt": "one"}, "bad_round",
     "round and ?attempt= must be integers"),
    (wire.split_frames, struct.pack("<I", 5) + b"abc", "bad_frame", "truncated SecAgg frame"),
])
def test_a_malformed_message_is_one_line_with_the_coordinators_code(parse, given, code, line):
    with pytest.raises(wire.WireError) as exc:
        parse(given)
    assert (exc.value.status, exc.value.code, str(exc.value)) == (400, code, line)


@pytest.mark.parametrize("body, code, line", [
    (b"[1, 2]", "bad_checkin", "check-in body must be a JSON object"),
    (b'{"a": NaN}', "bad_checkin", "check-in body must be JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "bad_checkin", "check-in body must be JSON"),
])
def test_a_body_that_is_not_one_json_object_is_refused(body, code, line):
    with pytest.raises(wire.WireError) as exc:
        msg.json_object(body, "bad_checkin", "check-in")
    assert (exc.value.code, str(exc.value)) == (code, line)


def test_another_protocol_version_is_refused_and_none_named_is_this_one():
    wire.check_version({})  # a client of before the header: version 1
    wire.check_version({wire.H_PROTOCOL: "1"})
    for said in ("2", "0", "v1", "1.1"):
        with pytest.raises(wire.WireError) as exc:
            wire.check_version({wire.H_PROTOCOL: said})
        assert (exc.value.status, exc.value.code, str(exc.value)) == (
            400, "bad_protocol",
            f"protocol version {said!r} is not spoken here: this coordinator speaks version 1")


@pytest.mark.parametrize("reply, line", [
    ({"kind": "later"}, "check-in reply of unknown kind 'later'"),
    ([1], "check-in reply of unknown kind None"),
    ({"kind": "retry", "after_s": "soon"}, "retry reply without a number after_s"),
    ({"kind": "assignment", "round": 1, "attempt": 1, "position": 0, "aggregation": "plain"},
     "assignment without model_sha256, plan_sha256"),
    ({"kind": "assignment", "round": 1, "attempt": 1, "position": 0, "model_sha256": "m",
      "plan_sha256": "p", "aggregation": "secagg"}, "SecAgg assignment without its devices"),
])
def test_the_device_refuses_a_checkin_reply_it_cannot_act_on(reply, line):
    with pytest.raises(wire.WireError) as exc:
        msg.parse_checkin_reply(reply)
    assert (exc.value.status, exc.value.code, str(exc.value)) == (0, "bad_reply", line)


def test_the_fleet_imports_nothing_of_the_service():
    """Imports inside functions included (import-linter's `jobs` contract holds the same)."""
    found = []
    for path in sorted((ROOT / "fleet").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.startswith("dpfleet.service")]
    assert found == []
