"""The HTTP routes (PROTOCOL.md) on aiohttp.web, mapped onto the round driver.

aiohttp.web because the coordinator is one asyncio process: long-polls (check-ins, SecAgg
mailboxes) are coroutines waiting on a condition, not threads, and no separate ASGI server is
needed (aiohttp is both the server and the devices' client).

Every device call is authenticated (`auth.verify_request`: an Ed25519 signature, or the HMAC
of a session opened with one at POST /v1/session) on the exact raw path and body,
rate-limited per device (`limits`), and bounded in size (`client_max_size`: 413) before its
body is parsed (`parse_json`: malformed, NaN or too deeply nested JSON is a 400). Register is
the exception that proves possession of the key in its body, and answers every refusal alike.
Admin calls need the bearer token and nothing else; public calls show only released aggregates
and counts. Anything unexpected is a generic 500 (`errors`), its traceback in our log only.
"""

from __future__ import annotations

import json
import logging
import struct
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from dpfleet.jsonio import dumps
from dpfleet.service.auth import (
    H_SIG,
    AuthError,
    NonceCache,
    Sessions,
    check_admin,
    verify_register,
    verify_request,
)
from dpfleet.service.limits import RateLimiter
from dpfleet.service.rounds import ApiError, RoundDriver, registration_refused
from dpfleet.service.status_page import add_status_routes

DRIVER = web.AppKey("driver", RoundDriver)
CONTEXT = web.AppKey("context", dict)
POLL_S = 25.0


