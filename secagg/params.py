"""What all parties of one SecAgg round agree on before it starts, and its fingerprint.

The coordinator fixes these in the round's plan: a fresh random session id (per attempt, so
nothing from an earlier attempt at the same round is accepted), the number of clients n, the
masking degree k, the Shamir threshold t, the corruption c the threshold is sized against, the
vector length, the ring Z_(2^bits), and -- in signed mode -- the clients' long-term Ed25519
identity keys, and optionally `terms`, a digest of what the inputs mean (the discretizer and
adaptive clipping's threshold, `count_bit`). `setup_hash` is SHA-256 over all of it; it is
every message header's context, the HKDF info of every derived key, the AAD of every sealed
share and the signed prefix of every signature, so two clients holding different setups
cannot talk to each other at all.

The masking graph's seed is not a setup parameter: the server could grind it. It is derived in
the round from commit-and-reveal among the clients (`graph_seed`).
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.secagg.crypto import KEY_BYTES, ring_dtype
from dpfleet.secagg.graph import Graph, GraphPlan, plan_graph

SESSION_BYTES = 32
TERMS_BYTES = 32


@dataclass(frozen=True)
class RoundSetup:
    """Public parameters of one round; `identities` set means signed (malicious-server) mode.

    Refuses any threshold a split view could beat: t > c and 2t > k + c (two survivor lists
    each answered by t holders need 2t - c <= k distinct holders)."""

    n: int
    k: int
    threshold: int
    length: int
    bits: int
    corrupt: int = 0
    identities: Mapping[int, bytes] | None = None
    session_id: bytes = field(default_factory=lambda: secrets.token_bytes(SESSION_BYTES))
    # SHA-256 of what the inputs mean (`count_bit.terms_digest`), b"" when the caller binds none
    terms: bytes = b""

    def __post_init__(self) -> None:
        Graph(self.n, self.k)  # validates n and k
        t, k, c = self.threshold, self.k, self.corrupt
        if c < 0 or not c < t <= k or 2 * t <= k + c:
            raise ValueError(f"threshold t={t} with k={k}, c={c} corrupt neighbours: need "
                             f"c < t <= k and 2t > k + c")
        if self.length < 1:
            raise ValueError(f"vector length must be positive, got {self.length}")
        ring_dtype(self.bits)
        if len(self.session_id) != SESSION_BYTES:
            raise ValueError(f"session id must be {SESSION_BYTES} bytes")
        if len(self.terms) not in (0, TERMS_BYTES):
            raise ValueError(f"terms must be empty or a {TERMS_BYTES}-byte digest")
        if self.identities is not None:
            if set(self.identities) != set(range(self.n)):
                raise ValueError("identities must hold one Ed25519 public key per client")
            if any(len(key) != KEY_BYTES for key in self.identities.values()):
                raise ValueError("identity keys must be 32-byte Ed25519 public keys")
            object.__setattr__(self, "identities", MappingProxyType(dict(self.identities)))

    @property
    def signed(self) -> bool:
        return self.identities is not None

    @property
    def dtype(self) -> np.dtype:
        return ring_dtype(self.bits)

    @property
    def modulus_mask(self) -> int:
        return (1 << self.bits) - 1

    @property
    def setup_hash(self) -> bytes:
        """SHA-256 of every parameter, the identity-key list included, in a fixed encoding."""
        digest = hashlib.sha256(b"dpfleet/secagg/setup/v2")
        digest.update(self.session_id)
        digest.update(struct.pack("<IIIIQIB", self.n, self.k, self.threshold, self.corrupt,
                                  self.length, self.bits, self.signed))
        if self.identities is not None:
            digest.update(b"".join(self.identities[u] for u in range(self.n)))
        if self.terms:  # appended only when bound, so setups without terms hash as before
            digest.update(b"terms" + self.terms)
        return digest.digest()

    def graph(self, seed: int) -> Graph:
        return Graph(self.n, self.k, seed)


def graph_seed(setup_hash: bytes, reveals: Sequence[tuple[int, bytes]]) -> int:
    """The masking graph's seed from every committed client's revealed randomness (sorted by
    client): any one honest, unpredictable reveal makes it uniform."""
    digest = hashlib.sha256(b"dpfleet/secagg/graph-seed" + setup_hash)
    for u, reveal in sorted(reveals):
        digest.update(struct.pack("<I", u) + reveal)
    return int.from_bytes(digest.digest()[:16], "little")


def plan_round(
    n: int,
    length: int,
    bits: int = 32,
    graph: str = "harary",
    threshold: int | None = None,
    dropout: float = 0.1,
    corruption: float = 0.05,
    signed: bool = False,
    identity_keys: Mapping[int, Ed25519PrivateKey] | None = None,
    public_keys: Mapping[int, bytes] | None = None,
    terms: bytes = b"",
) -> tuple[RoundSetup, dict[int, Ed25519PrivateKey] | None, GraphPlan]:
    """A round for n simulated clients: the setup (fresh session id), the clients' identity
    keys (signed mode; generated unless an emulated fleet's `identity_keys` are given) and the
    graph plan behind k and t; a networked coordinator, which never holds private keys, passes
    the devices' registered `public_keys` instead (signed). An explicit `threshold` overrides
    the derived one (and must still satisfy the setup's rules); `terms` binds what the inputs
    mean (`count_bit.terms_digest`)."""
    plan = plan_graph(n, graph, dropout, corruption)
    keys = None
    if signed and public_keys is not None:
        identities = dict(public_keys)
    elif signed:
        keys = dict(identity_keys) if identity_keys is not None else {
            u: Ed25519PrivateKey.generate() for u in range(n)}
        identities = {u: k.public_key().public_bytes_raw() for u, k in keys.items()}
    else:
        identities = None
    setup = RoundSetup(
        n=n,
        k=plan.k,
        threshold=plan.threshold if threshold is None else threshold,
        length=length,
        bits=bits,
        corrupt=plan.corrupt,
        identities=identities,
        terms=terms,
    )
    return setup, keys, plan
