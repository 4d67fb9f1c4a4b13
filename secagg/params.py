"""What all parties of one SecAgg round agree on before it starts, and its fingerprint.

The coordinator fixes these in the round's plan: a fresh random session id (per attempt, so
nothing from an earlier attempt at the same round is accepted), the number of clients n, the
masking degree k, the Shamir threshold t, the corruption c the threshold is sized against, the
vector length, the ring Z_(2^bits), and -- in signed mode -- the clients' long-term Ed25519
identity keys, and optionally `terms`, a digest of what the inputs mean (the discretizer and
adaptive clipping's threshold, `count_bit`), and `unrevealed`, the most committed clients whose
graph-seed reveals may be missing (`graph_seed`). `setup_hash` is SHA-256 over all of it; it is
every message header's context, the HKDF info of every derived key, the AAD of every sealed
share and the signed prefix of every signature, so two clients holding different setups
cannot talk to each other at all.

The masking graph's seed is not a setup parameter: the server could grind it. It is derived in
the round from commit-and-reveal among the clients (`graph_seed`). Up to `unrevealed` committed
clients may vanish before revealing; a server withholding reveals then chooses among
G graphs (`graph.choice_bits`), and `plan_graph` sizes c for all of them (THREAT_MODEL.md).
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
from dpfleet.secagg.graph import CORRECTNESS_BITS, Graph, GraphPlan, log_tails, plan_graph

SESSION_BYTES = 32
TERMS_BYTES = 32
CLIENT_MESSAGES = 6  # a client's messages in a round: commit, advertise, share, mask, check, unmask
MIN_PLANNED_DROPOUT = 0.1


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
    # d: committed clients whose graph-seed reveals may be missing (0: every committer reveals)
    unrevealed: int = 0

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
        if not 0 <= self.unrevealed < 2**32:
            raise ValueError(f"unrevealed must be in 0..2^32-1, got {self.unrevealed}")
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
        if self.unrevealed:  # likewise: setups allowing no missing reveal hash as before
            digest.update(b"unrevealed" + struct.pack("<I", self.unrevealed))
        return digest.digest()

    @property
    def reveal_slack(self) -> int:
        """Committed clients that may be missing from the forwarded reveals: `unrevealed`, or
        any number on the complete graph, which no seed changes (nothing to choose among)."""
        return self.n if self.k == self.n - 1 else self.unrevealed

    def graph(self, seed: int) -> Graph:
        return Graph(self.n, self.k, seed)


def graph_seed(setup_hash: bytes, reveals: Sequence[tuple[int, bytes]]) -> int:
    """The masking graph's seed from the forwarded reveals (sorted by client; at least all
    committed clients but `reveal_slack`): any one honest, unpredictable reveal makes it
    uniform for each choice of who is missing."""
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
    unrevealed: int = 0,
) -> tuple[RoundSetup, dict[int, Ed25519PrivateKey] | None, GraphPlan]:
    """A round for n simulated clients: the setup (fresh session id), the clients' identity
    keys (signed mode; generated unless an emulated fleet's `identity_keys` are given) and the
    graph plan behind k and t; a networked coordinator, which never holds private keys, passes
    the devices' registered `public_keys` instead (signed). An explicit `threshold` overrides
    the derived one (and must still satisfy the setup's rules); `terms` binds what the inputs
    mean (`count_bit.terms_digest`); `unrevealed` is d, the committed clients that may vanish
    before revealing (c is then sized for every graph a withholding server can choose)."""
    plan = plan_graph(n, graph, dropout, corruption, unrevealed=unrevealed)
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
        unrevealed=unrevealed,
    )
    return setup, keys, plan


def fleet_margins(n: int, report_goal: int, eta: int = CORRECTNESS_BITS) -> tuple[float, int]:
    """(dropout, d) for a networked round of n assigned devices that must keep `report_goal`:
    what the coordinator plans the round with and what each device, from the same config,
    recomputes for its own policy (`fleet.participant.local_policy`).

    dropout: the share of the round its over-selection may lose, (n - goal) / n, at least 0.1.
    d: that dropout spread evenly over a client's six messages is p = 1 - (1 - dropout)^(1/6)
    per phase; d covers the commit-to-reveal phase up to Bin(n, p)'s 2^-eta tail, and never
    exceeds n - goal (with more clients gone before revealing, too few are left for the goal
    anyway, so a larger d would only widen the server's choice of graphs)."""
    if not 1 <= report_goal <= n:
        raise ValueError(f"report goal {report_goal} must be in 1..{n} devices")
    dropout = max(MIN_PLANNED_DROPOUT, (n - report_goal) / n)
    per_phase = 1 - (1 - dropout) ** (1 / CLIENT_MESSAGES)
    tails = log_tails(n, per_phase)  # tails[i] = log P[Bin(n, p) >= i]
    quantile = int(np.argmax(tails[1:] <= -eta * np.log(2)))  # P[more than it] <= 2^-eta
    return dropout, min(n - report_goal, quantile)
