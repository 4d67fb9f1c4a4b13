"""The protocol's messages: what each side builds, and the checks that turn a malformed one into
one `WireError` line (its `status` / `code` are the coordinator's HTTP answer).

Why one module for both sides: the shapes were written twice (the service parsed what the link
built), so a field renamed on one side broke the other at run time only. Here each message has
its builder beside its parser, and a test round-trips them. Messages stay plain JSON objects
(dicts) once checked: that is what travels, what the state store logs and what tests compare,
and a check here never rewrites a field, so a message is passed on exactly as it arrived.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from dpfleet.edge.wire.protocol import H_CLIPPED, H_LOSS, H_NORM, WireError

RUNTIMES = ("eager", "onnx", "executorch")
ELIGIBILITY = ("charging", "idle", "unmetered")
CHECKIN_KINDS = ("retry", "refused", "assignment", "done")
# what a device cannot do without in an assignment (PROTOCOL.md, "Assignment fields"; the rest
# have defaults: `client_seed` was in the plan blob before, `deadlines` only pace an emulation)
ASSIGNMENT_FIELDS = ("round", "attempt", "position", "model_sha256", "plan_sha256", "aggregation")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(body: bytes):
    """A body's JSON, or ValueError: not UTF-8 JSON, NaN / Infinity, or nested deeper than the
    parser's recursion allows (RecursionError would otherwise be a 500)."""
    try:
        return json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def json_object(body: bytes, code: str, what: str) -> dict:
    """A body that must be one JSON object; anything else is a 400 with `code`."""
    try:
        payload = parse_json(body)
    except ValueError:
        raise WireError(code, f"{what} body must be JSON") from None
    if not isinstance(payload, dict):
        raise WireError(code, f"{what} body must be a JSON object")
    return payload


def _key32(value) -> bytes:
    """32 bytes from hex, or ValueError (TypeError for a non-string, turned into ValueError)."""
    if not isinstance(value, str):
        raise ValueError
    key = bytes.fromhex(value)
    if len(key) != 32:
        raise ValueError
    return key


# ---------------------------------------------------------------------------- register, session

def register_body(device_id: str, public_key: bytes) -> dict:
    return {"device_id": device_id, "public_key": public_key.hex()}


def parse_register(payload: dict) -> tuple[str, bytes]:
    """(device id, 32-byte Ed25519 public key) of a register body; said before any id is looked
    at, so this 400 tells nothing about any device."""
    device_id = payload.get("device_id")
    try:
        if not isinstance(device_id, str):
            raise ValueError
        return device_id, _key32(payload.get("public_key"))
    except ValueError:
        raise WireError("bad_register", "register needs {device_id: str, public_key: 32-byte hex}") from None


def parse_session(payload: dict) -> bytes:
    """The device's 32-byte X25519 public key of a session handshake body."""
    try:
        return _key32(payload.get("x25519"))
    except ValueError:
        raise WireError("bad_session", "session needs {x25519: 32-byte public key hex}") from None


# ---------------------------------------------------------------------------- check-in

@dataclass(frozen=True)
class Checkin:
    """A device's check-in: its eligibility flags as sent, its runtime, its own timer."""

    eligibility: dict
    runtime: str
    timer_expires_at: float | None

    @property
    def eligible(self) -> bool:
        """Charging, idle and unmetered, each exactly `true`."""
        return all(self.eligibility.get(k) is True for k in ELIGIBILITY)


def checkin_body(*, charging: bool, idle: bool, unmetered: bool, runtime: str,
                 timer_expires_at: float | None) -> dict:
    return {"eligibility": {"charging": charging, "idle": idle, "unmetered": unmetered},
            "runtime": runtime, "timer_expires_at": timer_expires_at}


def parse_checkin(payload: dict) -> Checkin:
    elig, runtime = payload.get("eligibility"), payload.get("runtime")
    timer = payload.get("timer_expires_at")
    if not isinstance(elig, dict) or runtime not in RUNTIMES or not (
            timer is None or isinstance(timer, int | float)):
        raise WireError("bad_checkin", "check-in needs eligibility {charging, idle, unmetered}, "
                                       f"runtime in {RUNTIMES}, timer_expires_at")
    return Checkin(elig, runtime, timer)


def retry(after_s: float, reason: str) -> dict:
    """Check in again after `after_s` wall seconds (`reason`: no round open, round full, ...)."""
    return {"kind": "retry", "after_s": after_s, "reason": reason}


def refused(reason: str, after_s: float) -> dict:
    """Not this device now (`reason`: timer, max_participation, ineligible, runtime)."""
    return {"kind": "refused", "reason": reason, "after_s": after_s}


def done() -> dict:
    """The run has finished: the device stops."""
    return {"kind": "done"}


