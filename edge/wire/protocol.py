"""The protocol's version, its URL paths, its SecAgg mail framing, and the files a coordinator's
state directory shares with its fleet.

Versions: every path is under `/v{VERSION}/`, and a client may say which version it speaks in
the `X-Dpfleet-Protocol` header. A coordinator answers a request that names another version with
one 400 `bad_protocol` line saying which version it speaks, before it authenticates or parses
anything: a message of another version is never read with this version's rules (its fields
could mean something else). A request without the header is taken as this version (clients
written before the header existed speak it). The device's link sends the header on every
request and raises the refusal like any other answer.
"""

from __future__ import annotations

import struct

VERSION = 1
H_PROTOCOL = "X-Dpfleet-Protocol"
PREFIX = f"/v{VERSION}"

# the device API
REGISTER = f"{PREFIX}/register"
SESSION = f"{PREFIX}/session"
CHECKIN = f"{PREFIX}/checkin"
SIGNED_ONLY = (REGISTER, SESSION)  # proof of possession: always the identity key, never a MAC


def blob_path(sha256: str) -> str:
    return f"{PREFIX}/blobs/{sha256}"


def round_path(round: int, what: str, attempt: int, after: int | None = None) -> str:
    """`/v1/rounds/{round}/{what}?attempt=A[&after=C]` (what: report, secagg, status)."""
    tail = "" if after is None else f"&after={after}"
    return f"{PREFIX}/rounds/{round}/{what}?attempt={attempt}{tail}"


# the service's route patterns (aiohttp's `{name}` syntax)
BLOB_ROUTE = f"{PREFIX}/blobs/{{sha}}"
REPORT_ROUTE = f"{PREFIX}/rounds/{{round}}/report"
SECAGG_ROUTE = f"{PREFIX}/rounds/{{round}}/secagg"
STATUS_ROUTE = f"{PREFIX}/rounds/{{round}}/status"

# the admin and public API
ADMIN = f"{PREFIX}/admin"
PUBLIC_STATUS = f"{PREFIX}/public/status"

# a plain report's statistics and the SecAgg mail's cursor and phase, as headers
H_NORM, H_CLIPPED, H_LOSS = "X-Dpfleet-Norm", "X-Dpfleet-Clipped", "X-Dpfleet-Loss"
H_NEXT, H_PHASE = "X-Dpfleet-Next", "X-Dpfleet-Phase"

# what `service serve` writes into its state directory for the fleet and the operator
ADMIN_FILE = "admin.json"  # {url, token, pid, tls_cert}, mode 0600
PLAN_FILE = "plan.json"  # dp.target_epsilon: the plan of the first start, as `simulate` writes it
PUBLIC_FILE = "bundle_key.pub"  # the run bundle's public key, which devices pin (PEM)


class WireError(ValueError):
    """A message that breaks the protocol: `status` and `code` are the HTTP answer a coordinator
    gives it (400 unless said), the message is one line saying what is wrong."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


def check_version(headers) -> None:
    """`WireError` (400 `bad_protocol`) for a request that names a version other than this one."""
    said = headers.get(H_PROTOCOL)
    if said is not None and said.strip() != str(VERSION):
        raise WireError("bad_protocol", f"protocol version {said.strip()[:16]!r} is not spoken "
                                        f"here: this coordinator speaks version {VERSION}")


def join_frames(messages: list[bytes]) -> bytes:
    """Messages -> one body of `u32 LE length + bytes` frames (a SecAgg mailbox's answer)."""
    return b"".join(struct.pack("<I", len(m)) + m for m in messages)


def split_frames(data: bytes) -> list[bytes]:
    """`u32 LE length + bytes` frames -> messages; a truncated frame is an error, not skipped."""
    out, at = [], 0
    while at < len(data):
        if at + 4 > len(data):
            raise WireError("bad_frame", "truncated SecAgg frame header")
        (n,) = struct.unpack_from("<I", data, at)
        if at + 4 + n > len(data):
            raise WireError("bad_frame", "truncated SecAgg frame")
        out.append(data[at + 4:at + 4 + n])
        at += 4 + n
    return out
