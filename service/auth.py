"""Who is calling: device request signatures (Ed25519), replay refusal, and the admin token.

Why sign every request instead of a session token: a device's identity key is the one thing
the coordinator and the device's SecAgg peers already trust (it signs SecAgg messages and may
be pinned in a fleet registry), so a bearer token would be a second, weaker credential that
could be stolen and replayed. Each signature covers the method, path with query, a timestamp,
a random nonce and the body's hash; the server keeps every nonce it accepted for the clock
window, so a captured request cannot be sent again (a replay) nor moved to another path.
The admin token is a separate random secret: a device signature never authorizes an admin
call and the admin token never authorizes a device call.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

LABEL = b"dpfleet-request-v1"
CLOCK_WINDOW_S = 120.0
NONCE_BYTES = 16
H_DEVICE, H_TIME, H_NONCE, H_SIG = ("X-Dpfleet-Device", "X-Dpfleet-Time", "X-Dpfleet-Nonce",
                                     "X-Dpfleet-Signature")


class AuthError(Exception):
    """A request that proves no identity (401)."""


def signed_bytes(method: str, path_qs: str, time_s: str, nonce: str, body: bytes) -> bytes:
    """The exact bytes a device signs (PROTOCOL.md, request authentication)."""
    return b"\n".join([LABEL, method.upper().encode(), path_qs.encode(), time_s.encode(),
                       nonce.encode(), hashlib.sha256(body).hexdigest().encode()])


def sign_request(key: Ed25519PrivateKey, device_id: str, method: str, path_qs: str, body: bytes,
                 now: float | None = None) -> dict[str, str]:
    """The four authentication headers of one request."""
    time_s = repr(time.time() if now is None else now)
    nonce = secrets.token_hex(NONCE_BYTES)
    signature = key.sign(signed_bytes(method, path_qs, time_s, nonce, body))
    return {H_DEVICE: device_id, H_TIME: time_s, H_NONCE: nonce, H_SIG: signature.hex()}


class NonceCache:
    """Nonces accepted within the clock window; older ones can no longer pass the time check.
    Nonces live in memory only, so requests signed before `not_before` (this process's start)
    are refused: a request captured before a restart cannot be replayed after it."""

    def __init__(self, window_s: float = CLOCK_WINDOW_S, not_before: float | None = None):
        self.window_s = window_s
        self.not_before = time.time() if not_before is None else not_before
        self._seen: OrderedDict[str, float] = OrderedDict()

    def claim(self, nonce: str, now: float) -> bool:
        """True the first time a nonce is seen within the window, False for a replay."""
        while self._seen and next(iter(self._seen.values())) < now - 2 * self.window_s:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True


def verify_request(headers, method: str, path_qs: str, body: bytes, public_key: bytes | None,
                   nonces: NonceCache, now: float | None = None) -> str:
    """The device id a request proves, or `AuthError`. `public_key` is the key registered for
    the claimed id (None: unknown device)."""
    try:
        device, time_s, nonce, sig = (headers[h] for h in (H_DEVICE, H_TIME, H_NONCE, H_SIG))
    except KeyError as exc:
        raise AuthError(f"missing header {exc.args[0]}") from None
    now = time.time() if now is None else now
    try:
        skew = abs(float(time_s) - now)
        signature = bytes.fromhex(sig)
    except ValueError:
        raise AuthError("malformed time or signature") from None
    if not skew <= CLOCK_WINDOW_S:  # also refuses NaN
        raise AuthError(f"request time is {skew:.0f} s off the coordinator's clock")
    if float(time_s) < nonces.not_before:
        raise AuthError("request signed before this coordinator process started (sign it again)")
    if len(nonce) != 2 * NONCE_BYTES or not all(c in "0123456789abcdef" for c in nonce):
        raise AuthError("malformed nonce")
    if public_key is None:
        raise AuthError(f"unknown device {device!r}")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            signature, signed_bytes(method, path_qs, time_s, nonce, body))
    except (InvalidSignature, ValueError):
        raise AuthError("bad request signature") from None
    if not nonces.claim(nonce, now):
        raise AuthError("replayed request (nonce already used)")
    return device


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


def check_admin(authorization: str | None, token: str) -> None:
    """Constant-time bearer-token check; `AuthError` unless it is exactly the admin token."""
    prefix = "Bearer "
    if not authorization or not authorization.startswith(prefix):
        raise AuthError("admin call without 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(authorization[len(prefix):].encode(), token.encode()):
        raise AuthError("wrong admin token")
