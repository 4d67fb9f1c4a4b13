"""The device link on its own, against a stand-in coordinator (an aiohttp app in this test that
stands in for `dpfleet service serve`'s misbehaviour): 503 and 429 are retried with
backoff (Retry-After honoured), other errors are raised with the coordinator's code, a blob
whose bytes do not match its hash is refused, SecAgg frames are split exactly, and every try
is signed afresh (a retry is never a replay)."""

import asyncio
import hashlib
import random
import struct

import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.edge.wire.auth import AuthError
from dpfleet.fleet.link import CoordinatorLink, LinkError, split_frames
from dpfleet.service.auth import NonceCache, verify_request


async def with_app(app, body):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        return await body(f"http://127.0.0.1:{runner.addresses[0][1]}")
    finally:
        await runner.cleanup()


def test_busy_coordinator_is_retried_and_each_try_is_signed_afresh():
    key = Ed25519PrivateKey.generate()
    pub = key.public_key().public_bytes_raw()
    nonces, answers, seen = NonceCache(), [503, 429, 200], []

    async def checkin(request):
        body = await request.read()
        seen.append(verify_request(request.headers, request.method, request.raw_path, body, pub,
                                   nonces))  # a reused nonce would raise AuthError here
        status = answers.pop(0)
        if status != 200:
            return web.json_response({"error": "busy", "code": "busy"}, status=status,
                                     headers={"Retry-After": "0"})
        return web.json_response({"kind": "retry", "after_s": 1.0, "reason": "no round open"})

    async def gone(request):
        return web.json_response({"error": "the run has finished", "code": "run_done"}, status=410)

    app = web.Application()
    app.router.add_post("/v1/checkin", checkin)
    app.router.add_get("/v1/rounds/1/status", gone)

    async def body(url):
        async with CoordinatorLink(url, "dev", key, backoff_s=0.01, rng=random.Random(0)) as link:
            reply = await link.checkin()
            with pytest.raises(LinkError) as exc:
                await link.round_status(1, 1)
            return reply, link.retried, exc.value

    reply, retried, error = asyncio.run(with_app(app, body))
    assert reply["kind"] == "retry" and retried == 2 and seen == ["dev"] * 3
    assert (error.status, error.code) == (410, "run_done")


def test_a_tampered_blob_is_refused_and_an_unreachable_coordinator_is_reported():
    good = b"model bytes"
    sha = hashlib.sha256(good).hexdigest()

    async def blob(request):
        return web.Response(body=good[:-1] + b"X")  # a cache or proxy that altered it

    app = web.Application()
    app.router.add_get("/v1/blobs/{sha}", blob)

    async def body(url):
        async with CoordinatorLink(url, "dev", Ed25519PrivateKey.generate()) as link:
            with pytest.raises(LinkError) as exc:
                await link.blob(sha)
            return exc.value

    assert asyncio.run(with_app(app, body)).code == "bad_blob"

    async def nowhere():
        async with CoordinatorLink("http://127.0.0.1:9", "dev", Ed25519PrivateKey.generate(),
                                   retries=2, backoff_s=0.01) as link:
            with pytest.raises(LinkError) as exc:
                await link.checkin()
            return exc.value, link.retried

    err, retried = asyncio.run(nowhere())
    assert err.code == "unreachable" and retried == 2


def test_the_link_says_its_version_and_refuses_a_reply_it_cannot_act_on():
    said, replies = [], [{"kind": "retry", "after_s": 0.5, "reason": "no round open"},
                         {"kind": "assignment", "round": 1}]

    async def checkin(request):
        said.append(request.headers.get("X-Dpfleet-Protocol"))
        return web.json_response(replies.pop(0))

    app = web.Application()
    app.router.add_post("/v1/checkin", checkin)

    async def body(url):
        async with CoordinatorLink(url, "dev", Ed25519PrivateKey.generate(), retries=0,
                                   sessions=False) as link:
            first = await link.checkin()
            with pytest.raises(LinkError) as exc:
                await link.checkin()
            return first, exc.value

    first, error = asyncio.run(with_app(app, body))
    assert said == ["1", "1"]
    assert first == {"kind": "retry", "after_s": 0.5, "reason": "no round open"}
    assert (error.status, error.code, error.message) == (
        0, "bad_reply", "assignment without attempt, position, model_sha256, plan_sha256, aggregation")


def test_frames_split_exactly_and_truncation_is_an_error():
    msgs = [b"", b"a", b"\x00" * 70000]
    data = b"".join(struct.pack("<I", len(m)) + m for m in msgs)
    assert split_frames(data) == msgs
    for cut in (1, 5, len(data) - 1):
        with pytest.raises(LinkError):
            split_frames(data[:cut])


def test_a_signature_covers_method_path_body_and_time():
    key = Ed25519PrivateKey.generate()
    pub = key.public_key().public_bytes_raw()
    from dpfleet.edge.wire.auth import sign_request

    headers = sign_request(key, "dev", "POST", "/v1/rounds/1/report?attempt=1", b"body")
    for method, path, body in (("GET", "/v1/rounds/1/report?attempt=1", b"body"),
                               ("POST", "/v1/rounds/1/report?attempt=2", b"body"),
                               ("POST", "/v1/rounds/1/report?attempt=1", b"bodY")):
        with pytest.raises(AuthError, match="bad request signature"):
            verify_request(headers, method, path, body, pub, NonceCache(not_before=0))
    old = sign_request(key, "dev", "POST", "/p", b"", now=1.0)
    with pytest.raises(AuthError, match="off the coordinator's clock"):
        verify_request(old, "POST", "/p", b"", pub, NonceCache(not_before=0))
    assert verify_request(headers, "POST", "/v1/rounds/1/report?attempt=1", b"body", pub,
                          NonceCache(not_before=0)) == "dev"
