"""Attacks on the wire: forged, replayed, truncated, misaddressed and duplicated messages are
rejected with their specific error, and the sum over the survivors stays exact."""

import dataclasses
import hashlib

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.secagg import messages as m
from dpfleet.secagg.errors import (
    AuthenticationError,
    DecodeError,
    DuplicateMessageError,
    MisaddressedError,
    ProtocolViolationError,
    ReconstructionError,
    RoundMismatchError,
    ThresholdError,
    UnexpectedMessageError,
    UnknownSenderError,
)
from dpfleet.secagg.inprocess import run_round
from dpfleet.secagg.params import RoundSetup, plan_round

N, LENGTH, BITS = 7, 40, 16
ATTACKER = Ed25519PrivateKey.generate()


def _round(intercept=None, signed=False, seed=1, dropouts=None, identity_keys=None):
    setup, keys, _ = plan_round(N, LENGTH, BITS, graph="complete", threshold=4, signed=signed,
                                identity_keys=identity_keys)
    inputs = np.random.default_rng(seed).integers(0, 1 << BITS, (N, LENGTH)).astype(
        setup.dtype)
    report = run_round(setup, inputs.__getitem__, keys, dropouts, intercept)
    expected = inputs[list(report.survivors)].astype(np.int64).sum(axis=0) % (1 << BITS)
    np.testing.assert_array_equal(report.total, expected)  # never corrupted
    return report


def _all_but(*gone):
    return tuple(u for u in range(N) if u not in gone)


def _errors(report):
    return [(type(r.error), r.sender, r.recipient) for r in report.rejections]


def _rewrite(data, signer=None, **changes):
    return m.encode(dataclasses.replace(m.decode(data), **changes), signer)


def _on(phase, sender, recipient, attack):
    """An intercept applying `attack(data) -> list of bytes` to one message in flight."""
    def intercept(ph, s, r, data):
        return attack(data) if (ph, s, r) == (phase, sender, recipient) else [data]
    return intercept


def test_forged_share_ciphertext_fails_authentication():
    def flip(data):
        message = m.decode(data)
        (owner, sealed), *rest = message.shares
        forged = sealed[:20] + bytes([sealed[20] ^ 1]) + sealed[21:]
        return [_rewrite(data, shares=((owner, forged), *rest))]

    report = _round(_on("mask", m.SERVER, 2, flip))
    assert _errors(report) == [(AuthenticationError, m.SERVER, 2)]
    assert report.survivors == _all_but(2)


def test_ciphertext_for_another_client_fails_authentication():
    sent = {}

    def intercept(phase, sender, recipient, data):
        if phase == "share" and sender == 0:
            sent.update(m.decode(data).shares)
        if (phase, recipient) == ("mask", 2):  # give client 2 the share 0 sealed for 3
            shares = tuple((o, sent[3] if o == 0 else s) for o, s in m.decode(data).shares)
            return [_rewrite(data, shares=shares)]
        return [data]

    report = _round(intercept)
    assert _errors(report) == [(AuthenticationError, m.SERVER, 2)]


def test_replay_from_an_earlier_attempt():
    old = {}

    def record(phase, sender, recipient, data):
        old[phase, sender, recipient] = data
        return [data]

    _round(record)

    def replay(phase, sender, recipient, data):
        return [data, old[phase, sender, recipient]] if sender in (0, m.SERVER) else [data]

    report = _round(replay)  # same parameters, fresh session id
    assert report.rejections and all(
        isinstance(r.error, RoundMismatchError) for r in report.rejections)
    assert report.survivors == tuple(range(N))


def test_every_message_duplicated():
    report = _round(lambda phase, sender, recipient, data: [data, data])
    assert report.rejections and all(
        isinstance(r.error, DuplicateMessageError) for r in report.rejections)
    assert len(report.rejections) == N * (5 + 4)  # 5 messages sent, 4 received per client
    assert report.survivors == tuple(range(N))


def test_truncated_masked_input():
    report = _round(_on("mask", 1, m.SERVER, lambda data: [data[:-3]]))
    assert _errors(report) == [(DecodeError, 1, m.SERVER)]
    assert report.survivors == _all_but(1)


def test_wrongly_addressed_messages():
    report = _round(_on("mask", 3, m.SERVER, lambda d: [_rewrite(d, recipient=4)]))
    assert _errors(report) == [(MisaddressedError, 3, m.SERVER)]
    report = _round(_on("mask", m.SERVER, 2, lambda d: [_rewrite(d, recipient=4)]))
    assert _errors(report) == [(MisaddressedError, m.SERVER, 2)]


