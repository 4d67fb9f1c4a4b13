"""The versioned binary encoding: round trips, signatures, strictness, and a decoder fuzz."""

import contextlib
import dataclasses
import hashlib
import struct

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpfleet.secagg import messages as m
from dpfleet.secagg.errors import (
    AuthenticationError,
    DecodeError,
    MisaddressedError,
    RoundMismatchError,
)

ids = st.integers(0, 2**32 - 1)
blob = st.binary(max_size=40)
pairs = st.lists(st.tuples(ids, blob), max_size=5).map(tuple)
id_list = st.sets(st.integers(0, 5000), max_size=8).map(lambda s: tuple(sorted(s)))
header = {"context": st.binary(min_size=32, max_size=32), "sender": ids, "recipient": ids}
CTX = bytes(range(32))

MESSAGES = st.one_of(
    st.builds(m.SeedCommit, **header, commitment=blob),
    st.builds(m.SeedCommitments, **header, commitments=pairs),
    st.builds(m.AdvertiseKeys, **header, c_public=blob, s_public=blob, reveal=blob),
    st.builds(m.KeyBroadcast, **header, reveals=pairs,
              adverts=st.lists(blob, max_size=4).map(tuple)),
    st.builds(m.ShareKeys, **header, commitment=blob, shares=pairs),
    st.builds(m.SharesForward, **header, shares=pairs),
    st.integers(1, 32).flatmap(lambda bits: st.builds(
        m.MaskedInput, **header, bits=st.just(bits),
        vector=st.lists(st.integers(0, 2**bits - 1), max_size=50).map(
            lambda v, bits=bits: np.array(v, dtype="u1" if bits <= 8 else "<u2" if bits <= 16
                                          else "<u4")))),
    st.builds(m.ConsistencyCheck, **header, survivors=id_list),
    st.builds(m.ConsistencySignature, **header, survivors=id_list),
    st.builds(m.UnmaskRequest, **header, survivors=id_list, signatures=pairs),
    st.builds(m.UnmaskShares, **header, self_mask=pairs, mask_key=pairs),
    st.builds(m.Abort, **header, reason=st.text(max_size=30)),
)
KEY = Ed25519PrivateKey.generate()
PUBLIC = KEY.public_key().public_bytes_raw()


def _same(a: m.Message, b: m.Message) -> bool:
    if isinstance(a, m.MaskedInput):
        return (type(b) is m.MaskedInput and a.bits == b.bits
                and a.vector.dtype.itemsize == b.vector.dtype.itemsize
                and np.array_equal(a.vector, b.vector)
                and (a.context, a.sender, a.recipient) == (b.context, b.sender, b.recipient))
    return a == b


@settings(max_examples=300, deadline=None)
@given(MESSAGES, st.booleans())
def test_round_trip(message, signed):
    data = m.encode(message, KEY if signed else None)
    back = m.decode(data)
    assert _same(back, message)
    assert m.encode(back, KEY if signed else None)[: len(data) - 64 * signed] == data[
        : len(data) - 64 * signed]
    if signed:
        m.verify(data, PUBLIC, message.context)
    else:
        with pytest.raises(AuthenticationError):
            m.verify(data, PUBLIC, message.context)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_decoder_fuzz_random_bytes(data):
    with contextlib.suppress(DecodeError):
        assert isinstance(m.decode(data), m.Message)


def _header_bytes(kind=1, flags=0, version=m.VERSION, magic=m.MAGIC):
    return struct.pack("<4sBBB32sII", magic, version, kind, flags, CTX, 2, 3)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.integers(0, 1), st.binary(max_size=120))
def test_decoder_fuzz_valid_header_random_body(kind, flags, body):
    with contextlib.suppress(DecodeError):
        assert isinstance(m.decode(_header_bytes(kind, flags) + body), m.Message)


@settings(max_examples=150, deadline=None)
@given(MESSAGES, st.data())
def test_decoder_fuzz_mutations_of_valid_messages(message, data):
    encoded = bytearray(m.encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(encoded) - 1))
        encoded[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(DecodeError):
        m.decode(bytes(encoded))


def test_every_truncation_is_a_decode_error():
    message = m.ShareKeys(CTX, 1, m.SERVER, b"c" * 32, ((2, b"x" * 10), (3, b"y" * 10)))
    for signed in (None, KEY):
        data = m.encode(message, signed)
        for cut in range(len(data)):
            with pytest.raises(DecodeError):
                m.decode(data[:cut])
        with pytest.raises(DecodeError):
            m.decode(data + b"\0")


@pytest.mark.parametrize("bad", [
    _header_bytes(magic=b"XXXX"), _header_bytes(version=1), _header_bytes(kind=0),
    _header_bytes(kind=99), _header_bytes(flags=0x80),
])
def test_unknown_magic_version_type_or_flag(bad):
    with pytest.raises(DecodeError):
        m.decode(bad + b"\0" * 70)


def test_huge_counts_fail_fast_without_allocating():
    body = struct.pack("<I", 2**32 - 1)
    with pytest.raises(DecodeError):
        m.decode(_header_bytes(kind=2) + body)
    vector = struct.pack("<BQ", 4, 2**63)
    with pytest.raises(DecodeError):
        m.decode(_header_bytes(kind=5) + vector)


def test_signature_covers_every_byte():
    data = m.encode(m.ConsistencySignature(CTX, 2, m.SERVER, (1, 2, 3)), KEY)
    for i in range(len(data)):
        forged = bytearray(data)
        forged[i] ^= 1
        with pytest.raises((AuthenticationError, DecodeError)):
            m.decode(bytes(forged))
            m.verify(bytes(forged), PUBLIC, CTX)
    with pytest.raises(AuthenticationError):
        m.verify(data, Ed25519PrivateKey.generate().public_key().public_bytes_raw(), CTX)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([8, 16, 20, 32]), st.integers(1, 300), st.data())
