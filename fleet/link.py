"""A device's link to the coordinator: signed HTTP requests with bounded, jittered retries.

Why here and not in the participant: every emulated phone (and any real client) talks the same
wire protocol (`dpfleet.edge.wire`, its PROTOCOL.md); the link is the one place that signs requests with the
device's Ed25519 key (or, once it opened a session with a signed handshake, MACs them with the
session key: one signature per coordinator process instead of one per request; a coordinator
without sessions gets signatures), checks downloaded blobs against their hashes, and retries what a flaky
network or a busy coordinator causes (transport errors, 429 with Retry-After, 503) with
exponential backoff and full jitter, so a thousand devices that lost the coordinator at once do
not come back in lock-step. Everything else (4xx) is the coordinator's answer and is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import ssl
from pathlib import Path

import aiohttp
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from yarl import URL

from dpfleet.edge.wire import messages as msg
from dpfleet.edge.wire import protocol as wire
from dpfleet.edge.wire.auth import AuthError, DeviceHandshake, mac_request, sign_request

RETRY_STATUS = (429, 503)


class LinkError(Exception):
    """The coordinator refused a request (status, code slug, message)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class CoordinatorLink:
    """One device's signed session with the coordinator at `url` (use as `async with`)."""

    def __init__(self, url: str, device_id: str, key: Ed25519PrivateKey, *,
                 ca_file: str | Path | None = None, retries: int = 6, backoff_s: float = 0.2,
                 max_backoff_s: float = 5.0, timeout_s: float = 60.0,
                 session: aiohttp.ClientSession | None = None, rng: random.Random | None = None,
                 sessions: bool = True, merge_posts: bool = True):
        self.url, self.device_id, self.key = url.rstrip("/"), device_id, key
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._ssl = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
        self._session, self._own_session = session, session is None
        self.rng = rng or random.Random()
        self._blob_cache: dict[str, bytes] = {}
        self.retried = 0  # requests sent again (transport error, 429, 503)
        self.sessions = sessions  # MAC requests under a session key (False: sign every request)
        self._auth: tuple[str, bytes] | None = None  # (session id, session key)
        self._auth_lock = asyncio.Lock()
        self.sessions_opened = 0
        # SecAgg posts that also carry the poll for the next mail (PROTOCOL.md, merged posts);
        # off by itself against a coordinator that answers them as plain posts
        self.merge_posts = merge_posts

    @property
    def public_key(self) -> bytes:
        return self.key.public_key().public_bytes_raw()

    async def __aenter__(self) -> CoordinatorLink:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _backoff(self, attempt: int, retry_after: str | None) -> float:
        cap = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        wait = self.rng.uniform(0, cap)  # full jitter
        if retry_after:
            with contextlib.suppress(ValueError):
                wait = max(wait, float(retry_after))
        return wait

    async def _open_session(self) -> None:
        """One Ed25519-signed handshake (`wire.auth.DeviceHandshake`); a coordinator without
        sessions (404) is from then on sent signed requests."""
        async with self._auth_lock:
            if self._auth is not None or not self.sessions:
                return
            handshake = DeviceHandshake(self.device_id)
            try:
                reply = await self._json("POST", wire.SESSION, handshake.body())
                self._auth = handshake.finish(reply)
            except LinkError as exc:
                if exc.status not in (404, 405):
                    raise
                self.sessions = False
            except AuthError as exc:
                raise LinkError(0, "bad_session", str(exc)) from None
            else:
                self.sessions_opened += 1

    def _auth_headers(self, method: str, path_qs: str, body: bytes) -> dict[str, str]:
        """A fresh nonce per try: a resent request is not a replay."""
        if self._auth is not None and path_qs.split("?")[0] not in wire.SIGNED_ONLY:
            return mac_request(self._auth[1], self._auth[0], self.device_id, method, path_qs, body)
        return sign_request(self.key, self.device_id, method, path_qs, body)

    async def request(self, method: str, path_qs: str, body: bytes = b"", *, signed: bool = True,
                      headers: dict | None = None, timeout_s: float | None = None
                      ) -> tuple[int, dict, bytes]:
        """(status, headers, body) of a 2xx answer; `LinkError` for any other final answer.
        A session the coordinator no longer knows (it restarted) is opened again, once."""
        if signed and self.sessions and path_qs.split("?")[0] not in wire.SIGNED_ONLY:
            if self._auth is None:
                await self._open_session()
            try:
                return await self._send(method, path_qs, body, signed, headers, timeout_s)
            except LinkError as exc:
                if exc.code != "unknown_session":
                    raise
                self._auth = None
                await self._open_session()
        return await self._send(method, path_qs, body, signed, headers, timeout_s)

    async def _send(self, method: str, path_qs: str, body: bytes, signed: bool,
                    headers: dict | None, timeout_s: float | None) -> tuple[int, dict, bytes]:
        if self._session is None:
            await self.__aenter__()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            hdrs = {**(headers or {}), wire.H_PROTOCOL: str(wire.VERSION)}
            if signed:
                hdrs.update(self._auth_headers(method, path_qs, body))
            retry_after = None
            try:
                async with self._session.request(
                        method, URL(self.url + path_qs, encoded=True), data=body or None,
                        headers=hdrs, ssl=self._ssl if self._ssl is not None else True,
                        timeout=aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None,
                ) as resp:
                    data = await resp.read()
                    if 200 <= resp.status < 300:
                        return resp.status, dict(resp.headers), data
                    if resp.status not in RETRY_STATUS:
                        raise _error(resp.status, data)
                    last, retry_after = _error(resp.status, data), resp.headers.get("Retry-After")
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                last = exc
            if attempt < self.retries:
                self.retried += 1
                await asyncio.sleep(self._backoff(attempt, retry_after))
        if isinstance(last, LinkError):
            raise last
        raise LinkError(0, "unreachable", f"{method} {path_qs}: {last!r}")

    async def _json(self, method: str, path_qs: str, payload: dict | None = None, **kw) -> dict:
        body = json.dumps(payload).encode() if payload is not None else b""
        _, _, data = await self.request(method, path_qs, body,
                                        headers={"Content-Type": "application/json"}, **kw)
        return json.loads(data)

    # ----------------------------------------------------------------- the device API

    async def register(self) -> dict:
        return await self._json("POST", wire.REGISTER, msg.register_body(self.device_id,
                                                                          self.public_key))

    async def checkin(self, *, charging: bool = True, idle: bool = True, unmetered: bool = True,
                      runtime: str = "eager", timer_expires_at: float | None = None) -> dict:
        """The coordinator's answer, checked for what the device reads (`LinkError` `bad_reply`)."""
        reply = await self._json("POST", wire.CHECKIN, msg.checkin_body(
            charging=charging, idle=idle, unmetered=unmetered, runtime=runtime,
            timer_expires_at=timer_expires_at))
        try:
            return msg.parse_checkin_reply(reply)
        except wire.WireError as exc:
            raise LinkError(exc.status, exc.code, str(exc)) from None

    async def blob(self, sha256: str) -> bytes:
        """A content-addressed blob, checked against its hash (cached: blobs never change)."""
        if sha256 in self._blob_cache:  # least recently used goes first
            self._blob_cache[sha256] = self._blob_cache.pop(sha256)
            return self._blob_cache[sha256]
        _, _, data = await self.request("GET", wire.blob_path(sha256), signed=False)
        if hashlib.sha256(data).hexdigest() != sha256:
            raise LinkError(0, "bad_blob", f"blob {sha256[:12]}... does not match its hash")
        self._blob_cache[sha256] = data
        if len(self._blob_cache) > 8:  # models of old rounds: keep only a few
            self._blob_cache.pop(next(iter(self._blob_cache)))
        return data

    async def report(self, round: int, attempt: int, delta: np.ndarray, *, norm: float,
                     clipped: bool, loss: float) -> dict:
        body = np.ascontiguousarray(delta, dtype="<f4").tobytes()
        _, _, data = await self.request("POST", wire.round_path(round, "report", attempt), body,
                                        headers=msg.report_headers(norm, clipped, loss))
        return json.loads(data)

    async def secagg_send(self, round: int, attempt: int, message: bytes) -> dict:
        _, _, data = await self.request("POST", wire.round_path(round, "secagg", attempt),
                                        message, headers={"Content-Type": "application/octet-stream"})
        return json.loads(data)

    async def secagg_send_poll(self, round: int, attempt: int, message: bytes, after: int
                               ) -> tuple[list[bytes], int, str] | None:
        """Send one client message and get the mail from cursor `after` on in the same request
        (PROTOCOL.md, merged posts): `secagg_poll`'s answer, or None from a coordinator that
        only accepted the message (it predates merged posts: poll as before)."""
        _, headers, data = await self.request(
            "POST", wire.round_path(round, "secagg", attempt, after), message,
            headers={"Content-Type": "application/octet-stream"}, timeout_s=90)
        if wire.H_NEXT not in headers:
            self.merge_posts = False
            return None
        return _mail(headers, data)

    async def secagg_poll(self, round: int, attempt: int, after: int
                          ) -> tuple[list[bytes], int, str]:
        """(messages for this device from cursor `after` on, the next cursor, server phase)."""
        _, headers, data = await self.request(
            "GET", wire.round_path(round, "secagg", attempt, after), timeout_s=90)
        return _mail(headers, data)

    async def round_status(self, round: int, attempt: int) -> dict:
        return await self._json("GET", wire.round_path(round, "status", attempt))


def split_frames(data: bytes) -> list[bytes]:
    """`u32 LE length + bytes` frames -> messages (`wire.split_frames`); a truncated frame is a
    `LinkError`, not skipped."""
    try:
        return wire.split_frames(data)
    except wire.WireError as exc:
        raise LinkError(0, exc.code, str(exc)) from None


def _mail(headers: dict, data: bytes) -> tuple[list[bytes], int, str]:
    """(messages, next cursor, server phase) of a SecAgg mailbox answer."""
    return split_frames(data), int(headers[wire.H_NEXT]), headers.get(wire.H_PHASE, "")


def _error(status: int, data: bytes) -> LinkError:
    return LinkError(status, *msg.parse_error(data))
