"""Who is calling, as the coordinator checks it: request signatures and session MACs (the bytes
they cover: `dpfleet.edge.wire.auth`), replay refusal, open sessions, and the admin token.

The server keeps every nonce it accepted for the clock window, so a captured request cannot be
sent again (a replay). The admin token is a separate random secret: a device signature never
authorizes an admin call and the admin token never authorizes a device call. Sessions live in
memory only (a restart ends them all: the device opens a new one), a session names its device
(another device's session is refused), and a device holds one session at a time.
"""

from __future__ import annotations

import hmac
import math
import secrets
import time
from collections import OrderedDict

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from dpfleet.edge.wire.auth import (
    CLOCK_WINDOW_S,
    H_DEVICE,
    H_MAC,
    H_NONCE,
    H_SESSION,
    H_SIG,
    H_TIME,
    NONCE_BYTES,
    SESSION_ID_BYTES,
    AuthError,
    mac_bytes,
    session_key,
    signed_bytes,
)


class Sessions:
    """The coordinator's open sessions, in memory only: one per device (a new handshake ends
    the device's previous session), none across a restart."""

    def __init__(self):
        self._by_id: dict[str, tuple[str, bytes]] = {}  # session id -> (device id, key)
        self._of_device: dict[str, str] = {}

    def open(self, device_id: str, body: dict) -> dict:
        """A new session for a device whose handshake signature was verified; the reply."""
        try:
            device_public = bytes.fromhex(body["x25519"])
            peer = X25519PublicKey.from_public_bytes(device_public)
        except (KeyError, TypeError, ValueError):
            raise AuthError("session handshake needs {x25519: 32-byte public key hex}") from None
        mine = X25519PrivateKey.generate()
        server_public = mine.public_key().public_bytes_raw()
        try:
            shared = mine.exchange(peer)
        except ValueError:  # a low-order point: no shared secret
            raise AuthError("session handshake with an invalid X25519 key") from None
        session_id = secrets.token_hex(SESSION_ID_BYTES)
        old = self._of_device.pop(device_id, None)
        if old is not None:
            self._by_id.pop(old, None)
        self._by_id[session_id] = (device_id, session_key(shared, device_id, session_id,
                                                          device_public, server_public))
        self._of_device[device_id] = session_id
        return {"session": session_id, "x25519": server_public.hex()}

    def lookup(self, session_id: str) -> tuple[str, bytes] | None:
        return self._by_id.get(session_id)

    def __len__(self) -> int:
        return len(self._by_id)


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
                   nonces: NonceCache, now: float | None = None,
                   sessions: Sessions | None = None) -> str:
    """The device id a request proves, or `AuthError`. `public_key` is the key registered for
    the claimed id (None: unknown device). With `sessions`, a request may instead carry a
    session id and HMAC (same time, nonce and replay rules)."""
    session_id = headers.get(H_SESSION) if sessions is not None else None
    mac_mode = session_id is not None and H_SIG not in headers
    try:
        device, time_s, nonce, sig = (headers[h] for h in (
            H_DEVICE, H_TIME, H_NONCE, H_MAC if mac_mode else H_SIG))
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
    if mac_mode:
        _check_mac(sessions, session_id, device, signature,
                   mac_bytes(session_id, method, path_qs, time_s, nonce, body))
    else:  # an unknown id costs the same verification and gets the same answer as a wrong key
        _check_signature(public_key or _NOBODY, signature,
                         signed_bytes(method, path_qs, time_s, nonce, body), public_key is not None)
    if not nonces.claim(nonce, now):
        raise AuthError("replayed request (nonce already used)")
    return device


def _check_mac(sessions: Sessions, session_id: str, device: str, mac: bytes, data: bytes) -> None:
    found = sessions.lookup(session_id)
    if found is None:
        raise AuthError("unknown or ended session (open a new one)", "unknown_session")
    owner, key = found
    if owner != device:
        raise AuthError("this session belongs to another device")
    if not hmac.compare_digest(mac, hmac.new(key, data, "sha256").digest()):
        raise AuthError("bad request MAC")


_NOBODY = Ed25519PrivateKey.generate().public_key().public_bytes_raw()  # nobody holds its key


def _signature_ok(public_key: bytes, signature: bytes, data: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def _check_signature(public_key: bytes, signature: bytes, data: bytes, known: bool = True) -> None:
    if not _signature_ok(public_key, signature, data) or not known:
        raise AuthError("bad request signature")


def verify_register(headers, method: str, path_qs: str, body: bytes, public_key: bytes,
                    nonces: NonceCache, now: float | None = None) -> str | None:
    """The device id a register request proves possession of `public_key` for (the key it
    registers signed it), or None. Every check runs whatever fails first, the Ed25519
    verification always, so a refused register costs the same work whatever the reason (the
    caller answers every refusal alike: no membership oracle, by answer or by time)."""
    now = time.time() if now is None else now
    device, time_s, nonce, sig = (str(headers.get(h, "")) for h in (H_DEVICE, H_TIME, H_NONCE,
                                                                    H_SIG))
    ok = H_SIG in headers and H_MAC not in headers  # a session MAC proves nothing about the key
    try:
        signature = bytes.fromhex(sig)
    except ValueError:
        signature, ok = bytes(64), False
    try:
        stamp = float(time_s)
    except ValueError:
        stamp, ok = math.nan, False
    ok &= _signature_ok(public_key, signature, signed_bytes(method, path_qs, time_s, nonce, body))
    ok &= abs(stamp - now) <= CLOCK_WINDOW_S and stamp >= nonces.not_before  # NaN fails both
    ok &= len(nonce) == 2 * NONCE_BYTES and all(c in "0123456789abcdef" for c in nonce)
    return device if ok and nonces.claim(nonce, now) else None


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


def check_admin(authorization: str | None, token: str) -> None:
    """Constant-time bearer-token check; `AuthError` unless it is exactly the admin token."""
    prefix = "Bearer "
    if not authorization or not authorization.startswith(prefix):
        raise AuthError("admin call without 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(authorization[len(prefix):].encode(), token.encode()):
        raise AuthError("wrong admin token")
