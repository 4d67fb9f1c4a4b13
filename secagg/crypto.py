"""The cryptographic building blocks of SecAgg, all from the `cryptography` package.

- X25519 key agreement + HKDF-SHA256 (info binds round, parties and purpose) turn two parties'
  key pairs into a pairwise mask seed and a per-direction AES-256-GCM key for the encrypted
  Shamir shares.
- Shamir t-of-n sharing over GF(p), p = 2^31 - 1: a secret is split into 16-bit limbs, each
  limb shared with its own random polynomial. A small prime keeps every product inside int64,
  so sharing and reconstruction are vectorised numpy (one Horner step per coefficient for all
  recipients and limbs at once) instead of big-integer Python loops.
- The mask PRG is AES-128-CTR keyed by a 16-byte seed, encrypting zeros straight into a numpy
  buffer that is then viewed as ring elements (uint8/16/32). Masks are added chunk by chunk so
  the running sum stays in cache while many streams are folded into it.
"""

from __future__ import annotations

import functools
import itertools
import math
import secrets
import struct
from collections.abc import Callable, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dpfleet.secagg.errors import AuthenticationError, ProtocolViolationError, ReconstructionError

PRIME = 2**31 - 1  # Mersenne prime: every limb (< 2^16) and every x-coordinate fit below it
LIMB_BYTES = 2
SEED_BYTES = 16  # AES-128 key of a mask stream
KEY_BYTES = 32  # X25519 private and public keys
NONCE_BYTES = 12
TAG_BYTES = 16
CHUNK_BYTES = 1 << 18  # 256 KiB of ring elements per PRG step: stays in L2 with its buffer


# ---------------------------------------------------------------------------- key agreement


def generate_keypair() -> tuple[X25519PrivateKey, bytes]:
    """A fresh X25519 key pair, the public half as its 32 raw bytes."""
    private = X25519PrivateKey.generate()
    return private, public_bytes(private)


