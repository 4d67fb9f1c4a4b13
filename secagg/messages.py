"""Typed SecAgg messages and their versioned binary encoding.

Every message is a header followed by a type-specific body and, in the signed
(malicious-server) mode, an Ed25519 signature that covers all preceding bytes:

    magic "DPSA" | version u8 | type u8 | flags u8 | setup hash 32 bytes | sender u32 |
    recipient u32 | body ... | [signature 64 bytes if flags & SIGNED]

The setup hash (`RoundSetup.setup_hash`) names the round attempt and every parameter of it, so
a message from another attempt, or from a party holding another setup, is refused on its header
and every signature covers the whole setup.
What Ed25519 signs is `signature_input`: a fixed label, the verifier's setup hash and the
SHA-256 digest of every byte before the signature (version 3; version 2 signed the raw bytes).
Ed25519 hashes its input with SHA-512 twice to sign and once to verify, which over a 4 MB
masked vector cost 15 ms per client and 10 ms per message at the server; one SHA-256 pass
(OpenSSL, SHA-NI) costs 2.4 ms. Forging then needs an Ed25519 forgery or a SHA-256 collision
or second preimage: 128-bit security, Ed25519's own level.
All integers are little-endian; byte strings and lists carry a u32 length/count; vectors carry a
width code and a u64 element count followed by their raw little-endian elements. Decoding is
strict: a truncated message, trailing bytes, an unknown version/type/flag or a length that
overruns the buffer all raise `DecodeError` and nothing else, so the decoder can be fed
arbitrary bytes from the network. Whole signed messages are forwarded verbatim inside
`KeyBroadcast`, so a client can check the original author's signature itself instead of
trusting the server. Survivor lists travel as bitmaps, and the consistency proof in
`UnmaskRequest` as (signer, 64-byte signature) pairs over the one survivor list it carries: a
client rebuilds each signer's `ConsistencySignature` bytes and checks them (`signed_part`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dpfleet.secagg.errors import (
    AuthenticationError,
    DecodeError,
    MisaddressedError,
    RoundMismatchError,
)

MAGIC = b"DPSA"
VERSION = 3
SIGNATURE_LABEL = b"dpfleet/secagg/signature/v3\0"
SIGNED = 0x01
SIGNATURE_BYTES = 64
SERVER = 0xFFFF_FFFF  # the server's party id in headers
CONTEXT_BYTES = 32
_HEADER = struct.Struct("<4sBBB32sII")
HEADER_BYTES = _HEADER.size


class Outbound(NamedTuple):
    """A message a state machine wants delivered: to whom, and its encoded bytes."""

    recipient: int
    data: bytes


Buffer = bytes | memoryview


class _Writer:
    """Collects the encoded pieces; large ones stay views of their arrays until the one
    final join, so a multi-MB vector is copied once."""

    def __init__(self) -> None:
        self.parts: list[Buffer] = []

    def u8(self, v: int) -> None:
        self.parts.append(struct.pack("<B", v))

    def u32(self, v: int) -> None:
        self.parts.append(struct.pack("<I", v))

    def u64(self, v: int) -> None:
        self.parts.append(struct.pack("<Q", v))

    def blob(self, b: bytes) -> None:
        self.u32(len(b))
        self.parts.append(bytes(b))

    def ids(self, ids: tuple[int, ...]) -> None:
        self.u32(len(ids))
        self.parts.append(np.asarray(ids, dtype="<u4").tobytes())

    def bitmap(self, ids: tuple[int, ...]) -> None:
        """Sorted unique ids as a bitmap of max(ids) + 1 bits (bit i of byte i // 8)."""
        if list(ids) != sorted(set(ids)):
            raise ValueError("a survivor list must be sorted, unique ids")
        size = ids[-1] + 1 if ids else 0
        bits = np.zeros(size, dtype=np.uint8)
        bits[list(ids)] = 1
        self.u32(size)
        self.parts.append(np.packbits(bits, bitorder="little").tobytes())

    def pairs(self, pairs: tuple[tuple[int, bytes], ...]) -> None:
        self.u32(len(pairs))
        for party, b in pairs:
            self.u32(party)
            self.blob(b)

    def blobs(self, blobs: tuple[bytes, ...]) -> None:
        self.u32(len(blobs))
        for b in blobs:
            self.blob(b)


class _Reader:
    def __init__(self, data: bytes, start: int, end: int) -> None:
        self.data, self.pos, self.end = data, start, end

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.end:
            raise DecodeError("message is truncated")
        at = self.pos
        self.pos += n
        return at

    def u8(self) -> int:
        return self.data[self.take(1)]

    def u32(self) -> int:
        return struct.unpack_from("<I", self.data, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.data, self.take(8))[0]

    def raw(self, n: int) -> bytes:
        at = self.take(n)
        return self.data[at : at + n]

    def view(self, n: int) -> memoryview:
        """The next n bytes without copying them (for multi-MB vectors)."""
        at = self.take(n)
        return memoryview(self.data)[at : at + n]

    def blob(self) -> bytes:
        return self.raw(self.u32())

    def count(self, min_item_bytes: int) -> int:
        n = self.u32()
        if n * min_item_bytes > self.end - self.pos:
            raise DecodeError("list count overruns the message")
        return n

    def ids(self) -> tuple[int, ...]:
        n = self.count(4)
        at = self.take(4 * n)
        return tuple(np.frombuffer(self.data, dtype="<u4", count=n, offset=at).tolist())

    def bitmap(self) -> tuple[int, ...]:
        size = self.u32()
        bits = np.unpackbits(np.frombuffer(self.raw(-(-size // 8)), dtype=np.uint8),
                             bitorder="little")
        if bits[size:].any() or (size and not bits[size - 1]):
            raise DecodeError("survivor bitmap is not in canonical form")
        return tuple(np.flatnonzero(bits).tolist())

    def pairs(self) -> tuple[tuple[int, bytes], ...]:
        return tuple((self.u32(), self.blob()) for _ in range(self.count(8)))

    def blobs(self) -> tuple[bytes, ...]:
        return tuple(self.blob() for _ in range(self.count(4)))

    def done(self) -> None:
        if self.pos != self.end:
            raise DecodeError(f"{self.end - self.pos} trailing bytes")


@dataclass(frozen=True)
class Message:
    """Header fields shared by all messages."""

    context: bytes  # the setup hash
    sender: int
    recipient: int
    TYPE: ClassVar[int] = 0

    def _write(self, w: _Writer) -> None:
        raise NotImplementedError

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> Message:
        raise NotImplementedError


@dataclass(frozen=True)
class SeedCommit(Message):
    """Round -1, client -> server: a commitment to the client's graph-seed randomness."""

    commitment: bytes
    TYPE: ClassVar[int] = 11

    def _write(self, w: _Writer) -> None:
        w.blob(self.commitment)

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> SeedCommit:
        return cls(*header, r.blob())


@dataclass(frozen=True)
class SeedCommitments(Message):
    """Round -1, server -> client: every committed client's commitment, fixed before any
    reveal, so nobody can choose its randomness after seeing another's."""

    commitments: tuple[tuple[int, bytes], ...]  # (client, commitment), sorted
    TYPE: ClassVar[int] = 12

    def _write(self, w: _Writer) -> None:
        w.pairs(self.commitments)

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> SeedCommitments:
        return cls(*header, r.pairs())


@dataclass(frozen=True)
class AdvertiseKeys(Message):
    """Round 0, client -> server: the two X25519 public keys (share encryption, masking) and
    the opening of the client's graph-seed commitment."""

    c_public: bytes
    s_public: bytes
    reveal: bytes
    TYPE: ClassVar[int] = 1

    def _write(self, w: _Writer) -> None:
        w.blob(self.c_public)
        w.blob(self.s_public)
        w.blob(self.reveal)

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> AdvertiseKeys:
        return cls(*header, r.blob(), r.blob(), r.blob())


@dataclass(frozen=True)
class KeyBroadcast(Message):
    """Round 1, server -> client: every committed client's reveal (to derive the graph) and
    the neighbours' AdvertiseKeys messages, verbatim."""

    reveals: tuple[tuple[int, bytes], ...]  # (client, reveal), sorted
    adverts: tuple[bytes, ...]
    TYPE: ClassVar[int] = 2

    def _write(self, w: _Writer) -> None:
        w.pairs(self.reveals)
        w.blobs(self.adverts)

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> KeyBroadcast:
        return cls(*header, r.pairs(), r.blobs())


@dataclass(frozen=True)
class ShareKeys(Message):
    """Round 1, client -> server: a SHA-256 commitment to the self-mask seed and, per
    neighbour, the AES-GCM sealed Shamir shares of the masking key and of that seed."""

    commitment: bytes
    shares: tuple[tuple[int, bytes], ...]  # (recipient, sealed)
    TYPE: ClassVar[int] = 3

    def _write(self, w: _Writer) -> None:
        w.blob(self.commitment)
        w.pairs(self.shares)

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> ShareKeys:
        return cls(*header, r.blob(), r.pairs())


@dataclass(frozen=True)
class SharesForward(Message):
    """Round 2, server -> client: the sealed shares addressed to this client."""

    shares: tuple[tuple[int, bytes], ...]  # (owner, sealed)
    TYPE: ClassVar[int] = 4

    def _write(self, w: _Writer) -> None:
        w.pairs(self.shares)

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> SharesForward:
        return cls(*header, r.pairs())


@dataclass(frozen=True, eq=False)
class MaskedInput(Message):
    """Round 2, client -> server: y = x + PRG(b_u) + sum_v +-PRG(s_uv) in Z_(2^bits), packed
    to `bits` bits per element (`pack_bits`), so a 20-bit ring costs 20 bits per coordinate
    on the wire, not 32."""

    vector: np.ndarray
    bits: int = 32
    TYPE: ClassVar[int] = 5

    def _write(self, w: _Writer) -> None:
        v = np.ascontiguousarray(self.vector)
        if v.dtype.kind != "u" or v.ndim != 1 or not 1 <= self.bits <= 8 * v.dtype.itemsize:
            raise ValueError("masked input must be a 1-D unsigned vector wide enough for bits")
        w.u8(self.bits)
        w.u64(v.size)
        w.parts.append(pack_bits(v, self.bits))

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> MaskedInput:
        bits = r.u8()
        if not 1 <= bits <= 32:
            raise DecodeError(f"ring width {bits} outside 1..32 bits")
        size = r.u64()
        if size > 8 * (r.end - r.pos) // bits:
            raise DecodeError("vector overruns the message")
        packed = r.view(packed_size(size, bits))
        return cls(*header, unpack_bits(packed, size, bits), bits)


def _dtype(bits: int) -> np.dtype:
    return np.dtype("u1" if bits <= 8 else "<u2" if bits <= 16 else "<u4")


def packed_size(size: int, bits: int) -> int:
    """Bytes of `size` packed `bits`-bit fields: whole bytes, then the leftover bit planes."""
    return size * (bits // 8) + -(-size * (bits % 8) // 8)


def pack_bits(values: np.ndarray, bits: int) -> Buffer:
    """`values` (each < 2^bits) in `bits` bits each: the low 8 * (bits // 8) bits as whole
    little-endian bytes, then the remaining bits % 8 high bits of every element as a packed
    bit stream (zero-padded to a byte). At most one byte more than size * bits / 8.
    8/16/32-bit rings come back as a byte view of the (little-endian) array, not a copy."""
    if values.size and bits < 8 * values.dtype.itemsize and int(values.max()) >> bits:
        raise ValueError(f"masked input element does not fit in {bits} bits")
    if bits in (8, 16, 32):  # whole machine words: the ring dtype's bytes as they are
        return memoryview(np.ascontiguousarray(values.astype(_dtype(bits), copy=False))
                          ).cast("B")
    whole, rest = divmod(bits, 8)
    raw = values.astype("<u4").view(np.uint8).reshape(-1, 4)
    out = raw[:, :whole].tobytes()
    if rest:
        high = np.unpackbits(raw[:, whole : whole + 1], axis=1, bitorder="little")[:, :rest]
        out += np.packbits(high.ravel(), bitorder="little").tobytes()
    return out


def unpack_bits(packed: Buffer, size: int, bits: int) -> np.ndarray:
    """Inverse of `pack_bits`; stray bits in the final byte's padding are a `DecodeError`."""
    if bits in (8, 16, 32):
        return np.frombuffer(packed, dtype=_dtype(bits), count=size)
    whole, rest = divmod(bits, 8)
    raw = np.zeros((size, 4), dtype=np.uint8)
    raw[:, :whole] = np.frombuffer(packed, dtype=np.uint8, count=size * whole).reshape(
        size, whole)
    if rest:
        stream = np.unpackbits(np.frombuffer(packed, dtype=np.uint8, offset=size * whole),
                               bitorder="little")
        if stream[size * rest :].any():
            raise DecodeError("nonzero padding bits after the packed vector")
        planes = np.zeros((size, 8), dtype=np.uint8)
        planes[:, :rest] = stream[: size * rest].reshape(size, rest)
        raw[:, whole] = np.packbits(planes, axis=1, bitorder="little").ravel()
    return raw.view("<u4").ravel().astype(_dtype(bits))


@dataclass(frozen=True)
class ConsistencyCheck(Message):
    """Round 3 (malicious-server mode), server -> client: the claimed survivor set U3."""

    survivors: tuple[int, ...]
    TYPE: ClassVar[int] = 6

    def _write(self, w: _Writer) -> None:
        w.bitmap(self.survivors)

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> ConsistencyCheck:
        return cls(*header, r.bitmap())


@dataclass(frozen=True)
class ConsistencySignature(Message):
    """Round 3, client -> server: the same survivor set, signed by the client."""

    survivors: tuple[int, ...]
    TYPE: ClassVar[int] = 7

    def _write(self, w: _Writer) -> None:
        w.bitmap(self.survivors)

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> ConsistencySignature:
        return cls(*header, r.bitmap())


@dataclass(frozen=True)
class UnmaskRequest(Message):
    """Round 4, server -> client: the survivor set once and (signed mode) the recipient's
    neighbours' signatures on it as (signer, 64-byte signature) pairs."""

    survivors: tuple[int, ...]
    signatures: tuple[tuple[int, bytes], ...]
    TYPE: ClassVar[int] = 8

    def _write(self, w: _Writer) -> None:
        w.bitmap(self.survivors)
        w.pairs(self.signatures)

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> UnmaskRequest:
        return cls(*header, r.bitmap(), r.pairs())


@dataclass(frozen=True)
class UnmaskShares(Message):
    """Round 4, client -> server: self-mask-seed shares of survivors and masking-key shares of
    neighbours that dropped after sharing; never both for the same owner."""

    self_mask: tuple[tuple[int, bytes], ...]  # (owner, share of b_owner)
    mask_key: tuple[tuple[int, bytes], ...]  # (owner, share of s_owner^SK)
    TYPE: ClassVar[int] = 9

    def _write(self, w: _Writer) -> None:
        w.pairs(self.self_mask)
        w.pairs(self.mask_key)

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> UnmaskShares:
        return cls(*header, r.pairs(), r.pairs())


@dataclass(frozen=True)
class Abort(Message):
    """Server -> client: the round is over without output."""

    reason: str
    TYPE: ClassVar[int] = 10

    def _write(self, w: _Writer) -> None:
        w.blob(self.reason.encode())

    @classmethod
    def _read(cls, r: _Reader, header: tuple[bytes, int, int]) -> Abort:
        try:
            return cls(*header, r.blob().decode())
        except UnicodeDecodeError as exc:
            raise DecodeError("abort reason is not UTF-8") from exc


TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (SeedCommit, SeedCommitments, AdvertiseKeys, KeyBroadcast, ShareKeys,
                SharesForward, MaskedInput, ConsistencyCheck, ConsistencySignature, UnmaskRequest,
                UnmaskShares, Abort)
}


def _parts(message: Message, signed: bool) -> list[Buffer]:
    if len(message.context) != CONTEXT_BYTES:
        raise ValueError(f"message context must be a {CONTEXT_BYTES}-byte setup hash")
    w = _Writer()
    w.parts.append(_HEADER.pack(MAGIC, VERSION, message.TYPE, SIGNED if signed else 0,
                                message.context, message.sender, message.recipient))
    message._write(w)
    return w.parts


def signed_part(message: Message, signed: bool = True) -> bytes:
    """The message's bytes up to (not including) its signature."""
    return b"".join(_parts(message, signed))


def signature_input(context: bytes, digest: bytes) -> bytes:
    """What Ed25519 signs: label | setup hash | SHA-256 of the bytes before the signature.
    The label keeps these signatures apart from any other use of the identity keys (and from
    version 2's raw-byte signatures, which began with the magic); the setup hash is the
    verifier's own, so a signature made under another setup never verifies."""
    if len(context) != CONTEXT_BYTES or len(digest) != hashlib.sha256().digest_size:
        raise ValueError("signature input needs a 32-byte setup hash and a SHA-256 digest")
    return SIGNATURE_LABEL + context + digest


def _digest(parts: list[Buffer]) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.digest()


def encode(message: Message, signing_key: Ed25519PrivateKey | None = None) -> bytes:
    """The message's bytes, signed by `signing_key` when one is given (the digest is taken
    piece by piece and the pieces joined once: no extra copy of a large vector)."""
    parts = _parts(message, signing_key is not None)
    if signing_key is not None:
        parts.append(signing_key.sign(signature_input(message.context, _digest(parts))))
    return b"".join(parts)


def decode(data: bytes) -> Message:
    """Parse one message; raises `DecodeError` for anything that is not exactly one message.
    Signatures are checked separately (`verify`), by whoever knows the sender's key."""
    data = bytes(data)
    if len(data) < HEADER_BYTES:
        raise DecodeError("message is shorter than its header")
    magic, version, kind, flags, context, sender, recipient = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise DecodeError("bad magic")
    if version != VERSION:
        raise DecodeError(f"unsupported version {version}")
    if kind not in TYPES:
        raise DecodeError(f"unknown message type {kind}")
    if flags & ~SIGNED:
        raise DecodeError(f"unknown flags {flags:#x}")
    end = len(data) - (SIGNATURE_BYTES if flags & SIGNED else 0)
    if end < HEADER_BYTES:
        raise DecodeError("signed message is shorter than its signature")
    reader = _Reader(data, HEADER_BYTES, end)
    message = TYPES[kind]._read(reader, (context, sender, recipient))
    reader.done()
    return message


def verify(data: bytes, public_key: bytes, context: bytes) -> None:
    """Check that `data` carries a valid signature by the holder of `public_key`, made under
    the setup hash `context` (the verifier's own). Hashes `data` in place, without a copy."""
    if len(data) < HEADER_BYTES + SIGNATURE_BYTES or not data[6] & SIGNED:
        raise AuthenticationError("message is not signed")
    view = memoryview(data)
    verify_detached(view[:-SIGNATURE_BYTES], bytes(view[-SIGNATURE_BYTES:]), public_key,
                    context)


def verify_detached(signed: Buffer, signature: bytes, public_key: bytes, context: bytes) -> None:
    """Check a signature carried apart from the bytes it signs, under setup hash `context`."""
    if len(signature) != SIGNATURE_BYTES:
        raise AuthenticationError("signature has the wrong length")
    statement = signature_input(context, hashlib.sha256(signed).digest())
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, statement)
    except InvalidSignature as exc:
        raise AuthenticationError("signature does not verify") from exc


def check_header(message: Message, context: bytes, recipient: int) -> None:
    """Reject a message addressed to someone else or made under another setup (another
    attempt, another round, or a setup with other parameters)."""
    if message.recipient != recipient:
        raise MisaddressedError(f"message for party {message.recipient} reached party {recipient}")
    if message.context != context:
        raise RoundMismatchError(f"message made under setup {message.context[:6].hex()}..., "
                                 f"this party holds {context[:6].hex()}...")
