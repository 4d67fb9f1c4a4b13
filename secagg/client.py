"""The client side of SecAgg / SecAgg+ as a sans-I/O state machine.

`start()` yields the first message; `handle(bytes)` consumes one server message and returns the
replies. Nothing here touches a socket or a clock, so the same object runs in unit tests, the
in-process simulation and behind a network transport. A message that fails any check raises a
specific `SecAggError` and leaves the client exactly as it was.

Phases: new -> committed -> advertised -> shared -> masked [-> checked] -> done (or aborted).
Before anything else the client checks the setup against its local policy and pinned identity
keys (`policy.py`). It commits to graph-seed randomness, reveals it with its keys once every
commitment is fixed, and derives the masking graph itself from all reveals, so the server
cannot pick who masks with whom (up to `RoundSetup.reveal_slack` committed clients may be
missing from the reveals, no more: c is sized for every graph that choice allows). It
reveals, for each neighbour, either the share of its self-mask seed (neighbour survived) or
the share of its masking key (neighbour dropped), once, and never both; in signed mode only
for a survivor list that t of its own neighbours signed under the same setup hash. Its
secrets are dropped as soon as it is done or aborted.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.secagg import crypto
from dpfleet.secagg.errors import (
    DuplicateMessageError,
    ProtocolViolationError,
    ThresholdError,
    UnexpectedMessageError,
    UnknownSenderError,
)
from dpfleet.secagg.messages import (
    SERVER,
    Abort,
    AdvertiseKeys,
    ConsistencyCheck,
    ConsistencySignature,
    KeyBroadcast,
    MaskedInput,
    Message,
    Outbound,
    SeedCommit,
    SeedCommitments,
    ShareKeys,
    SharesForward,
    UnmaskRequest,
    UnmaskShares,
    check_header,
    decode,
    encode,
    signed_part,
    verify,
    verify_detached,
)
from dpfleet.secagg.params import RoundSetup, graph_seed
from dpfleet.secagg.policy import ClientPolicy

SK_SHARE = crypto.share_bytes(crypto.KEY_BYTES)
SEED_SHARE = crypto.share_bytes(crypto.SEED_BYTES)
_IDS = struct.Struct("<II")
SHARE_PLAINTEXT = _IDS.size + SK_SHARE + SEED_SHARE
SEALED_SHARE = crypto.sealed_length(SHARE_PLAINTEXT)
REVEAL_BYTES = 32
GRAPH_LABEL = b"graph-seed"


def reveal_commitment(context: bytes, owner: int, reveal: bytes) -> bytes:
    """The commitment a client publishes to its graph-seed randomness."""
    return crypto.commitment(GRAPH_LABEL, context, owner, reveal)


class SecAggClient:
    """One device's part in one round."""

    def __init__(
        self,
        setup: RoundSetup,
        client_id: int,
        identity: Ed25519PrivateKey | None = None,
        policy: ClientPolicy | None = None,
        pinned: Mapping[int, bytes] | None = None,
    ) -> None:
        """policy: the device's minimums (None: `ClientPolicy()`, which demands signed mode --
        the default for anything that leaves one process; in-process simulations pass
        `ClientPolicy.lenient()`); pinned: the fleet's identity keys as the device got them
        out of band."""
        if setup.signed != (identity is not None):
            raise ValueError("signed rounds need the client's identity key, unsigned ones none")
        own = identity.public_key().public_bytes_raw() if identity is not None else None
        (policy or ClientPolicy()).check(setup, client_id, own, pinned)
        self.setup = setup
        self.context = setup.setup_hash
        self.id = client_id
        self.neighbours: frozenset[int] = frozenset()  # known once the graph seed is revealed
        self.phase = "new"
        self._identity = identity
        self._c_key, self._c_public = crypto.generate_keypair()
        self._s_key, self._s_public = crypto.generate_keypair()
        self._reveal = secrets.token_bytes(REVEAL_BYTES)
        self._commitments: dict[int, bytes] = {}
        self._peers: dict[int, tuple[bytes, bytes]] = {}  # neighbour -> (c_public, s_public)
        self._c_shared: dict[int, bytes] = {}  # neighbour -> X25519(c_u, c_v), both directions
        self._seed = b""  # b_u, the self-mask seed
        self._held: dict[int, tuple[bytes, bytes]] = {}  # owner -> (mask-key share, seed share)
        self._input: np.ndarray | None = None
        self._signed_survivors: tuple[int, ...] | None = None
        self._received: set[type[Message]] = set()

    # ------------------------------------------------------------------------ interface

    def start(self) -> list[Outbound]:
        """Round -1: commit to the graph-seed randomness."""
        if self.phase != "new":
            raise UnexpectedMessageError("client already started")
        self.phase = "committed"
        return self._send(SeedCommit(self.context, self.id, SERVER,
                                     reveal_commitment(self.context, self.id, self._reveal)))

    def provide_input(self, vector: np.ndarray) -> None:
        """The ring vector to sum (length and dtype of the round), needed before round 2."""
        vector = np.asarray(vector)
        if vector.shape != (self.setup.length,) or vector.dtype != self.setup.dtype:
            raise ValueError(f"input must be {self.setup.length} elements of {self.setup.dtype}")
        if self.setup.bits < 8 * vector.itemsize and np.any(vector > self.setup.modulus_mask):
            raise ValueError(f"input elements must be below 2^{self.setup.bits}")
        self._input = vector

    def handle(self, data: bytes) -> list[Outbound]:
        message = decode(data)
        check_header(message, self.context, self.id)
        if message.sender != SERVER:
            raise UnknownSenderError(f"client {self.id} only takes messages from the server")
        kind = type(message)
        if kind in self._received:
            raise DuplicateMessageError(f"{kind.__name__} already received")
        if kind is Abort and self.phase != "done":
            self.phase = "aborted"
            self._wipe()
            return []
        handler = {
            ("committed", SeedCommitments): self._on_commitments,
            ("advertised", KeyBroadcast): self._on_keys,
            ("shared", SharesForward): self._on_shares,
            ("masked", ConsistencyCheck if self.setup.signed else UnmaskRequest):
                self._on_check if self.setup.signed else self._on_unmask,
            ("checked", UnmaskRequest): self._on_unmask,
        }.get((self.phase, kind))
        if handler is None:
            raise UnexpectedMessageError(f"{kind.__name__} not expected in phase {self.phase}")
        replies = handler(message)
        self._received.add(kind)
        return replies

    # --------------------------------------------------------------------------- rounds

    def _on_commitments(self, message: SeedCommitments) -> list[Outbound]:
        committed = dict(message.commitments)
        ids = [u for u, _ in message.commitments]
        if ids != sorted(committed) or (ids and not 0 <= ids[0] <= ids[-1] < self.setup.n):
            raise ProtocolViolationError("commitments must come once per client, sorted")
        if committed.get(self.id) != reveal_commitment(self.context, self.id, self._reveal):
            raise ProtocolViolationError("our own graph-seed commitment is missing or altered")
        if len(committed) <= self.setup.threshold:
            raise ThresholdError(f"{len(committed)} committed clients, threshold "
                                 f"{self.setup.threshold}")
        self._commitments, self.phase = committed, "advertised"
        return self._send(AdvertiseKeys(self.context, self.id, SERVER,
                                        self._c_public, self._s_public, self._reveal))

    def _on_keys(self, message: KeyBroadcast) -> list[Outbound]:
        reveals = dict(message.reveals)
        ids = [u for u, _ in message.reveals]
        if ids != sorted(reveals) or not reveals.keys() <= self._commitments.keys():
            raise ProtocolViolationError("reveals must come once per committed client, sorted")
        missing = len(self._commitments) - len(reveals)
        if missing > self.setup.reveal_slack:
            # more would let the server choose among more graphs than c was sized for
            raise ProtocolViolationError(f"{missing} committed clients' reveals missing, the "
                                         f"setup allows {self.setup.reveal_slack}")
        if reveals.get(self.id) != self._reveal:
            raise ProtocolViolationError("our own graph-seed reveal is missing or altered")
        for u, reveal in message.reveals:
            if reveal_commitment(self.context, u, reveal) != self._commitments[u]:
                raise ProtocolViolationError(f"client {u}'s reveal does not open its commitment")
        neighbours = self.setup.graph(graph_seed(self.context, message.reveals)).neighbours(
            self.id)
        peers: dict[int, tuple[bytes, bytes]] = {}
        for blob in message.adverts:
            advert = decode(blob)
            if not isinstance(advert, AdvertiseKeys):
                raise ProtocolViolationError("key broadcast holds a non-advert message")
            check_header(advert, self.context, SERVER)
            if advert.sender not in neighbours:
                raise UnknownSenderError(f"client {advert.sender} is not a neighbour")
            if advert.sender in peers:
                raise DuplicateMessageError(f"two adverts from client {advert.sender}")
            if self.setup.signed:
                verify(blob, self.setup.identities[advert.sender], self.context)
            if advert.reveal != reveals.get(advert.sender):
                raise ProtocolViolationError("advert and reveal list disagree")
            if len(advert.c_public) != crypto.KEY_BYTES or len(advert.s_public) != crypto.KEY_BYTES:
                raise ProtocolViolationError("public keys must be 32 bytes")
            peers[advert.sender] = (advert.c_public, advert.s_public)
        keys = [k for pair in peers.values() for k in pair] + [self._c_public, self._s_public]
        if len(set(keys)) != len(keys):
            raise ProtocolViolationError("repeated public keys in the key broadcast")
        if len(peers) < self.setup.threshold:
            raise ThresholdError(f"{len(peers)} neighbours, threshold {self.setup.threshold}")

        seed = secrets.token_bytes(crypto.SEED_BYTES)
        holders = sorted(peers)
        # One polynomial per 16-bit limb, so the masking key's and the seed's limbs are shared
        # independently and can be reconstructed separately from the same shares.
        shares = crypto.share_secret(crypto.private_bytes(self._s_key) + seed,
                                     [v + 1 for v in holders], self.setup.threshold)
        ctx = self.context
        c_shared = {v: crypto.exchange(self._c_key, peers[v][0]) for v in holders}
        sealed = tuple(
            (v, crypto.seal(crypto.share_key(c_shared[v], ctx, self.id, v),
                            _IDS.pack(self.id, v) + share, crypto.share_aad(ctx, self.id, v)))
            for v, share in zip(holders, shares, strict=True)
        )
        self.neighbours, self._peers, self._c_shared, self._seed = (
            neighbours, peers, c_shared, seed)
        self._c_key = None  # only the derived share keys are needed from here on
        self.phase = "shared"
        return self._send(ShareKeys(ctx, self.id, SERVER,
                                    crypto.seed_commitment(ctx, self.id, seed), sealed))

    def _on_shares(self, message: SharesForward) -> list[Outbound]:
        ctx = self.context
        held: dict[int, tuple[bytes, bytes]] = {}
        for owner, sealed in message.shares:
            if owner not in self._peers:
                raise UnknownSenderError(f"shares from client {owner}, not an advertised neighbour")
            if owner in held:
                raise DuplicateMessageError(f"two share ciphertexts from client {owner}")
            if len(sealed) != SEALED_SHARE:
                raise ProtocolViolationError("share ciphertext has the wrong length")
            key = crypto.share_key(self._c_shared[owner], ctx, owner, self.id)
            plain = crypto.open_sealed(key, sealed, crypto.share_aad(ctx, owner, self.id))
            if _IDS.unpack_from(plain) != (owner, self.id):
                raise ProtocolViolationError("share names other parties than its envelope")
            share = plain[_IDS.size :]
            held[owner] = (share[:SK_SHARE], share[SK_SHARE:])
        if len(held) < self.setup.threshold:
            raise ThresholdError(f"{len(held)} neighbours shared, threshold {self.setup.threshold}")
        if self._input is None:
            raise RuntimeError("provide_input() must be called before the shares arrive")

        plus, minus = [self._seed], []
        for v in held:
            shared = crypto.exchange(self._s_key, self._peers[v][1])
            seed = crypto.pairwise_mask_seed(shared, ctx, self.id, v)
            (plus if self.id < v else minus).append(seed)
        masked = self._input.copy()
        crypto.add_streams(masked, plus, minus)
        if self.setup.bits < 8 * masked.itemsize:  # a full-width ring wraps by itself
            masked &= masked.dtype.type(self.setup.modulus_mask)
        self._held, self._input, self.phase = held, None, "masked"
        self._s_key, self._seed, self._c_shared = None, b"", {}  # now only shares are secret
        return self._send(MaskedInput(ctx, self.id, SERVER, masked, self.setup.bits))

    def _check_survivors(self, survivors: tuple[int, ...]) -> frozenset[int]:
        """U3 must be sorted, include us, reach the threshold, and hold no neighbour that did
        not share with us (such a neighbour cannot have masked against us)."""
        ids = list(survivors)
        if ids != sorted(set(ids)) or (ids and ids[-1] >= self.setup.n):
            raise ProtocolViolationError("survivor list is not sorted, unique client ids")
        alive = frozenset(survivors)
        if self.id not in alive:
            raise ProtocolViolationError("survivor list leaves out its recipient")
        if len(alive) < self.setup.threshold:
            raise ThresholdError(f"{len(alive)} survivors, threshold {self.setup.threshold}")
        if (alive & self.neighbours) - self._held.keys():
            raise ProtocolViolationError("survivor list names neighbours that never shared")
        return alive

    def _on_check(self, message: ConsistencyCheck) -> list[Outbound]:
        self._check_survivors(message.survivors)
        self._signed_survivors, self.phase = message.survivors, "checked"
        return self._send(ConsistencySignature(self.context, self.id, SERVER,
                                               message.survivors))

    def _on_unmask(self, message: UnmaskRequest) -> list[Outbound]:
        alive = self._check_survivors(message.survivors)
        if self.setup.signed:
            self._check_signatures(message)
        own = tuple((w, self._held[w][1]) for w in sorted(self._held) if w in alive)
        lost = tuple((w, self._held[w][0]) for w in sorted(self._held) if w not in alive)
        self.phase = "done"
        self._wipe()
        return self._send(UnmaskShares(self.context, self.id, SERVER, own, lost))

    def _check_signatures(self, message: UnmaskRequest) -> None:
        """Local consistency: at least t distinct neighbours of ours signed exactly the survivor
        list we signed, under our setup hash. Honest neighbours sign one list only, so with
        2t > k + c no two lists can both reach t among our k neighbours."""
        if message.survivors != self._signed_survivors:
            raise ProtocolViolationError("unmask survivor list differs from the one we signed")
        signers: set[int] = set()
        for signer, signature in message.signatures:
            if signer not in self.neighbours or signer not in message.survivors:
                raise ProtocolViolationError("consistency signer is not a surviving neighbour")
            if signer in signers:
                raise ProtocolViolationError("two consistency signatures from one neighbour")
            statement = ConsistencySignature(self.context, signer, SERVER, message.survivors)
            verify_detached(signed_part(statement), signature, self.setup.identities[signer],
                            self.context)
            signers.add(signer)
        if len(signers) < self.setup.threshold:
            raise ThresholdError(f"{len(signers)} neighbours signed the survivor list, threshold "
                                 f"{self.setup.threshold}")

    def _wipe(self) -> None:
        """Drop every secret: key pairs, seeds, held shares, pairwise keys, the input.
        (Python cannot overwrite immutable bytes in place; dropping the only references is
        what it can do, and the state machine refuses every later message anyway.)"""
        self._c_key = self._s_key = None
        self._seed, self._reveal = b"", b""
        self._held, self._c_shared, self._input = {}, {}, None

    def _send(self, message: Message) -> list[Outbound]:
        return [Outbound(SERVER, encode(message, self._identity))]
