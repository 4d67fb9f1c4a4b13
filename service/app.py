"""The HTTP routes (PROTOCOL.md) on aiohttp.web, mapped onto the round driver.

aiohttp.web because the coordinator is one asyncio process: long-polls (check-ins, SecAgg
mailboxes) are coroutines waiting on a condition, not threads, and no separate ASGI server is
needed (aiohttp is both the server and the devices' client).

Every device call is authenticated (`auth.verify_request`: an Ed25519 signature, or the HMAC
of a session opened with one at POST /v1/session) on the exact raw path and body,
rate-limited per device (`limits`), and bounded in size (`client_max_size`: 413) before its
body is parsed. The messages' shapes, paths and version are the wire protocol's
(`dpfleet.edge.wire`): a request naming another protocol version, or a body the protocol's
parsers refuse (malformed, NaN or too deeply nested JSON, a missing field), is a 400 with the
parser's one line. Register is the exception that proves possession of the key in its body,
and answers every refusal alike.
Admin calls need the bearer token and nothing else; public calls show only released aggregates
and counts. Anything unexpected is a generic 500 (`errors`), its traceback in our log only.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from dpfleet.edge.wire import messages as msg
from dpfleet.edge.wire import protocol as wire
from dpfleet.edge.wire.auth import H_DEVICE, H_SIG, AuthError
from dpfleet.jsonio import dumps
from dpfleet.service.auth import NonceCache, Sessions, check_admin, verify_register, verify_request
from dpfleet.service.limits import RateLimiter
from dpfleet.service.rounds import ApiError, HttpCollector, registration_refused
from dpfleet.service.status_page import add_status_routes

DRIVER = web.AppKey("driver", HttpCollector)
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
    whose traceback goes to the coordinator's own log, never to the client. A request in another
    protocol version is refused before anything of it is read (`wire.check_version`)."""
    try:
        wire.check_version(request.headers)
        return await handler(request)
    except ApiError as exc:
        return _json(msg.error_body(exc.code, str(exc)), exc.status, exc.headers)
    except AuthError as exc:
        return _json(msg.error_body(exc.code, str(exc)), 401)
    except wire.WireError as exc:
        return _json(msg.error_body(exc.code, str(exc)), exc.status)
    except web.HTTPRequestEntityTooLarge as exc:
        return _json(msg.error_body("too_large", f"request body too large ({exc.text})"), 413)
    except web.HTTPException:
        raise  # aiohttp's own answers (404 no route, 405 wrong method, ...)
    except Exception as exc:  # a bug: never a traceback to the client
        LOG.error("internal error on %s %s", request.method, request.path, exc_info=True)
        request.app[DRIVER].log.event("internal_error", path=request.path,
                                      error=type(exc).__name__)
        return _json(msg.error_body("internal", "internal error"), 500)


async def device(request: web.Request) -> tuple[str, bytes]:
    """(device id, body) of an authenticated, rate-allowed device request."""
    ctx = request.app[CONTEXT]
    body = await request.read()  # bounded: client_max_size (413), read before any parsing
    key = request.app[DRIVER].keys.get(request.headers.get(H_DEVICE, ""))
    device_id = verify_request(request.headers, request.method, request.raw_path, body, key,
                               ctx["nonces"], sessions=ctx["sessions"])
    wait = ctx["limiter"].take(device_id)
    if wait:
        raise ApiError(429, "rate_limited", "too many requests from this device",
                       {"Retry-After": f"{max(1, round(wait))}"})
    return device_id, body


async def register(request: web.Request) -> web.Response:
    """Proof of possession: signed by the key being registered, so the body is parsed first (it
    names the key), but only for its shape (400s that say nothing about any device). Then every
    refusal, whatever its reason (unknown or held-out id, not the registry's key, an id another
    key holds, a bad signature, time or nonce), is ONE answer after the same work
    (`registration_refused`, `auth.verify_register`): no membership oracle."""
    ctx, driver = request.app[CONTEXT], request.app[DRIVER]
    body = await request.read()
    device_id, key = msg.parse_register(msg.json_object(body, "bad_register", "register"))
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


