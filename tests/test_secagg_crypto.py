"""Crypto building blocks: Shamir sharing, sealed shares, key agreement, the mask PRG."""

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.secagg import crypto
from dpfleet.secagg.errors import AuthenticationError, ProtocolViolationError, ReconstructionError


@settings(max_examples=150, deadline=None)
@given(
    secret=st.binary(min_size=1, max_size=48),
    n=st.integers(1, 25),
    data=st.data(),
)
def test_any_threshold_subset_reconstructs(secret, n, data):
    t = data.draw(st.integers(1, n))
    xs = data.draw(st.lists(st.integers(1, crypto.PRIME - 1), min_size=n, max_size=n,
                            unique=True))
    shares = crypto.share_secret(secret, xs, t)
    subset = data.draw(st.lists(st.sampled_from(range(n)), min_size=t, max_size=n, unique=True))
    got = crypto.reconstruct_secret([(xs[i], shares[i]) for i in subset], t, len(secret))
    assert got == secret


def test_fewer_than_threshold_shares_are_refused():
    shares = crypto.share_secret(b"k" * 32, [1, 2, 3, 4, 5], 3)
    with pytest.raises(ReconstructionError):
        crypto.reconstruct_secret([(1, shares[0]), (2, shares[1])], 3, 32)


def test_corrupted_share_is_detected_or_changes_the_secret():
    secret = b"\x01" * 16
    shares = crypto.share_secret(secret, [1, 2, 3], 3)
    bad = bytearray(shares[1])
    bad[0] ^= 1
    try:
        got = crypto.reconstruct_secret([(1, shares[0]), (2, bytes(bad)), (3, shares[2])], 3, 16)
    except ReconstructionError:
        return
    assert got != secret  # the server's commitment / public-key checks catch this case


def test_share_points_must_be_distinct_and_nonzero():
    with pytest.raises(ValueError):
        crypto.share_secret(b"x", [0, 1], 1)
    with pytest.raises(ValueError):
        crypto.share_secret(b"x", [3, 3], 1)
    with pytest.raises(ValueError):
        crypto.share_secret(b"x", [1, 2], 3)


def test_sealed_shares_reject_any_tampering():
    key = bytes(range(32))
    sealed = crypto.seal(key, b"share bytes", b"aad")
    assert crypto.open_sealed(key, sealed, b"aad") == b"share bytes"
    assert len(sealed) == crypto.sealed_length(len(b"share bytes"))
    for i in range(len(sealed)):
        forged = bytearray(sealed)
        forged[i] ^= 0x40
        with pytest.raises(AuthenticationError):
            crypto.open_sealed(key, bytes(forged), b"aad")
    with pytest.raises(AuthenticationError):
        crypto.open_sealed(key, sealed, b"other aad")


def test_key_agreement_is_symmetric_and_bound_to_setup_and_parties():
    a, a_pub = crypto.generate_keypair()
    b, b_pub = crypto.generate_keypair()
    ab, ba = crypto.exchange(a, b_pub), crypto.exchange(b, a_pub)
    one, other = b"\x07" * 32, b"\x08" * 32
    assert crypto.pairwise_mask_seed(ab, one, 1, 2) == crypto.pairwise_mask_seed(ba, one, 2, 1)
    assert crypto.pairwise_mask_seed(ab, one, 1, 2) != crypto.pairwise_mask_seed(ab, other, 1, 2)
    assert crypto.share_key(ab, one, 1, 2) != crypto.share_key(ab, one, 2, 1)
    assert crypto.share_key(ab, one, 1, 2) != crypto.share_key(ab, other, 1, 2)
    assert crypto.share_aad(one, 1, 2) != crypto.share_aad(other, 1, 2)


def test_low_order_public_key_is_a_protocol_violation():
    a, _ = crypto.generate_keypair()
    with pytest.raises(ProtocolViolationError):
        crypto.exchange(a, bytes(32))


def _reference_stream(seed: bytes, length: int, dtype) -> np.ndarray:
    nbytes = length * np.dtype(dtype).itemsize
    raw = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(nbytes))
    return np.frombuffer(raw, dtype=dtype)


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_chunked_streams_equal_one_shot_expansion(bits):
    dtype = crypto.ring_dtype(bits)
    length = 3 * crypto.CHUNK_BYTES // dtype.itemsize + 5  # crosses chunk boundaries
    seeds = [bytes([i]) * 16 for i in range(3)]
    acc = np.full(length, 7, dtype=dtype)
    crypto.add_streams(acc, seeds[:2], seeds[2:])
    ref = [_reference_stream(s, length, dtype).astype(np.int64) for s in seeds]
    expected = (7 + ref[0] + ref[1] - ref[2]) % (1 << (8 * dtype.itemsize))
    np.testing.assert_array_equal(acc.astype(np.int64), expected)
    np.testing.assert_array_equal(crypto.prg(seeds[0], length, dtype), ref[0].astype(dtype))


