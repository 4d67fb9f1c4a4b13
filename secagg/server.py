"""The server side of SecAgg / SecAgg+ as a sans-I/O state machine.

`handle(bytes)` validates and stores one client message; once every expected client of the
phase has spoken it closes the phase itself and returns the next broadcast. `close_phase()`
is what a transport calls when the phase's deadline passes: it goes on with whoever answered,
or aborts cleanly when fewer than the threshold did. Rejected messages raise a specific
`SecAggError` before any state changes, so they never reach the sum.

Masked inputs are folded into a running sum as they arrive (the server never holds one
device's vector after `handle` returns). Unmasking rebuilds the survivors' self-mask seeds
(checked against their commitments) and the dropped clients' masking keys (checked against
their advertised public keys), then removes the matching PRG streams from the sum.

Between phases the server prunes clients with fewer than t live neighbours (SecAgg+): their
secrets could never be rebuilt, so they are left out before anyone masks against them.

The masking graph comes from the clients' commit-and-reveal: the server collects commitments,
fixes the list, then collects the reveals with the keys. Up to `RoundSetup.reveal_slack`
committed clients may fail to reveal (they are then dropouts like any other); more abort the
attempt (a retry needs a fresh session id): every reveal it may leave out multiplies the graphs
a dishonest server could choose among, and c is sized for exactly d of them (`plan_graph`).
A share that does not fit its commitment or public key does not abort the round: other
t-subsets are tried (`crypto.reconstruct_checked`) and the holders whose shares disagree are
reported in `inconsistent`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dpfleet.secagg import crypto
from dpfleet.secagg.client import REVEAL_BYTES, SEALED_SHARE, SEED_SHARE, SK_SHARE, reveal_commitment
from dpfleet.secagg.errors import (
    DuplicateMessageError,
    ProtocolViolationError,
    ReconstructionError,
    SecAggError,
    ThresholdError,
    UnexpectedMessageError,
    UnknownSenderError,
)
from dpfleet.secagg.graph import Graph
from dpfleet.secagg.messages import (
    SERVER,
    SIGNATURE_BYTES,
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
    verify,
)
from dpfleet.secagg.params import RoundSetup, graph_seed

_PROBE, _ = crypto.generate_keypair()  # only to test advertised keys for low order

# phase -> the one client message type it collects
PHASE_MESSAGE: dict[str, type[Message]] = {
    "commit": SeedCommit,
    "keys": AdvertiseKeys,
    "shares": ShareKeys,
    "masked": MaskedInput,
    "consistency": ConsistencySignature,
    "unmask": UnmaskShares,
}


class SecAggServer:
    """The aggregator's part in one round: learns the sum over survivors and nothing else."""

    def __init__(self, setup: RoundSetup) -> None:
        self.setup = setup
        self.context = setup.setup_hash
        self.phase = "commit"
        self.error: SecAggError | None = None  # why the round aborted
        self.survivors: tuple[int, ...] = ()  # U3: clients whose inputs are in the sum
        self.graph: Graph | None = None  # known once the reveals are in
        self.inconsistent: dict[int, list[int]] = {}  # owner -> holders whose share was bad
        self._commitments: dict[int, bytes] = {}
        self._neighbours: list[frozenset[int]] = []
        self._expected: frozenset[int] = frozenset(range(setup.n))
        self._answered: set[int] = set()  # who delivered the current phase's message
        self._seen: set[tuple[int, type[Message]]] = set()
        self._adverts: dict[int, tuple[bytes, bytes, bytes, bytes]] = {}  # (c, s, blob, reveal)
        self._keys_seen: set[bytes] = set()
        self._shares: dict[int, ShareKeys] = {}
        self._alive: frozenset[int] = frozenset()  # clients still in after the last pruning
        self._signatures: dict[int, bytes] = {}
        self._unmask: dict[int, dict[str, dict[int, bytes]]] = {}  # v -> kind -> owner -> share
        self._sum = np.zeros(setup.length, dtype=setup.dtype)

    # ------------------------------------------------------------------------ interface

    def handle(self, data: bytes) -> list[Outbound]:
        """Take one client message; returns the next phase's messages when the phase is full."""
        message = decode(data)
        check_header(message, self.context, SERVER)
        u = message.sender
        if not 0 <= u < self.setup.n:
            raise UnknownSenderError(f"no client {u} in this round")
        if self.setup.signed:
            verify(data, self.setup.identities[u], self.context)
        if (u, type(message)) in self._seen:
            raise DuplicateMessageError(f"client {u} already sent {type(message).__name__}")
        if PHASE_MESSAGE.get(self.phase) is not type(message):
            raise UnexpectedMessageError(f"{type(message).__name__} not expected in phase "
                                         f"{self.phase}")
        if u not in self._expected:
            raise UnknownSenderError(f"client {u} is not part of phase {self.phase}")
        getattr(self, f"_take_{self.phase}")(message, data)
        self._seen.add((u, type(message)))
        self._answered.add(u)
        if self._answered >= self._expected:
            return self.close_phase()
        return []

    def close_phase(self) -> list[Outbound]:
        """End the current phase with whoever answered (deadline passed, or all in)."""
        if self.phase not in PHASE_MESSAGE:
            raise RuntimeError(f"no phase to close: the round is {self.phase}")
        answered = frozenset(self._answered)
        self._answered = set()
        try:
            return getattr(self, f"_close_{self.phase}")(answered)
        except (ThresholdError, ReconstructionError) as exc:
            self.error, self.phase = exc, "aborted"
            return [Outbound(u, encode(Abort(self.context, SERVER, u, str(exc))))
                    for u in sorted(answered)]

    def result(self) -> np.ndarray:
        """The sum over `survivors` in Z_(2^bits); raises the abort reason if there is none."""
        if self.phase == "aborted":
            raise self.error
        if self.phase != "done":
            raise RuntimeError(f"round not finished (phase {self.phase})")
        return self._sum

    # ------------------------------------------------------------- collecting messages

    def _take_commit(self, m: SeedCommit, data: bytes) -> None:
        if len(m.commitment) != 32:
            raise ProtocolViolationError("graph-seed commitment must be 32 bytes")
        self._commitments[m.sender] = m.commitment

    def _take_keys(self, m: AdvertiseKeys, data: bytes) -> None:
        if len(m.reveal) != REVEAL_BYTES or reveal_commitment(
                self.context, m.sender, m.reveal) != self._commitments[m.sender]:
            raise ProtocolViolationError("graph-seed reveal does not open the commitment")
        if len(m.c_public) != crypto.KEY_BYTES or len(m.s_public) != crypto.KEY_BYTES:
            raise ProtocolViolationError("public keys must be 32 bytes")
        if m.c_public == m.s_public or {m.c_public, m.s_public} & self._keys_seen:
            raise ProtocolViolationError("public keys must differ from each other and all others")
        for key in (m.c_public, m.s_public):
            crypto.exchange(_PROBE, key)  # refuses low-order points before anyone uses them
        self._adverts[m.sender] = (m.c_public, m.s_public, data, m.reveal)
        self._keys_seen |= {m.c_public, m.s_public}

    def _take_shares(self, m: ShareKeys, data: bytes) -> None:
        recipients = [v for v, _ in m.shares]
        if sorted(recipients) != sorted(self._neighbours[m.sender] & self._alive):
            raise ProtocolViolationError("shares must go to each live neighbour exactly once")
        if len(m.commitment) != 32 or any(len(s) != SEALED_SHARE for _, s in m.shares):
            raise ProtocolViolationError("malformed commitment or share ciphertext")
        self._shares[m.sender] = m

    def _take_masked(self, m: MaskedInput, data: bytes) -> None:
        v = m.vector
        if m.bits != self.setup.bits or v.dtype != self.setup.dtype or v.size != self.setup.length:
            raise ProtocolViolationError(f"masked input must be {self.setup.length} elements "
                                         f"of {self.setup.dtype}")
        if self.setup.bits < 8 * v.itemsize and np.any(v > self.setup.modulus_mask):
            raise ProtocolViolationError(f"masked input leaves Z_2^{self.setup.bits}")
        np.add(self._sum, v, out=self._sum)

    def _take_consistency(self, m: ConsistencySignature, data: bytes) -> None:
        if m.survivors != self.survivors:
            raise ProtocolViolationError("client signed another survivor list")
        self._signatures[m.sender] = data[-SIGNATURE_BYTES:]

    def _take_unmask(self, m: UnmaskShares, data: bytes) -> None:
        held = self._neighbours[m.sender] & self._alive
        want_seed = sorted(held & set(self.survivors))
        want_key = sorted(held - set(self.survivors))
        if [w for w, _ in m.self_mask] != want_seed or [w for w, _ in m.mask_key] != want_key:
            raise ProtocolViolationError("unmask shares do not match the survivor list")
        if any(len(s) != SEED_SHARE for _, s in m.self_mask) or any(
            len(s) != SK_SHARE for _, s in m.mask_key
        ):
            raise ProtocolViolationError("unmask share of the wrong size")
        self._unmask[m.sender] = {"self_mask": dict(m.self_mask), "mask_key": dict(m.mask_key)}

    # ---------------------------------------------------------------- closing phases

    def _close_commit(self, answered: frozenset[int]) -> list[Outbound]:
        if len(answered) <= self.setup.threshold:
            raise ThresholdError(f"{len(answered)} commitments, threshold "
                                 f"{self.setup.threshold}: abort")
        self._expected, self.phase = answered, "keys"
        fixed = tuple(sorted((u, self._commitments[u]) for u in answered))
        return [Outbound(u, encode(SeedCommitments(self.context, SERVER, u, fixed)))
                for u in sorted(answered)]

    def _close_keys(self, answered: frozenset[int]) -> list[Outbound]:
        silent = sorted(self._expected - answered)
        if len(silent) > self.setup.reveal_slack:
            raise ThresholdError(f"clients {silent[:5]} ({len(silent)}) committed but did not "
                                 f"reveal, the setup allows {self.setup.reveal_slack}: the "
                                 f"attempt aborts (retry with a fresh session id)")
        reveals = tuple(sorted((u, self._adverts[u][3]) for u in answered))
        self.graph = self.setup.graph(graph_seed(self.context, reveals))
        self._neighbours = [self.graph.neighbours(u) for u in range(self.setup.n)]
        self._advance(self._prune(answered), "shares")
        return [
            Outbound(u, encode(KeyBroadcast(self.context, SERVER, u, reveals, tuple(
                self._adverts[v][2] for v in sorted(self._neighbours[u] & self._alive)))))
            for u in sorted(self._alive)
        ]

    def _close_shares(self, answered: frozenset[int]) -> list[Outbound]:
        self._advance(self._prune(answered), "masked")
        inbox: dict[int, list[tuple[int, bytes]]] = {v: [] for v in self._alive}
        for w in sorted(self._alive):
            for v, sealed in self._shares[w].shares:
                if v in self._alive:
                    inbox[v].append((w, sealed))
        return [Outbound(v, encode(SharesForward(self.context, SERVER, v, tuple(inbox[v]))))
                for v in sorted(self._alive)]

    def _close_masked(self, answered: frozenset[int]) -> list[Outbound]:
        self._require(answered, "masked inputs")
        self.survivors = tuple(sorted(answered))
        self._expected = answered
        ctx = self.context
        if self.setup.signed:
            self.phase = "consistency"
            return [Outbound(u, encode(ConsistencyCheck(ctx, SERVER, u, self.survivors)))
                    for u in self.survivors]
        self.phase = "unmask"
        return [Outbound(u, encode(UnmaskRequest(ctx, SERVER, u, self.survivors, ())))
                for u in self.survivors]

    def _close_consistency(self, answered: frozenset[int]) -> list[Outbound]:
        self._require(answered, "consistency signatures")
        self._expected, self.phase = answered, "unmask"
        ctx = self.context
        return [Outbound(u, encode(UnmaskRequest(ctx, SERVER, u, self.survivors, tuple(
                    (v, self._signatures[v]) for v in sorted(self._neighbours[u] & answered)))))
                for u in sorted(answered)]

    def _close_unmask(self, answered: frozenset[int]) -> list[Outbound]:
        self._require(answered, "unmask responses")
        alive_set = set(self.survivors)
        seeds = {w: self._collect(w, answered, "self_mask") for w in self.survivors}
        keys = {w: self._collect(w, answered, "mask_key") for w in self._alive - alive_set}
        ctx = self.context
        plus: list[bytes] = []
        minus: list[bytes] = []
        for w, shares in seeds.items():
            minus.append(self._rebuild(
                w, shares, crypto.SEED_BYTES, "self-mask seed",
                lambda s, w=w: crypto.seed_commitment(ctx, w, s) == self._shares[w].commitment))
        for w, shares in keys.items():
            key = X25519PrivateKey.from_private_bytes(self._rebuild(
                w, shares, crypto.KEY_BYTES, "masking key",
                lambda s, w=w: crypto.public_bytes(X25519PrivateKey.from_private_bytes(s))
                == self._adverts[w][1]))
            for v in sorted(self._neighbours[w] & alive_set):
                # v added +PRG(s_vw) if v < w, else -PRG(s_vw); take it back out.
                shared = crypto.exchange(key, self._adverts[v][1])
                seed = crypto.pairwise_mask_seed(shared, ctx, v, w)
                (minus if v < w else plus).append(seed)
        crypto.add_streams(self._sum, plus, minus)
        self._sum &= self._sum.dtype.type(self.setup.modulus_mask)
        self.phase = "done"
        return []

    # -------------------------------------------------------------------------- helpers

    def _require(self, answered: Iterable[int], what: str) -> None:
        count = len(frozenset(answered))
        if count < self.setup.threshold:
            raise ThresholdError(f"{count} {what}, threshold {self.setup.threshold}: abort")

    def _prune(self, answered: frozenset[int]) -> frozenset[int]:
        """Largest subset in which everyone keeps at least t live neighbours."""
        alive, t = set(answered), self.setup.threshold
        changed = True
        while changed:
            weak = {u for u in alive if len(self._neighbours[u] & alive) < t}
            alive -= weak
            changed = bool(weak)
        return frozenset(alive)

    def _advance(self, alive: frozenset[int], phase: str) -> None:
        self._require(alive, "clients with enough live neighbours")
        self._alive, self._expected, self.phase = alive, alive, phase

    def _rebuild(self, owner: int, shares: list[tuple[int, bytes]], length: int, what: str,
                 valid: Callable[[bytes], bool]) -> bytes:
        """The owner's secret, checked by `valid`; bad holders go to `inconsistent`."""
        try:
            secret, bad = crypto.reconstruct_checked(shares, self.setup.threshold, length, valid)
        except ReconstructionError as exc:
            raise ReconstructionError(f"{what} of client {owner}: {exc}") from exc
        if bad:
            self.inconsistent[owner] = [x - 1 for x in bad]  # share point x = holder + 1
        return secret

    def _collect(self, owner: int, answered: frozenset[int], kind: str) -> list[tuple[int, bytes]]:
        holders = sorted(self._neighbours[owner] & answered)
        shares = [(v + 1, self._unmask[v][kind][owner]) for v in holders]
        if len(shares) < self.setup.threshold:
            raise ThresholdError(f"client {owner}: {len(shares)} shares returned, threshold "
                                 f"{self.setup.threshold}: abort")
        return shares