async def session(request: web.Request) -> web.Response:
    """Open a session (auth.py): only with the device's Ed25519 signature, never with a MAC."""
    if H_SIG not in request.headers:
        raise AuthError("a session is opened with the device's Ed25519 signature only")
    device_id, body = await device(request)
    payload = msg.json_object(body, "bad_session", "session")
    msg.parse_session(payload)
    return _json(request.app[CONTEXT]["sessions"].open(device_id, payload))


async def checkin(request: web.Request) -> web.Response:
    device_id, body = await device(request)
    payload = msg.json_object(body, "bad_checkin", "check-in")
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
    number, attempt = msg.parse_round(request.match_info["round"], request.query)
    request.app[DRIVER].report(device_id, number, attempt, body, request.headers,
                               arrived)
    return _json({"accepted": True})


async def secagg_post(request: web.Request) -> web.Response:
    """One client message; with `&after=C` (PROTOCOL.md, merged posts) the reply is the
    device's mail from cursor C on, long-polled as GET would, instead of {"accepted": true}."""
    arrived = time.monotonic()  # the critical path's clock (rounds.OpenRound.critical)
    device_id, body = await device(request)
    number, attempt = msg.parse_round(request.match_info["round"], request.query)
    after = msg.parse_cursor(request.query) if "after" in request.query else None
    mail = await request.app[DRIVER].secagg_post(device_id, number, attempt, body, arrived,
                                                 after, request.app[CONTEXT]["poll_s"])
    return _json({"accepted": True}) if mail is None else _frames(*mail)


def _frames(msgs: list[bytes], nxt: int, phase: str) -> web.Response:
    return web.Response(body=wire.join_frames(msgs), content_type="application/octet-stream",
                        headers={wire.H_NEXT: str(nxt), wire.H_PHASE: phase})


async def secagg_get(request: web.Request) -> web.Response:
    device_id, _ = await device(request)
    number, attempt = msg.parse_round(request.match_info["round"], request.query)
    after = msg.parse_cursor(request.query)
    return _frames(*await request.app[DRIVER].secagg_poll(
        device_id, number, attempt, after, request.app[CONTEXT]["poll_s"]))


async def round_status(request: web.Request) -> web.Response:
    await device(request)
    number, attempt = msg.parse_round(request.match_info["round"], request.query)
    return _json(request.app[DRIVER].round_status(number, attempt))


def admin(request: web.Request) -> HttpCollector:
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


def make_app(driver: HttpCollector, token: str, max_body_mb: float | None = None,
             poll_s: float = POLL_S) -> web.Application:
    svc = driver.cfg.service
    limit = int((max_body_mb or svc.max_body_mb) * 2**20)
    app = web.Application(client_max_size=limit, middlewares=[errors])
    app[DRIVER] = driver
    app[CONTEXT] = {"token": token, "nonces": NonceCache(), "poll_s": poll_s, "sessions": Sessions(),
                    "limiter": RateLimiter(svc.rate_per_s, svc.rate_burst), "created": time.time()}
    app.router.add_post(wire.REGISTER, register)
    app.router.add_post(wire.SESSION, session)
    app.router.add_post(wire.CHECKIN, checkin)
    app.router.add_get(wire.BLOB_ROUTE, blob)
    app.router.add_post(wire.REPORT_ROUTE, report)
    app.router.add_post(wire.SECAGG_ROUTE, secagg_post)
    app.router.add_get(wire.SECAGG_ROUTE, secagg_get)
    app.router.add_get(wire.STATUS_ROUTE, round_status)
    app.router.add_get(f"{wire.ADMIN}/status", admin_status)
    app.router.add_get(f"{wire.ADMIN}/history", admin_history)
    app.router.add_post(f"{wire.ADMIN}/pause", admin_pause)
    app.router.add_post(f"{wire.ADMIN}/resume", admin_resume)
    app.router.add_post(f"{wire.ADMIN}/stop", admin_stop)
    app.router.add_get(f"{wire.ADMIN}/report", admin_report)
    app.router.add_get(wire.PUBLIC_STATUS, public_status)
    from dpfleet.service.admin import public_status as public

    add_status_routes(app, lambda: public(driver), lambda: public(driver))  # GET /: status_page.py
    return app