def test_ring_dtype_widths():
    assert [crypto.ring_dtype(b).itemsize for b in (1, 8, 9, 16, 17, 32)] == [1, 1, 2, 2, 4, 4]
    for bad in (0, 33):
        with pytest.raises(ValueError):
            crypto.ring_dtype(bad)


@settings(max_examples=60, deadline=None)
@given(t=st.integers(2, 12), extra=st.integers(1, 8), data=st.data())
def test_robust_reconstruction_survives_bad_shares_and_names_their_holders(t, extra, data):
    """With up to `extra` // 2 corrupted shares among t + extra, the commitment oracle still
    finds the secret; when the first t shares tried do not rebuild it, the corrupted holders are
    reported and never an honest one (otherwise none had to be looked at). The first t can rebuild it
    despite corrupted shares among them: their errors may cancel at x = 0 (rare, and it depends
    on the random polynomial), and then the secret is right and nothing needs reporting."""
    secret = b"s" * 7 + bytes([t, extra]) + b"e" * 7
    m = t + extra
    shares = list(zip(range(1, m + 1), crypto.share_secret(secret, list(range(1, m + 1)), t),
                      strict=True))
    bad = data.draw(st.sets(st.integers(0, m - 1), max_size=extra // 2))
    for i in bad:
        x, share = shares[i]
        shares[i] = (x, bytes([share[0] ^ 0x5A]) + share[1:])
    got, reported = crypto.reconstruct_checked(shares, t, len(secret), lambda s: s == secret,
                                               max_subsets=2000)
    assert got == secret
    try:
        first_t_pass = crypto.reconstruct_secret(shares[:t], t, len(secret)) == secret
    except ReconstructionError:
        first_t_pass = False
    assert first_t_pass or any(i < t for i in bad)  # a failing first try needs a bad share in it
    # never an honest holder; all bad ones, unless cancelling errors left it ambiguous (then none)
    assert reported in ([], sorted(i + 1 for i in bad))
    if first_t_pass:
        assert reported == []


def test_robust_reconstruction_gives_up_when_too_few_good_shares():
    secret = b"k" * 16
    shares = list(zip(range(1, 6), crypto.share_secret(secret, list(range(1, 6)), 4),
                      strict=True))
    errors = {1: 12345, 2: 54321}  # not a small ratio: no t-subset's Lagrange weights cancel them

    def corrupt(x, share):
        ys = np.frombuffer(share, dtype="<u4").astype(np.int64)
        ys[0] = (ys[0] + errors.get(x, 0)) % crypto.PRIME
        return x, ys.astype("<u4").tobytes()

    shares = [corrupt(x, s) for x, s in shares]
    with pytest.raises(ReconstructionError):
        crypto.reconstruct_checked(shares, 4, 16, lambda s: s == secret)


def test_colluders_whose_share_errors_cancel_cannot_get_honest_holders_named():
    """Two colluding holders pick share errors that cancel at x = 0 on a t-subset the server
    will try (the subset order is public), so that subset rebuilds the right secret on a wrong
    polynomial; a third bad share spoils the first try. Checking the other holders against that
    polynomial would name honest ones; only the bad holders may be named (or nobody)."""
    t, m, secret = 4, 12, b"0123456789abcdef"
    xs = list(range(1, m + 1))
    shares = list(zip(xs, crypto.share_secret(secret, xs, t), strict=True))
    rng = np.random.default_rng(m)  # the same public subset order as reconstruct_checked's
    target = [0]  # tries 1, 2, ...: the first subset without holder 0 (tries with it fail)
    while 0 in target:
        target = sorted(rng.choice(m, t, replace=False).tolist())
    a, b = target[:2]  # two colluders in it ...
    lam = crypto._lagrange_at_zero(tuple(xs[i] for i in target))
    la, lb = int(lam[target.index(a)]), int(lam[target.index(b)])
    ea = 1
    eb = (-la * ea * pow(lb, crypto.PRIME - 2, crypto.PRIME)) % crypto.PRIME
    for i, e in ((a, ea), (b, eb)):
        ys = np.frombuffer(shares[i][1], dtype="<u4").astype(np.int64)
        ys[0] = (ys[0] + e) % crypto.PRIME
        shares[i] = (xs[i], ys.astype("<u4").tobytes())
    y0 = np.frombuffer(shares[0][1], dtype="<u4").astype(np.int64)  # ... and holder 0 (in the
    y0[0] = (y0[0] + 12345) % crypto.PRIME  # first t) is plainly bad: its error cancels with none
    shares[0] = (xs[0], y0.astype("<u4").tobytes())
    assert crypto.reconstruct_secret([shares[i] for i in target], t, len(secret)) == secret
    got, named = crypto.reconstruct_checked(shares, t, len(secret), lambda s: s == secret)
    assert got == secret
    bad = {xs[0], xs[a], xs[b]}
    assert set(named) <= bad  # never an honest holder
    assert set(named) == bad  # and here the budget found the true polynomial