def test_masked_input_signature_covers_every_payload_bit(bits, size, data):
    dtype = np.uint8 if bits == 8 else np.uint16 if bits == 16 else np.uint32
    vector = np.random.default_rng(size).integers(0, 1 << bits, size).astype(dtype)
    signed = m.encode(m.MaskedInput(CTX, 4, m.SERVER, vector, bits), KEY)
    m.verify(signed, PUBLIC, CTX)
    start = m.HEADER_BYTES + 9
    bit = data.draw(st.integers(0, 8 * (len(signed) - m.SIGNATURE_BYTES - start) - 1))
    forged = bytearray(signed)
    forged[start + bit // 8] ^= 1 << bit % 8
    with pytest.raises(AuthenticationError, match="signature does not verify"):
        m.verify(bytes(forged), PUBLIC, CTX)


def test_signature_is_bound_to_the_verifiers_setup_hash():
    """What is signed is label | setup hash | SHA-256(bytes): a signature made under another
    setup hash is refused even over identical bytes, and a message made and signed under
    another setup does not verify under ours."""
    message = m.ConsistencySignature(CTX, 2, m.SERVER, (1, 2, 3))
    body = m.signed_part(message)
    other = bytes(32)
    foreign = KEY.sign(m.signature_input(other, hashlib.sha256(body).digest()))
    with pytest.raises(AuthenticationError, match="signature does not verify"):
        m.verify(body + foreign, PUBLIC, CTX)
    m.verify(body + foreign, PUBLIC, other)  # the same signature is fine where it was made
    theirs = m.encode(dataclasses.replace(message, context=other), KEY)
    with pytest.raises(AuthenticationError):
        m.verify(theirs, PUBLIC, CTX)
    m.verify(m.encode(message, KEY), PUBLIC, CTX)


def test_header_checks():
    message = m.AdvertiseKeys(CTX, 1, m.SERVER, b"a", b"b", b"r")
    m.check_header(message, CTX, m.SERVER)
    with pytest.raises(MisaddressedError):
        m.check_header(message, CTX, 7)
    with pytest.raises(RoundMismatchError):
        m.check_header(dataclasses.replace(message, context=bytes(32)), CTX, m.SERVER)


@pytest.mark.parametrize("bits", [1, 7, 12, 17, 20, 31, 32])
def test_masked_vectors_travel_in_exactly_b_bits(bits):
    dtype = "u1" if bits <= 8 else "<u2" if bits <= 16 else "<u4"
    vector = np.random.default_rng(bits).integers(0, 2**bits, 1001).astype(dtype)
    data = m.encode(m.MaskedInput(CTX, 1, m.SERVER, vector, bits))
    assert len(data) == m.HEADER_BYTES + 1 + 8 + m.packed_size(1001, bits)
    assert m.packed_size(1001, bits) <= -(-1001 * bits // 8) + 1
    back = m.decode(data)
    np.testing.assert_array_equal(back.vector, vector)
    assert back.vector.dtype == np.dtype(dtype)
    if 1001 * (bits % 8) % 8:
        stray = bytearray(data)
        stray[-1] |= 0x80  # a bit past the last field
        with pytest.raises(DecodeError):
            m.decode(bytes(stray))
    too_wide = np.full(3, 2**bits, "<u8")  # does not fit in `bits`
    with pytest.raises(ValueError):
        m.encode(m.MaskedInput(CTX, 1, m.SERVER, too_wide, bits))


def test_survivor_bitmap_is_canonical_and_linear():
    """n survivors cost n/8 bytes; a bitmap with stray high bits or a cleared last bit (two
    encodings of one list) is refused."""
    survivors = tuple(range(0, 1000, 3))
    data = m.encode(m.ConsistencyCheck(CTX, m.SERVER, 1, survivors))
    assert len(data) == m.HEADER_BYTES + 4 + 125
    assert m.decode(data).survivors == survivors
    size_at = m.HEADER_BYTES
    longer = bytearray(data)
    struct.pack_into("<I", longer, size_at, 998)  # claims 998 bits but bit 997 is clear
    with pytest.raises(DecodeError):
        m.decode(bytes(longer))
    with pytest.raises(ValueError):
        m.encode(m.ConsistencyCheck(CTX, m.SERVER, 1, (3, 1)))
