"""Who is calling: device request signatures (Ed25519), replay refusal, and the admin token.

Why sign every request instead of a session token: a device's identity key is the one thing
the coordinator and the device's SecAgg peers already trust (it signs SecAgg messages and may
be pinned in a fleet registry), so a bearer token would be a second, weaker credential that
could be stolen and replayed. Each signature covers the method, path with query, a timestamp,
a random nonce and the body's hash; the server keeps every nonce it accepted for the clock
window, so a captured request cannot be sent again (a replay) nor moved to another path.
The admin token is a separate random secret: a device signature never authorizes an admin
call and the admin token never authorizes a device call.

Sessions (why): an Ed25519 verification costs the coordinator ~0.1-0.35 ms per request, and a
1,000-device fleet sends thousands of requests per round. So a device may, once per coordinator
process, open a session with an Ed25519-signed handshake that carries a fresh X25519 key; the
coordinator answers with its own fresh X25519 key and both derive a 32-byte session key
(HKDF-SHA256 over the X25519 secret, bound to the device id, the session id and both public
keys). Later requests carry an HMAC-SHA256 under that key over the same fields a signature
covers (plus the session id), with the same clock window, process-start rule and nonce cache.
Nothing else changes: the session key never crosses the wire (an eavesdropper learns nothing it
can use, and one that swaps the coordinator's reply shares a key with nobody), a session names
its device (another device's session is refused), sessions live in memory only (a restart ends
them all: the device opens a new one), and a device holds one session at a time.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
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