def _json(obj, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(text=dumps(obj), status=status, content_type="application/json",
                        headers=headers)


LOG = logging.getLogger("dpfleet.service")


class _ClientMistakes(logging.Filter):
    """aiohttp logs a request it cannot parse (a bad header byte, a bad request line: its own
    400) as an ERROR with a traceback; that is the client's mistake, not ours: one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500:
            first = (exc.message or type(exc).__name__).strip().splitlines()
            HTTP_LOG.info("refused a malformed HTTP request (%s %s)", exc.code,
                          first[0] if first else type(exc).__name__)
            return False
        return True


# the HTTP server's own logger (web.AppRunner(logger=HTTP_LOG), server.py): client mistakes
# are one line, bugs keep their traceback (server side only)
HTTP_LOG = logging.getLogger("dpfleet.service.http")
HTTP_LOG.addFilter(_ClientMistakes())


@web.middleware
async def errors(request: web.Request, handler):
    """Every answer is JSON `{error, code}` (PROTOCOL.md); anything unexpected is one generic 500
    whose traceback goes to the coordinator's own log, never to the client."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _json({"error": str(exc), "code": exc.code}, exc.status, exc.headers)
    except AuthError as exc:
        return _json({"error": str(exc), "code": exc.code}, 401)
    except web.HTTPRequestEntityTooLarge as exc:
        return _json({"error": f"request body too large ({exc.text})", "code": "too_large"}, 413)
    except web.HTTPException:
        raise  # aiohttp's own answers (404 no route, 405 wrong method, ...)
    except Exception as exc:  # a bug: never a traceback to the client
        LOG.error("internal error on %s %s", request.method, request.path, exc_info=True)
        request.app[DRIVER].log.event("internal_error", path=request.path,
                                      error=type(exc).__name__)
        return _json({"error": "internal error", "code": "internal"}, 500)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(body: bytes):
    """A request body's JSON, or ValueError: not UTF-8 JSON, NaN / Infinity, or nested deeper
    than the parser's recursion allows (RecursionError would otherwise be a 500)."""
    try:
        return json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


async def device(request: web.Request) -> tuple[str, bytes]:
    """(device id, body) of an authenticated, rate-allowed device request."""
    ctx = request.app[CONTEXT]
    body = await request.read()  # bounded: client_max_size (413), read before any parsing
    key = request.app[DRIVER].keys.get(request.headers.get("X-Dpfleet-Device", ""))
    device_id = verify_request(request.headers, request.method, request.raw_path, body, key,
                               ctx["nonces"], sessions=ctx["sessions"])
    wait = ctx["limiter"].take(device_id)
    if wait:
        raise ApiError(429, "rate_limited", "too many requests from this device",
                       {"Retry-After": f"{max(1, round(wait))}"})
    return device_id, body


def _round_args(request: web.Request) -> tuple[int, int]:
    try:
        return int(request.match_info["round"]), int(request.query["attempt"])
    except (KeyError, ValueError):
        raise ApiError(400, "bad_round", "round and ?attempt= must be integers") from None


async def register(request: web.Request) -> web.Response:
    """Proof of possession: signed by the key being registered, so the body is parsed first (it
    names the key), but only for its shape (400s that say nothing about any device). Then every
    refusal, whatever its reason (unknown or held-out id, not the registry's key, an id another
    key holds, a bad signature, time or nonce), is ONE answer after the same work
    (`registration_refused`, `auth.verify_register`): no membership oracle."""
    ctx, driver = request.app[CONTEXT], request.app[DRIVER]
    body = await request.read()
    payload = _json_object(body, "bad_register", "register")
    device_id, key_hex = payload.get("device_id"), payload.get("public_key")
    try:
        if not isinstance(device_id, str) or not isinstance(key_hex, str):
            raise ValueError
        key = bytes.fromhex(key_hex)
        if len(key) != 32:
            raise ValueError
    except ValueError:
        raise ApiError(400, "bad_register",
                       "register needs {device_id: str, public_key: 32-byte hex}") from None
    proven = verify_register(request.headers, request.method, request.raw_path, body, key,
                             ctx["nonces"])
    admissible = driver.may_register(device_id, key)  # looked up on every path, too
    if proven != device_id or not admissible:
        raise registration_refused()
    wait = ctx["limiter"].take(device_id)
    if wait:
        raise ApiError(429, "rate_limited", "too many requests from this device",
                       {"Retry-After": f"{max(1, round(wait))}"})
    driver.register(device_id, key)
    return _json({"device_id": device_id, "registered": True})


def _json_object(body: bytes, code: str, what: str) -> dict:
    """A request body that must be one JSON object; anything else is a 400 with `code`."""
    try:
        payload = parse_json(body)
    except ValueError:
        raise ApiError(400, code, f"{what} body must be JSON") from None
    if not isinstance(payload, dict):
        raise ApiError(400, code, f"{what} body must be a JSON object")
    return payload


async def session(request: web.Request) -> web.Response:
    """Open a session (auth.py): only with the device's Ed25519 signature, never with a MAC."""
    if H_SIG not in request.headers:
        raise AuthError("a session is opened with the device's Ed25519 signature only")
    device_id, body = await device(request)
    payload = _json_object(body, "bad_session", "session")
    try:
        if len(bytes.fromhex(payload["x25519"])) != 32:
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise ApiError(400, "bad_session", "session needs {x25519: 32-byte public key hex}") from None
    return _json(request.app[CONTEXT]["sessions"].open(device_id, payload))


async def checkin(request: web.Request) -> web.Response:
    device_id, body = await device(request)
    payload = _json_object(body, "bad_checkin", "check-in")
    return _json(await request.app[DRIVER].checkin(device_id, payload))


async def blob(request: web.Request) -> web.Response:
    data = request.app[DRIVER].b.blobs.get(request.match_info["sha"])
    if data is None:
        raise ApiError(404, "no_such_blob", "no blob with this hash (only current plans' blobs)")
    return web.Response(body=data, content_type="application/octet-stream",
                        headers={"Cache-Control": "public, max-age=31536000, immutable"})


async def report(request: web.Request) -> web.Response:
    arrived = time.monotonic()  # the critical path's clock (rounds.OpenRound.critical)
    device_id, body = await device(request)
    number, attempt = _round_args(request)
    request.app[DRIVER].report(device_id, number, attempt, body, request.headers,
                               arrived)
    return _json({"accepted": True})


async def secagg_post(request: web.Request) -> web.Response:
    """One client message; with `&after=C` (PROTOCOL.md, merged posts) the reply is the
    device's mail from cursor C on, long-polled as GET would, instead of {"accepted": true}."""
    arrived = time.monotonic()  # the critical path's clock (rounds.OpenRound.critical)
    device_id, body = await device(request)
    number, attempt = _round_args(request)
    after = _cursor(request) if "after" in request.query else None
    mail = await request.app[DRIVER].secagg_post(device_id, number, attempt, body, arrived,
                                                 after, request.app[CONTEXT]["poll_s"])
    return _json({"accepted": True}) if mail is None else _frames(*mail)


def _cursor(request: web.Request) -> int:
    try:
        return int(request.query.get("after", "0"))
    except ValueError:
        raise ApiError(400, "bad_cursor", "after must be an integer") from None


def _frames(msgs: list[bytes], nxt: int, phase: str) -> web.Response:
    body = b"".join(struct.pack("<I", len(m)) + m for m in msgs)
    return web.Response(body=body, content_type="application/octet-stream",
                        headers={"X-Dpfleet-Next": str(nxt), "X-Dpfleet-Phase": phase})


async def secagg_get(request: web.Request) -> web.Response:
    device_id, _ = await device(request)
    number, attempt = _round_args(request)
    after = _cursor(request)
    return _frames(*await request.app[DRIVER].secagg_poll(
        device_id, number, attempt, after, request.app[CONTEXT]["poll_s"]))


async def round_status(request: web.Request) -> web.Response:
    await device(request)
    number, attempt = _round_args(request)
    return _json(request.app[DRIVER].round_status(number, attempt))


def admin(request: web.Request) -> RoundDriver:
    check_admin(request.headers.get("Authorization"), request.app[CONTEXT]["token"])
    return request.app[DRIVER]


async def admin_status(request: web.Request) -> web.Response:
    return _json(admin(request).status())


async def admin_history(request: web.Request) -> web.Response:
    return _json(admin(request).history_json())


async def admin_pause(request: web.Request) -> web.Response:
    driver = admin(request)
    driver.pause()
    return _json(driver.status())


async def admin_resume(request: web.Request) -> web.Response:
    driver = admin(request)
    driver.resume()
    return _json(driver.status())


async def admin_stop(request: web.Request) -> web.Response:
    driver = admin(request)
    driver.stop()
    return _json(driver.status())


async def admin_report(request: web.Request) -> web.Response:
    from dpfleet.service.admin import privacy_report

    return web.Response(text=privacy_report(admin(request)), content_type="text/markdown")


async def public_status(request: web.Request) -> web.Response:
    from dpfleet.service.admin import public_status as public

    return _json(public(request.app[DRIVER]))


def make_app(driver: RoundDriver, token: str, max_body_mb: float | None = None,
             poll_s: float = POLL_S) -> web.Application:
    svc = driver.cfg.service
    limit = int((max_body_mb or svc.max_body_mb) * 2**20)
    app = web.Application(client_max_size=limit, middlewares=[errors])
    app[DRIVER] = driver
    app[CONTEXT] = {"token": token, "nonces": NonceCache(), "poll_s": poll_s, "sessions": Sessions(),
                    "limiter": RateLimiter(svc.rate_per_s, svc.rate_burst), "created": time.time()}
    app.router.add_post("/v1/register", register)
    app.router.add_post("/v1/session", session)
    app.router.add_post("/v1/checkin", checkin)
    app.router.add_get("/v1/blobs/{sha}", blob)
    app.router.add_post("/v1/rounds/{round}/report", report)
    app.router.add_post("/v1/rounds/{round}/secagg", secagg_post)
    app.router.add_get("/v1/rounds/{round}/secagg", secagg_get)
    app.router.add_get("/v1/rounds/{round}/status", round_status)
    app.router.add_get("/v1/admin/status", admin_status)
    app.router.add_get("/v1/admin/history", admin_history)
    app.router.add_post("/v1/admin/pause", admin_pause)
    app.router.add_post("/v1/admin/resume", admin_resume)
    app.router.add_post("/v1/admin/stop", admin_stop)
    app.router.add_get("/v1/admin/report", admin_report)
    app.router.add_get("/v1/public/status", public_status)
    from dpfleet.service.admin import public_status as public

    add_status_routes(app, lambda: public(driver), lambda: public(driver))  # GET /: status_page.py
    return app
