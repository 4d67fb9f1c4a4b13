"""A malicious SecAgg server for the attack tests, driving the REAL client state machines.

It stands in for a coordinator that deviates from the protocol: it runs the honest phases by
hand (so every message can be swapped on the way), may show different clients different
survivor lists, controls colluding clients (it reads their held shares and signs anything
with their identity keys), and in the end does its best to rebuild one target's input from
everything it saw: y_u minus every mask whose secret it could reconstruct. Tests then assert
on that estimate, not on an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dpfleet.secagg import crypto
from dpfleet.secagg import messages as m
from dpfleet.secagg.client import SecAggClient
from dpfleet.secagg.errors import ReconstructionError, SecAggError
from dpfleet.secagg.params import RoundSetup, graph_seed
from dpfleet.secagg.policy import ClientPolicy

Tamper = Callable[[int, tuple], tuple]


def fleet(n: int) -> dict[int, Ed25519PrivateKey]:
    return {u: Ed25519PrivateKey.generate() for u in range(n)}


class MaliciousServer:
    """One attempt of a round, run by an attacker; `rejected[u]` says why client u stopped."""

    def __init__(self, setup: RoundSetup, keys: Mapping[int, Ed25519PrivateKey] | None,
                 inputs: np.ndarray, policy: ClientPolicy | None = None,
                 setups: Mapping[int, RoundSetup] | None = None) -> None:
        """setups: per-client setups the server hands out instead of `setup` (default none)."""
        self.setup, self.keys, self.inputs = setup, keys, inputs
        self.ctx = setup.setup_hash
        pinned = {u: k.public_key().public_bytes_raw() for u, k in keys.items()} if keys else None
        self.clients: dict[int, SecAggClient] = {}
        self.rejected: dict[int, Exception] = {}
        for u in range(setup.n):
            given = (setups or {}).get(u, setup)
            try:
                self.clients[u] = SecAggClient(given, u, keys[u] if keys and given.signed
                                               else None, policy or ClientPolicy.lenient(),
                                               pinned)
            except SecAggError as exc:
                self.rejected[u] = exc
        self.adverts: dict[int, bytes] = {}
        self.share_keys: dict[int, m.ShareKeys] = {}
        self.masked: dict[int, np.ndarray] = {}

    def _ask(self, u: int, message: m.Message) -> m.Message | None:
        """Deliver to a live client; its reply, or None (and why) when it refuses."""
        if u not in self.clients or u in self.rejected:
            return None
        try:
            out = self.clients[u].handle(m.encode(message))
        except SecAggError as exc:
            self.rejected[u] = exc
            return None
        self.last_wire = out[0].data
        return m.decode(out[0].data)

    def run_until_masked(self, commitments: Tamper | None = None, reveals: Tamper | None = None,
                         adverts: Tamper | None = None) -> None:
        """Commit, reveal, keys, shares and masked inputs, with optional per-recipient
        tampering of the commitment list, the reveal list and the neighbours' adverts."""
        commits = {u: m.decode(c.start()[0].data) for u, c in self.clients.items()}
        fixed = tuple(sorted((u, c.commitment) for u, c in commits.items()))
        for u in self.clients:
            view = commitments(u, fixed) if commitments else fixed
            reply = self._ask(u, m.SeedCommitments(self.ctx, m.SERVER, u, view))
            if reply is not None:
                self.adverts[u] = self.last_wire
        opened = tuple(sorted((u, m.decode(a).reveal) for u, a in self.adverts.items()))
        self.graph = self.setup.graph(graph_seed(self.ctx, opened))
        for u in list(self.adverts):
            blobs = tuple(self.adverts[v] for v in sorted(self.graph.neighbours(u))
                          if v in self.adverts)
            view = reveals(u, opened) if reveals else opened
            blobs = adverts(u, blobs) if adverts else blobs
            reply = self._ask(u, m.KeyBroadcast(self.ctx, m.SERVER, u, view, blobs))
            if reply is not None:
                self.share_keys[u] = reply
        inbox: dict[int, list] = {v: [] for v in self.share_keys}
        for w, message in self.share_keys.items():
            for v, sealed in message.shares:
                if v in inbox:
                    inbox[v].append((w, sealed))
        for v in self.share_keys:
            self.clients[v].provide_input(self.inputs[v])
            reply = self._ask(v, m.SharesForward(self.ctx, m.SERVER, v, tuple(inbox[v])))
            if reply is not None:
                self.masked[v] = reply.vector

    def split_view(self, target: int, colluders: set[int]) -> dict[str, list]:
        """Tell half of the honest survivors that `target` survived (they return its self-mask
        seed share) and the other half that it dropped (they return its masking-key share);
        colluders sign both lists. Returns the target's shares the attacker collected."""
        alive = tuple(sorted(self.masked))
        with_target = alive
        without = tuple(a for a in alive if a != target)
        honest = [a for a in alive if a not in colluders and a != target]
        view = {a: with_target for a in honest[0::2]} | {a: without for a in honest[1::2]}
        view[target] = with_target
        signatures: dict[tuple, dict[int, bytes]] = {with_target: {}, without: {}}
        if self.setup.signed:
            for a, survivors in view.items():
                if self._ask(a, m.ConsistencyCheck(self.ctx, m.SERVER, a, survivors)):
                    signatures[survivors][a] = self.last_wire[-m.SIGNATURE_BYTES:]
            for c in colluders:
                for survivors in signatures:
                    statement = m.ConsistencySignature(self.ctx, c, m.SERVER, survivors)
                    # exactly what the colluder's own client would sign (encode's signature)
                    signatures[survivors][c] = m.encode(statement, self.keys[c])[
                        -m.SIGNATURE_BYTES:]
        collected: dict[str, list] = {"self_mask": [], "mask_key": []}
        for a, survivors in view.items():
            proof = tuple((v, signatures[survivors][v]) for v in sorted(self.graph.neighbours(a))
                          if v in signatures[survivors])
            reply = self._ask(a, m.UnmaskRequest(self.ctx, m.SERVER, a, survivors, proof))
            if reply is None:
                continue
            for kind in collected:
                share = dict(getattr(reply, kind)).get(target)
                if share is not None:
                    collected[kind].append((a + 1, share))
        for c in colluders:  # a colluder hands over both of its shares
            held = self.clients[c]._held.get(target)
            if held is not None:
                collected["mask_key"].append((c + 1, held[0]))
                collected["self_mask"].append((c + 1, held[1]))
        return collected

    def estimate(self, target: int, collected: Mapping[str, list]) -> np.ndarray:
        """The attacker's best reconstruction of the target's input: its masked vector minus
        every mask whose secret the collected shares rebuild (zeros if it never got y_u)."""
        if target not in self.masked:
            return np.zeros(self.setup.length, dtype=self.setup.dtype)
        y = self.masked[target].copy()
        t = self.setup.threshold
        commitment = self.share_keys[target].commitment
        try:
            seed, _ = crypto.reconstruct_checked(
                collected["self_mask"], t, crypto.SEED_BYTES,
                lambda s: crypto.seed_commitment(self.ctx, target, s) == commitment)
            crypto.add_streams(y, [], [seed])
        except ReconstructionError:
            pass
        s_public = m.decode(self.adverts[target]).s_public
        try:
            raw, _ = crypto.reconstruct_checked(
                collected["mask_key"], t, crypto.KEY_BYTES,
                lambda s: crypto.public_bytes(X25519PrivateKey.from_private_bytes(s)) == s_public)
            key = X25519PrivateKey.from_private_bytes(raw)
            for v in sorted(self.graph.neighbours(target)):
                if v not in self.share_keys:
                    continue
                shared = crypto.exchange(key, m.decode(self.adverts[v]).s_public)
                stream = crypto.pairwise_mask_seed(shared, self.ctx, target, v)
                crypto.add_streams(y, *(([], [stream]) if target < v else ([stream], [])))
        except ReconstructionError:
            pass
        y &= y.dtype.type(self.setup.modulus_mask)
        return y


def match_fraction(estimate: np.ndarray, truth: np.ndarray) -> float:
    """Share of coordinates the attacker got exactly right (2^-bits by chance)."""
    return float(np.mean(estimate == truth))
