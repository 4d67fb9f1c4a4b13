"""The bytes a device signs or MACs, and the device's half of the session handshake.

Why sign every request instead of a session token: a device's identity key is the one thing
the coordinator and the device's SecAgg peers already trust (it signs SecAgg messages and may
be pinned in a fleet registry), so a bearer token would be a second, weaker credential that
could be stolen and replayed. Each signature covers the method, path with query, a timestamp,
a random nonce and the body's hash (`signed_bytes`), so a captured request cannot be moved to
another path; the coordinator keeps every nonce it accepted for the clock window, so it cannot
be sent again either (the coordinator's checks: `dpfleet.service.auth`).

Sessions (why): an Ed25519 verification costs the coordinator ~0.1-0.35 ms per request, and a
1,000-device fleet sends thousands of requests per round. So a device may, once per coordinator
process, open a session with an Ed25519-signed handshake that carries a fresh X25519 key
(`DeviceHandshake`); the coordinator answers with its own fresh X25519 key and both derive a
32-byte session key (`session_key`: HKDF-SHA256 over the X25519 secret, bound to the device id,
the session id and both public keys). Later requests carry an HMAC-SHA256 under that key over
the same fields a signature covers plus the session id (`mac_bytes`). The session key never
crosses the wire: an eavesdropper learns nothing it can use, and one that swaps the
coordinator's reply shares a key with nobody.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

LABEL = b"dpfleet-request-v1"
CLOCK_WINDOW_S = 120.0
NONCE_BYTES = 16
H_DEVICE, H_TIME, H_NONCE, H_SIG = ("X-Dpfleet-Device", "X-Dpfleet-Time", "X-Dpfleet-Nonce",
                                     "X-Dpfleet-Signature")


H_SESSION, H_MAC = "X-Dpfleet-Session", "X-Dpfleet-Mac"
MAC_LABEL = b"dpfleet-request-mac-v1"
SESSION_LABEL = b"dpfleet-session-v1"
SESSION_ID_BYTES = 16


class AuthError(Exception):
    """A request that proves no identity (401); `code` "unknown_session" tells a device that
    its session is gone (the coordinator restarted, or it opened a newer one): open another."""

    def __init__(self, message: str, code: str = "unauthorized"):
        super().__init__(message)
        self.code = code


def signed_bytes(method: str, path_qs: str, time_s: str, nonce: str, body: bytes) -> bytes:
    """The exact bytes a device signs (PROTOCOL.md, request authentication)."""
    return b"\n".join([LABEL, _utf8(method.upper()), _utf8(path_qs), _utf8(time_s), _utf8(nonce),
                       hashlib.sha256(body).hexdigest().encode()])


def _utf8(text: str) -> bytes:
    """UTF-8 that never raises: a header or raw path a client sent as undecodable bytes reaches
    us with surrogates, which then only fail the signature (never a 500); a well-formed string
    encodes exactly as `str.encode()`, which is what devices sign."""
    return text.encode("utf-8", "surrogatepass")


def sign_request(key: Ed25519PrivateKey, device_id: str, method: str, path_qs: str, body: bytes,
                 now: float | None = None) -> dict[str, str]:
    """The four authentication headers of one request."""
    time_s = repr(time.time() if now is None else now)
    nonce = secrets.token_hex(NONCE_BYTES)
    signature = key.sign(signed_bytes(method, path_qs, time_s, nonce, body))
    return {H_DEVICE: device_id, H_TIME: time_s, H_NONCE: nonce, H_SIG: signature.hex()}


def mac_bytes(session_id: str, method: str, path_qs: str, time_s: str, nonce: str,
              body: bytes) -> bytes:
    """The exact bytes a session request's HMAC covers (PROTOCOL.md, sessions)."""
    return MAC_LABEL + b"\n" + _utf8(session_id) + b"\n" + signed_bytes(
        method, path_qs, time_s, nonce, body).split(b"\n", 1)[1]


def mac_request(key: bytes, session_id: str, device_id: str, method: str, path_qs: str,
                body: bytes, now: float | None = None) -> dict[str, str]:
    """The authentication headers of one session request (HMAC-SHA256 under the session key)."""
    time_s = repr(time.time() if now is None else now)
    nonce = secrets.token_hex(NONCE_BYTES)
    mac = hmac.new(key, mac_bytes(session_id, method, path_qs, time_s, nonce, body), "sha256")
    return {H_DEVICE: device_id, H_TIME: time_s, H_NONCE: nonce, H_SESSION: session_id,
            H_MAC: mac.hexdigest()}


def session_key(shared: bytes, device_id: str, session_id: str, device_public: bytes,
                server_public: bytes) -> bytes:
    """Both sides' session key: HKDF-SHA256 of the X25519 secret, bound to who and which keys."""
    info = b"\n".join([SESSION_LABEL, device_id.encode(), session_id.encode(),
                       device_public.hex().encode(), server_public.hex().encode()])
    return HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(shared)


class DeviceHandshake:
    """The device's half of opening a session: `body()` is what it sends (Ed25519-signed, like
    every handshake), `finish(reply)` the (session id, key) it then MACs requests with."""

    def __init__(self, device_id: str):
        self.device_id = device_id
        self._key = X25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes_raw()

    def body(self) -> dict:
        return {"x25519": self.public.hex()}

    def finish(self, reply: dict) -> tuple[str, bytes]:
        try:
            session_id, server_public = str(reply["session"]), bytes.fromhex(reply["x25519"])
            shared = self._key.exchange(X25519PublicKey.from_public_bytes(server_public))
        except (KeyError, TypeError, ValueError) as exc:
            raise AuthError(f"malformed session reply: {exc}") from None
        return session_id, session_key(shared, self.device_id, session_id, self.public,
                                       server_public)