def assignment(*, round: int, attempt: int, position: int, model_sha256: str, plan_sha256: str,
               client_seed: int, aggregation: str, secagg: dict | None, deadlines: dict,
               time_scale: float, devices: list[str] | None = None,
               bundle: dict | None = None, rounding_seed: list[int] | None = None) -> dict:
    """One device's assignment; `devices` only in SecAgg rounds, `bundle` only in bundle mode,
    `rounding_seed` only in research-mode SecAgg rounds (the ring rounding's seed words,
    `secagg.encoding.rounding_seed`: absent, the device draws its own)."""
    out = {"kind": "assignment", "round": round, "attempt": attempt, "position": position,
           "model_sha256": model_sha256, "plan_sha256": plan_sha256, "client_seed": client_seed,
           "aggregation": aggregation, "secagg": secagg, "deadlines": deadlines,
           "time_scale": time_scale}
    if devices is not None:
        out["devices"] = devices
    if bundle is not None:
        out["bundle"] = bundle
    if rounding_seed is not None:
        out["rounding_seed"] = rounding_seed
    return out


def parse_checkin_reply(reply) -> dict:
    """The coordinator's check-in answer, checked for what the device will read (`WireError`,
    status 0: the coordinator's mistake, not the device's)."""
    kind = reply.get("kind") if isinstance(reply, dict) else None
    if kind not in CHECKIN_KINDS:
        raise WireError("bad_reply", f"check-in reply of unknown kind {kind!r}", 0)
    if kind in ("retry", "refused") and not _number(reply.get("after_s", 1.0)):
        raise WireError("bad_reply", f"{kind} reply without a number after_s", 0)
    if kind == "assignment":
        missing = [f for f in ASSIGNMENT_FIELDS if f not in reply]
        if missing:
            raise WireError("bad_reply", f"assignment without {', '.join(missing)}", 0)
        if reply["aggregation"] == "secagg" and not isinstance(reply.get("devices"), list):
            raise WireError("bad_reply", "SecAgg assignment without its devices", 0)
    return reply


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------- the plan blob

def device_plan(plan_bytes: bytes, assignment: dict) -> dict:
    """The round's plan as a device trains with it: the plan blob (one per attempt, shared by its
    devices and served to anyone, so it names nobody) with the device's client seed
    from its own assignment, which only it receives (PROTOCOL.md, "Who learns who takes part").
    A coordinator of before that change put the seed in a per-device blob: it is taken from there."""
    plan = json.loads(plan_bytes)
    if "client_seed" in assignment:
        plan["client_seed"] = int(assignment["client_seed"])
    return plan


# ---------------------------------------------------------------------------- rounds

def parse_round(round: str, query) -> tuple[int, int]:
    """(round, attempt) of `/v1/rounds/{round}/...?attempt=A`."""
    try:
        return int(round), int(query["attempt"])
    except (KeyError, ValueError):
        raise WireError("bad_round", "round and ?attempt= must be integers") from None


def parse_cursor(query) -> int:
    """The SecAgg mailbox cursor `after` (0 when absent)."""
    try:
        return int(query.get("after", "0"))
    except ValueError:
        raise WireError("bad_cursor", "after must be an integer") from None


# ---------------------------------------------------------------------------- plain reports

@dataclass(frozen=True)
class ReportStats:
    """What the engine reads of one report (`round_engine.ClientStats`); device-reported, so
    used only for adaptive clipping and debug logs, never added to the model."""

    norm: float  # the delta's L2 norm before the clip (NaN: not said)
    clipped: bool
    loss: float


def report_headers(norm: float, clipped: bool, loss: float) -> dict[str, str]:
    """A plain report's statistics, as its headers (the body is the raw float32 delta)."""
    return {"Content-Type": "application/octet-stream", H_NORM: repr(float(norm)),
            H_CLIPPED: "1" if clipped else "0", H_LOSS: repr(float(loss))}


def parse_stats(headers) -> ReportStats:
    """The report's training statistics (un-noised: only for adaptive clipping and debug logs)."""
    try:
        norm = float(headers.get(H_NORM, "nan"))
        loss = float(headers.get(H_LOSS, "nan"))
        clipped = headers.get(H_CLIPPED, "0") in ("1", "true", "True")
    except ValueError:
        raise WireError("bad_report", f"{H_NORM} / {H_LOSS} must be numbers") from None
    if not (math.isnan(norm) or norm >= 0):
        raise WireError("bad_report", f"{H_NORM} must be >= 0")
    return ReportStats(norm, clipped, loss)


# ---------------------------------------------------------------------------- errors

def error_body(code: str, message: str) -> dict:
    """Every refusal's body (PROTOCOL.md): one line and a code slug."""
    return {"error": message, "code": code}


def parse_error(data: bytes) -> tuple[str, str]:
    """(code, message) of a refusal's body; a body that is not ours is "error" and its start."""
    try:
        payload = json.loads(data)
        return str(payload.get("code", "error")), str(payload.get("error", ""))
    except (ValueError, AttributeError):
        return "error", data[:200].decode(errors="replace")
