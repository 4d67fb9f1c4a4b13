"""A `RoundSetup` as bytes, for a coordinator that sends it to devices over a network.

Why its own encoding: the setup is what every party's `setup_hash` is computed from, so the
device must rebuild exactly the object the server holds (fields, session id, identity keys in
client order) and nothing else; a strict fixed layout with no optional parts leaves no room
for two readings. The device still trusts none of it: `ClientPolicy.check` judges the decoded
setup against its local minimums and its pinned keys.
"""

from __future__ import annotations

import struct

from dpfleet.secagg.crypto import KEY_BYTES
from dpfleet.secagg.errors import ProtocolViolationError
from dpfleet.secagg.params import SESSION_BYTES, TERMS_BYTES, RoundSetup

MAGIC = b"DPSU"
VERSION = 1  # version 2: the same, then the 32-byte `terms` digest before the identity list
VERSION_TERMS = 2
# version 3: `unrevealed` (uint32) and whether a terms digest follows (0/1), then as version 2
VERSION_UNREVEALED = 3
_FIXED = struct.Struct(f"<4sBIIIIQIB{SESSION_BYTES}s")
_SLACK = struct.Struct("<IB")


def encode_setup(setup: RoundSetup) -> bytes:
    version = (VERSION_UNREVEALED if setup.unrevealed else
               VERSION_TERMS if setup.terms else VERSION)
    head = _FIXED.pack(MAGIC, version, setup.n, setup.k, setup.threshold, setup.corrupt,
                       setup.length, setup.bits, setup.signed, setup.session_id)
    if version == VERSION_UNREVEALED:
        head += _SLACK.pack(setup.unrevealed, bool(setup.terms))
    head += setup.terms
    if not setup.signed:
        return head
    return head + b"".join(setup.identities[u] for u in range(setup.n))


def decode_setup(data: bytes) -> RoundSetup:
    """The setup, or `ProtocolViolationError` for anything but exactly one well-formed setup."""
    if len(data) < _FIXED.size:
        raise ProtocolViolationError("round setup too short")
    magic, version, n, k, t, c, length, bits, signed, session = _FIXED.unpack_from(data)
    if magic != MAGIC or version not in (VERSION, VERSION_TERMS, VERSION_UNREVEALED) or (
            signed not in (0, 1)):
        raise ProtocolViolationError("not a version-1, -2 or -3 round setup")
    rest = data[_FIXED.size:]
    terms, unrevealed, has_terms = b"", 0, version == VERSION_TERMS
    if version == VERSION_UNREVEALED:
        if len(rest) < _SLACK.size:
            raise ProtocolViolationError("version-3 round setup too short")
        unrevealed, has_terms = _SLACK.unpack_from(rest)
        rest = rest[_SLACK.size:]
        if unrevealed == 0 or has_terms not in (0, 1):  # one encoding per setup
            raise ProtocolViolationError("version-3 round setup with a malformed slack field")
    if has_terms:
        terms, rest = rest[:TERMS_BYTES], rest[TERMS_BYTES:]
        if len(terms) != TERMS_BYTES:
            raise ProtocolViolationError("round setup without its terms digest")
    if len(rest) != (n * KEY_BYTES if signed else 0):
        raise ProtocolViolationError("round setup has the wrong length for its identity list")
    identities = ({u: rest[u * KEY_BYTES:(u + 1) * KEY_BYTES] for u in range(n)}
                  if signed else None)
    try:
        return RoundSetup(n=n, k=k, threshold=t, length=length, bits=bits, corrupt=c,
                          identities=identities, session_id=session, terms=terms,
                          unrevealed=unrevealed)
    except ValueError as exc:
        raise ProtocolViolationError(f"invalid round setup: {exc}") from None