def public_bytes(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes_raw()


def private_bytes(private: X25519PrivateKey) -> bytes:
    return private.private_bytes_raw()


def exchange(private: X25519PrivateKey, peer_public: bytes) -> bytes:
    """The raw X25519 shared secret; only ever used through `derive`."""
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:  # low-order point: the shared secret would be all zeros
        raise ProtocolViolationError("peer public key is a low-order point") from exc


def _derive(shared: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(shared)


def pairwise_mask_seed(shared: bytes, context: bytes, u: int, v: int) -> bytes:
    """s_uv: the AES-128 seed u and v both derive for their shared mask (symmetric in u, v).
    `context` is the setup hash: a key agreed under one setup is useless under any other."""
    lo, hi = min(u, v), max(u, v)
    return _derive(shared, b"dpfleet/secagg/mask" + context + struct.pack("<II", lo, hi),
                   SEED_BYTES)


def share_key(shared: bytes, context: bytes, sender: int, recipient: int) -> bytes:
    """The AES-256-GCM key for sender's shares to recipient (one key per direction)."""
    info = b"dpfleet/secagg/share" + context + struct.pack("<II", sender, recipient)
    return _derive(shared, info, 32)


def share_aad(context: bytes, sender: int, recipient: int) -> bytes:
    """Associated data binding a sealed share to its setup and both parties."""
    return context + struct.pack("<II", sender, recipient)


def commitment(label: bytes, context: bytes, owner: int, value: bytes) -> bytes:
    """SHA-256 commitment of `owner` to `value` under the setup hash `context`; the label
    separates what is committed to (self-mask seed, graph-seed randomness)."""
    digest = hashes.Hash(hashes.SHA256())
    digest.update(b"dpfleet/secagg/" + label + context + struct.pack("<I", owner) + value)
    return digest.finalize()


def seed_commitment(context: bytes, owner: int, seed: bytes) -> bytes:
    """Commitment to a self-mask seed, so the server can tell a corrupted share."""
    return commitment(b"self-mask", context, owner, seed)


# ------------------------------------------------------------------ authenticated encryption


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """AES-GCM with a random nonce, returned in front of the ciphertext."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    """Inverse of `seal`; any tampering with nonce, ciphertext, tag or aad is rejected."""
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
    except InvalidTag as exc:
        raise AuthenticationError("share ciphertext does not authenticate") from exc


def sealed_length(plaintext_length: int) -> int:
    return NONCE_BYTES + plaintext_length + TAG_BYTES


# --------------------------------------------------------------------------- Shamir sharing


def limbs_of(secret_length: int) -> int:
    return -(-secret_length // LIMB_BYTES)


def share_bytes(secret_length: int) -> int:
    """Encoded size of one share of a `secret_length`-byte secret (one uint32 per limb)."""
    return 4 * limbs_of(secret_length)


def _uniform_field(shape: tuple[int, ...]) -> np.ndarray:
    """Exactly uniform elements of GF(p) from the OS CSPRNG (rejection of the single value p)."""
    count = int(np.prod(shape))
    out = np.frombuffer(secrets.token_bytes(4 * count), dtype="<u4") & np.uint32(PRIME)
    bad = np.flatnonzero(out == PRIME)
    while bad.size:
        fresh = np.frombuffer(secrets.token_bytes(4 * bad.size), dtype="<u4") & np.uint32(PRIME)
        out[bad] = fresh
        bad = bad[fresh == PRIME]
    return out.astype(np.int64).reshape(shape)


def share_secret(secret: bytes, xs: Sequence[int], threshold: int) -> list[bytes]:
    """Shamir shares of `secret` at the nonzero points `xs`; any `threshold` reconstruct it,
    fewer reveal nothing (each limb's polynomial has threshold - 1 uniform coefficients)."""
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} outside 1..{len(xs)}")
    padded = secret + b"\0" * (len(secret) % LIMB_BYTES)
    limbs = np.frombuffer(padded, dtype="<u2").astype(np.int64)
    x = np.asarray(xs, dtype=np.int64)[:, None]
    if np.any(x <= 0) or np.any(x >= PRIME) or len(set(xs)) != len(xs):
        raise ValueError("share points must be distinct and in 1..p-1")
    acc = np.zeros((x.shape[0], limbs.size), dtype=np.int64)
    for coefficient in _uniform_field((threshold - 1, limbs.size)):
        acc = (acc * x + coefficient) % PRIME
    acc = (acc * x + limbs) % PRIME
    return [row.astype("<u4").tobytes() for row in acc]


@functools.lru_cache(maxsize=4096)
def _lagrange_at_zero(xs: tuple[int, ...]) -> np.ndarray:
    """Lagrange basis values at 0 for the points xs (cached: the same holders recur).
    All t denominators are inverted with one modular exponentiation (prefix products):
    t separate inversions were most of a server's share reconstruction."""
    nums, dens = [], []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if i != j:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        nums.append(num)
        dens.append(den)
    prefix = [1]
    for den in dens:
        prefix.append(prefix[-1] * den % PRIME)
    inverse = pow(prefix[-1], PRIME - 2, PRIME)  # 1 / (d_0 ... d_(t-1))
    coefficients = [0] * len(xs)
    for i in reversed(range(len(xs))):
        coefficients[i] = nums[i] * inverse % PRIME * prefix[i] % PRIME  # prefix_i / prefix_(i+1)
        inverse = inverse * dens[i] % PRIME
    return np.asarray(coefficients, dtype=np.int64)


def reconstruct_checked(
    shares: Sequence[tuple[int, bytes]],
    threshold: int,
    length: int,
    valid: Callable[[bytes], bool],
    max_subsets: int = 256,
) -> tuple[bytes, list[int]]:
    """Robust reconstruction: the secret that `valid` (a commitment or public-key check)
    accepts, and -- when the first t shares did not already pass -- the share points whose
    shares disagree with it.

    The first t shares are tried first; when they fail, random t-subsets follow, up to
    `max_subsets` tries: with e bad shares among m, each try is all-good with probability
    C(m - e, t) / C(m, t), so a few bad shares do not abort the round as long as enough good
    ones came back. Raises `ReconstructionError` when no tried subset passes the check.

    Attribution never accuses an honest holder: a subset holding bad shares whose errors cancel
    at x = 0 (by chance, or crafted by colluders) rebuilds the right secret on a wrong
    polynomial. Two distinct polynomials of degree t - 1 through (0, secret) share at most t - 2
    other points, so while m >= t + 2e a wrong one agrees with fewer than (m + t - 1) / 2 shares
    and the true one with at least that many: such a polynomial names the holders off it. Below
    that bound, when every t-subset fits in the budget they are all tried: the true polynomial is
    always among those found, so if it is the only one, it names the holders; two or more
    (colluders framing honest holders) name nobody. Otherwise nobody is named.
    """
    ordered = sorted(shares)
    m = len(ordered)
    if m < threshold:
        raise ReconstructionError(f"{m} shares, {threshold} needed")
    exhaustive = math.comb(m, threshold) <= max_subsets
    if exhaustive:  # the first t come first here too
        subsets = itertools.combinations(range(m), threshold)
    else:
        rng = np.random.default_rng(m)  # which subsets are tried need not be secret
        subsets = itertools.chain([range(threshold)], (sorted(
            rng.choice(m, threshold, replace=False).tolist()) for _ in range(max_subsets - 1)))
    found, fits = None, []  # the secret, and the agreement sets of the polynomials giving it
    for tried, picks in enumerate(subsets):
        subset = [ordered[i] for i in picks]
        members = {x for x, _ in subset}
        if any(members <= fit for fit in fits):  # t points of a polynomial already found
            continue
        try:
            secret = reconstruct_secret(subset, threshold, length)
        except ReconstructionError:
            continue
        if found is not None and secret != found or found is None and not valid(secret):
            continue
        if tried == 0:  # the usual case: no share needed checking (nor is reported)
            return secret, []
        found = secret
        fit = frozenset(x for x, share in ordered if x in members or valid_share(
            subset, (x, share), threshold, length, secret))
        if 2 * len(fit) >= m + threshold - 1:  # the true polynomial (docstring)
            return secret, [x for x, _ in ordered if x not in fit]
        fits.append(fit)
    if found is None:
        raise ReconstructionError(f"no {threshold} of {m} shares (tried up to {max_subsets} "
                                  "subsets) rebuild a secret that passes its check")
    if exhaustive and len(fits) == 1:
        return found, [x for x, _ in ordered if x not in fits[0]]
    return found, []


def valid_share(
    good: Sequence[tuple[int, bytes]], candidate: tuple[int, bytes], threshold: int, length: int,
    secret: bytes,
) -> bool:
    """Whether `candidate` lies on the polynomial through the t good shares: swap it in for
    one of them and see whether the same secret comes out."""
    try:
        return reconstruct_secret([*good[1:], candidate], threshold, length) == secret
    except ReconstructionError:
        return False


def reconstruct_secret(shares: Sequence[tuple[int, bytes]], threshold: int, length: int) -> bytes:
    """The `length`-byte secret from `threshold` shares (x, share); extra shares are ignored.

    Raises ReconstructionError when the shares do not lie on one polynomial with 16-bit
    limbs at 0 (a corrupted share), or when fewer than `threshold` are given.
    """
    if len(shares) < threshold:
        raise ReconstructionError(f"{len(shares)} shares, {threshold} needed")
    chosen = sorted(shares)[:threshold]
    xs = tuple(x for x, _ in chosen)
    if len(set(xs)) != threshold:
        raise ReconstructionError("repeated share point")
    width = share_bytes(length)
    if any(len(s) != width for _, s in chosen):
        raise ReconstructionError("share of the wrong size")
    ys = np.stack([np.frombuffer(s, dtype="<u4").astype(np.int64) for _, s in chosen])
    if np.any(ys >= PRIME):
        raise ReconstructionError("share value outside the field")
    limbs = ((ys * _lagrange_at_zero(xs)[:, None]) % PRIME).sum(axis=0) % PRIME
    if np.any(limbs >= 1 << (8 * LIMB_BYTES)):
        raise ReconstructionError("shares are inconsistent")
    raw = limbs.astype("<u2").tobytes()
    if any(raw[length:]):
        raise ReconstructionError("shares are inconsistent")
    return raw[:length]


# ----------------------------------------------------------------------------- mask PRG


def ring_dtype(bits: int) -> np.dtype:
    """The narrowest unsigned dtype whose wraparound is a multiple of 2^bits."""
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in 1..32, got {bits}")
    width = 1 if bits <= 8 else 2 if bits <= 16 else 4
    return np.dtype(f"<u{width}")


def _stream(seed: bytes):
    return Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()


def prg(seed: bytes, length: int, dtype: np.dtype) -> np.ndarray:
    """`length` pseudorandom ring elements: AES-128-CTR of zeros, viewed as `dtype`."""
    out = np.zeros(length, dtype=dtype)
    add_streams(out, [seed], [])
    return out


def add_streams(acc: np.ndarray, plus: Sequence[bytes], minus: Sequence[bytes]) -> None:
    """acc += sum(PRG(s) for s in plus) - sum(PRG(s) for s in minus), modulo the dtype's range.

    Works chunk by chunk: every stream's cipher context keeps its counter, so the chunked
    output is the same stream as a one-shot expansion, while the accumulator chunk stays hot.
    """
    if not (plus or minus):
        return
    itemsize = acc.dtype.itemsize
    step = CHUNK_BYTES // itemsize
    zeros = bytes(step * itemsize)
    raw = bytearray(step * itemsize + 15)  # update_into wants block_size - 1 spare bytes
    view = np.frombuffer(raw, dtype=acc.dtype, count=step)
    streams = [(_stream(s), np.add) for s in plus] + [(_stream(s), np.subtract) for s in minus]
    for start in range(0, acc.size, step):
        part = acc[start : start + step]
        size = part.size
        for cipher, op in streams:
            cipher.update_into(zeros[: size * itemsize], raw)
            op(part, view[:size], out=part)