def test_unknown_sender_and_out_of_phase_messages():
    def inject(data):
        stranger = _rewrite(data, sender=N + 7)
        context = m.decode(data).context
        late_advert = m.encode(m.AdvertiseKeys(context, 4, m.SERVER, b"a" * 32, b"b" * 32,
                                               b"r" * 32))
        early_unmask = m.encode(m.UnmaskShares(context, 4, m.SERVER, (), ()))
        return [stranger, late_advert, early_unmask, data]

    report = _round(_on("mask", 4, m.SERVER, inject))
    assert [e for e, _, _ in _errors(report)] == [
        UnknownSenderError, DuplicateMessageError, UnexpectedMessageError]
    assert report.survivors == tuple(range(N))


def test_masked_input_of_the_wrong_length():
    def shorten(data):
        message = m.decode(data)
        return [_rewrite(data, vector=message.vector[:-1])]

    report = _round(_on("mask", 5, m.SERVER, shorten))
    assert _errors(report) == [(ProtocolViolationError, 5, m.SERVER)]
    assert report.survivors == _all_but(5)


def test_signed_mode_rejects_forged_and_tampered_client_messages():
    def attack(data):
        message = m.decode(data)
        forged = m.encode(dataclasses.replace(message, vector=message.vector ^ 1), ATTACKER)
        tampered = bytearray(data)
        tampered[m.HEADER_BYTES + 20] ^= 1
        return [forged, bytes(tampered), data]  # the genuine one still comes last

    report = _round(_on("mask", 1, m.SERVER, attack), signed=True)
    assert _errors(report) == [(AuthenticationError, 1, m.SERVER)] * 2
    assert report.survivors == tuple(range(N))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_masked_input_with_one_payload_bit_flipped_after_signing_is_left_out(data):
    """The signature covers the payload through its SHA-256 digest: one flipped bit anywhere
    in the packed vector is refused, and the client's (altered) input stays out of the sum."""
    seen = {}

    def flip(wire):
        start = m.HEADER_BYTES + 9  # bits u8, element count u64, then the packed vector
        bit = data.draw(st.integers(0, 8 * (len(wire) - m.SIGNATURE_BYTES - start) - 1))
        tampered = bytearray(wire)
        tampered[start + bit // 8] ^= 1 << bit % 8
        seen["altered"] = m.decode(bytes(tampered)).vector.astype(np.int64)
        return [bytes(tampered)]  # the genuine message never arrives

    report = _round(_on("mask", 1, m.SERVER, flip), signed=True)
    assert [(type(r.error), r.sender, str(r.error)) for r in report.rejections] == [
        (AuthenticationError, 1, "signature does not verify")]
    assert report.survivors == _all_but(1)
    # _round checked the total is the sum over survivors only; the altered vector is not in it
    with_altered = (report.total.astype(np.int64) + seen["altered"]) % (1 << BITS)
    assert not np.array_equal(report.total, with_altered)


def test_signature_over_the_digest_of_another_setup_hash_is_refused():
    """A genuine client key signing the right bytes under another setup hash (another attempt
    or a setup the server showed it) does not verify under this round's setup hash."""
    keys = {u: Ed25519PrivateKey.generate() for u in range(N)}
    other = bytes(range(32))

    def resign(wire):
        body = memoryview(wire)[: -m.SIGNATURE_BYTES]
        statement = m.signature_input(other, hashlib.sha256(body).digest())
        return [bytes(body) + keys[3].sign(statement)]

    report = _round(_on("mask", 3, m.SERVER, resign), signed=True, identity_keys=keys)
    assert [(type(r.error), r.sender, str(r.error)) for r in report.rejections] == [
        (AuthenticationError, 3, "signature does not verify")]
    assert report.survivors == _all_but(3)

    def resign_advert(wire):  # the same for an advert a client checks itself
        message = m.decode(wire)
        advert = message.adverts[0]
        sender = m.decode(advert).sender
        body = advert[: -m.SIGNATURE_BYTES]
        forged = body + keys[sender].sign(m.signature_input(other, hashlib.sha256(
            body).digest()))
        return [_rewrite(wire, adverts=(forged, *message.adverts[1:]))]

    report = _round(_on("share", m.SERVER, 2, resign_advert), signed=True, identity_keys=keys)
    assert _errors(report) == [(AuthenticationError, m.SERVER, 2)]
    assert 2 not in report.survivors


def test_signed_mode_rejects_a_substituted_public_key():
    def substitute(data):
        message = m.decode(data)
        advert = m.decode(message.adverts[0])
        fake = m.encode(dataclasses.replace(advert, c_public=bytes(range(32))), ATTACKER)
        return [_rewrite(data, adverts=(fake, *message.adverts[1:]))]

    report = _round(_on("share", m.SERVER, 2, substitute), signed=True)
    assert _errors(report) == [(AuthenticationError, m.SERVER, 2)]
    assert 2 not in report.survivors


def test_advert_replayed_from_another_round_inside_a_key_broadcast():
    def stale(data):
        message = m.decode(data)
        old = _rewrite(message.adverts[0], context=bytes(32))
        return [_rewrite(data, adverts=(old, *message.adverts[1:]))]

    report = _round(_on("share", m.SERVER, 3, stale))
    assert _errors(report) == [(RoundMismatchError, m.SERVER, 3)]


def test_client_answers_one_unmask_request_only():
    """A server that asks again with another survivor list must not get the other share."""
    def ask_twice(data):
        message = m.decode(data)
        return [data, _rewrite(data, survivors=tuple(s for s in message.survivors if s != 1))]

    report = _round(_on("unmask", m.SERVER, 0, ask_twice))
    assert _errors(report) == [(DuplicateMessageError, m.SERVER, 0)]


def test_survivor_list_naming_a_client_that_never_shared():
    report = _round(_on("unmask", m.SERVER, 0, lambda d: [_rewrite(d, survivors=tuple(range(N)))]),
                    dropouts={"share": {5}})
    assert _errors(report) == [(ProtocolViolationError, m.SERVER, 0)]
    assert report.survivors == _all_but(5)


def test_signed_mode_checks_the_consistency_proof():
    def forge_signature(data):
        message = m.decode(data)
        (signer, _), *rest = message.signatures
        statement = m.ConsistencySignature(message.context, signer, m.SERVER, message.survivors)
        forged = ATTACKER.sign(m.signature_input(message.context, hashlib.sha256(
            m.signed_part(statement)).digest()))
        return [_rewrite(data, signatures=((signer, forged), *rest))]

    report = _round(_on("unmask", m.SERVER, 0, forge_signature), signed=True)
    assert _errors(report) == [(AuthenticationError, m.SERVER, 0)]

    def other_list(data):
        return [_rewrite(data, survivors=m.decode(data).survivors[1:])]

    report = _round(_on("unmask", m.SERVER, 0, other_list), signed=True)
    assert _errors(report) == [(ProtocolViolationError, m.SERVER, 0)]


def _corrupt_shares_of(owner, holders):
    """Holders return random field elements instead of their share of `owner`'s seed."""
    def intercept(phase, sender, recipient, data):
        if phase != "unmask" or sender not in holders:
            return [data]
        message = m.decode(data)
        noise = np.random.default_rng(sender).integers(0, 2**31 - 1, 8, dtype=np.uint32)
        shares = tuple((w, noise.astype("<u4").tobytes() if w == owner else s)
                       for w, s in message.self_mask)
        return [_rewrite(data, self_mask=shares)]
    return intercept


def test_corrupted_unmask_shares_are_routed_around_and_their_holders_reported():
    """Robust reconstruction: the commitment picks out a good t-subset, the sum stays exact."""
    report = _round(_corrupt_shares_of(6, {0, 3}))
    assert report.survivors == tuple(range(N))
    assert report.inconsistent == {6: [0, 3]}


def test_too_many_corrupted_shares_abort_instead_of_a_wrong_sum():
    """k - t + 1 = 3 bad shares of one secret leave fewer than t good ones: a clean abort."""
    with pytest.raises(ReconstructionError):
        _round(_corrupt_shares_of(6, {0, 1, 2}))


@pytest.mark.parametrize("bad_key", ["own", "copied", "low_order"])
def test_bad_public_keys_are_refused(bad_key):
    """The advert is refused; since it also carried the client's graph-seed reveal, its sender
    is a committed client that did not reveal: on this complete graph (no seed changes it) a
    dropout like any other, the sum over the rest exact; on a sparse graph with d = 0 the
    attempt aborts (a retry gets a fresh session) rather than letting the server drop reveals."""
    adverts = {}

    def intercept(phase, sender, recipient, data):
        if phase != "advertise":
            return [data]
        adverts[sender] = m.decode(data)
        if sender != 2:
            return [data]
        key = {"own": adverts[2].c_public, "copied": adverts[1].s_public,
               "low_order": bytes(32)}[bad_key]
        return [_rewrite(data, s_public=key)]

    report = _round(intercept)
    assert report.survivors == _all_but(2)
    assert [(type(r.error), r.sender) for r in report.rejections] == [
        (ProtocolViolationError, 2)]
    sparse = RoundSetup(n=N, k=4, threshold=3, length=LENGTH, bits=BITS)
    adverts.clear()
    with pytest.raises(ThresholdError, match="did not reveal"):
        run_round(sparse, lambda u: np.zeros(LENGTH, sparse.dtype), intercept=intercept)
