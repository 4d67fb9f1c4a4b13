"""A server that shows two groups of honest clients two different masking graphs and tries to
read one target's input (tests/test_secagg_split_graph.py, benchmarks/adversarial/split_graph.py).

Why: the graph seed is SHA-256(setup hash, reveals), and nothing makes two clients hold the same
reveal (or commitment) list, so a server can hand the target and the clients around it one list
(graph G_T) and everyone else another (G_B). The attack then uses the freedom a shared graph
would not give: who holds whose shares and who masks with whom is decided per view.

The server's best plan against the target u, given c colluding neighbours of u in G_T:
  - M: u's honest neighbours in G_T (they see G_T too, so each also has u as a neighbour);
  - H: t - c of M whose shares u receives, so u masks with H and the colluders only (u needs t);
    these are later declared dropped to their share holders, who are asked for their keys;
  - Q: the rest of M, who receive u's shares (u never gets theirs) and are told u survived, so
    they return shares of u's self-mask seed b_u; the colluders hand over both of their shares.
  - Then y_u - PRG(b_u) - (the masks with H and the colluders) is x_u, if b_u and H's keys
    were rebuilt. Everything runs through the REAL client state machines; only the server and
    the colluders are the attacker's.

Runs under old main's dpfleet too (no test-only imports): `python split_graph.py` prints the
result of both splits as JSON (the benchmark runs it under /work/basevenv/bin/python).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dpfleet.secagg import crypto
from dpfleet.secagg import messages as m
from dpfleet.secagg.client import SecAggClient
from dpfleet.secagg.errors import ReconstructionError, SecAggError
from dpfleet.secagg.params import RoundSetup, graph_seed
from dpfleet.secagg.policy import ClientPolicy

N, K, T, C, LENGTH, BITS = 40, 6, 5, 2, 64, 16  # 2t = 10 > k + c = 8
TARGET = 0
RADIUS = 4  # hops around the target in G_T that see G_T (its neighbours' neighbours all do)


def _ball(graph, centre: int, radius: int) -> set[int]:
    ball = {centre}
    for _ in range(radius):
        ball |= {w for v in ball for w in graph.neighbours(v)}
    return ball


def make_setup(withhold: int) -> RoundSetup:
    """The round under attack; `withhold` = d (reveals that may be missing), 0 on old main."""
    extra = {"unrevealed": withhold} if withhold else {}
    keys = {u: Ed25519PrivateKey.generate() for u in range(N)}
    setup = RoundSetup(n=N, k=K, threshold=T, corrupt=C, length=LENGTH, bits=BITS,
                       identities={u: k.public_key().public_bytes_raw() for u, k in keys.items()},
                       **extra)
    return setup, keys


class SplitGraphServer:
    """One attempt, split into views "T" (the target's) and "B"; `rejected[u]`: why u stopped."""

    def __init__(self, setup: RoundSetup, keys: dict, inputs: np.ndarray) -> None:
        self.setup, self.keys, self.inputs = setup, keys, inputs
        self.ctx = setup.setup_hash
        pinned = {u: k.public_key().public_bytes_raw() for u, k in keys.items()}
        self.clients = {u: SecAggClient(setup, u, keys[u], ClientPolicy.lenient(), pinned)
                        for u in range(setup.n)}
        self.rejected: dict[int, str] = {}

    def _ask(self, u: int, message: m.Message) -> tuple[m.Message, bytes] | None:
        if u in self.rejected:
            return None
        try:
            wire = self.clients[u].handle(m.encode(message))[0].data
        except SecAggError as exc:
            self.rejected[u] = f"{type(exc).__name__}: {exc}"
            return None
        return m.decode(wire), wire

    def run(self, split: str, colluders_wanted: int, lists: str = "one") -> dict:
        """split: "reveals" (the target's group misses d reveals the others get; needs d > 0),
        "commitments" (one client's commitment is left out of the target's group's list,
        which also works with d = 0) or "none" (one shared graph: the baseline). Returns what
        the attacker recovered and why. lists: "one" (H dropped for everyone; u's shares go
        to Q only) or "two" (u's shares go to H too, and H is told u survived, so b_u has k
        holders; H's own holders are told H dropped: local consistency across the views is
        what must stop it)."""
        n, ctx, t = self.setup.n, self.ctx, self.setup.threshold
        target = TARGET
        commits = {u: m.decode(c.start()[0].data).commitment for u, c in self.clients.items()}
        every = tuple(sorted(commits.items()))
        absent = frozenset(range(n - max(1, getattr(self.setup, "unrevealed", 0)), n))
        if split == "commitments":  # decided before any reveal: `absent` alone sees them all
            committed = {u: every if u in absent else tuple((v, c) for v, c in every
                                                              if v not in absent)
                         for u in range(n)}
        else:
            committed = dict.fromkeys(range(n), every)
        adverts = {}
        for u in range(n):
            reply = self._ask(u, m.SeedCommitments(ctx, m.SERVER, u, committed[u]))
            if reply is not None:
                adverts[u] = reply[1]
        opened = {u: m.decode(a).reveal for u, a in adverts.items()}
        reveals = {"B": tuple(sorted(opened.items()))}
        if split == "reveals":  # the server picks which d reveals the target's group misses
            for left_out in itertools.combinations(sorted(set(opened) - {target}), len(absent)):
                reveals["T"] = tuple(sorted((u, r) for u, r in opened.items()
                                            if u not in left_out))
                ball = _ball(self.setup.graph(graph_seed(ctx, reveals["T"])), target, RADIUS)
                if not ball & set(left_out):
                    absent = frozenset(left_out)
                    break
        elif split == "commitments":
            reveals["T"] = tuple(sorted((u, r) for u, r in opened.items() if u not in absent))
        else:  # "none": one graph for everyone, the same attack as a baseline
            reveals["T"], absent = reveals["B"], frozenset()
        graphs = {v: self.setup.graph(graph_seed(ctx, r)) for v, r in reveals.items()}
        g_t = graphs["T"]
        if split != "reveals":  # fixed before the reveals: `absent` alone sees all
            view = {u: "B" if u in absent else "T" for u in range(n)}
        else:  # the target's neighbourhood, far enough out that nobody near it is starved
            ball = _ball(g_t, target, RADIUS)
            view = {u: "T" if u in ball else "B" for u in range(n)}
        around = sorted(g_t.neighbours(target) - absent)
        colluders = set(around[:colluders_wanted])
        honest_around = [v for v in around if v not in colluders]
        partners = honest_around[: max(0, t - len(colluders))]  # H: u masks with these
        holders = [v for v in honest_around if v not in partners]  # Q: hold u's shares

        share_keys: dict[int, m.ShareKeys] = {}
        peers: dict[int, set[int]] = {}
        s_keys: dict[int, X25519PrivateKey] = {}
        for u in adverts:
            graph = graphs[view[u]]
            peers[u] = {v for v in graph.neighbours(u) if v in adverts
                        and v in dict(reveals[view[u]])}
            blobs = tuple(adverts[v] for v in sorted(peers[u]))
            reply = self._ask(u, m.KeyBroadcast(ctx, m.SERVER, u, reveals[view[u]], blobs))
            if reply is not None:
                share_keys[u] = reply[0]
                if u in colluders:  # the attacker owns this device and its masking key
                    s_keys[u] = self.clients[u]._s_key
        inbox: dict[int, list] = {v: [] for v in share_keys}
        for w, message in share_keys.items():
            for v, sealed in message.shares:
                if v not in inbox or w not in peers.get(v, ()):
                    continue  # v never took w's advert: it would refuse the whole message
                if w == target and v not in (holders if lists == "one" else around) + sorted(
                        colluders):
                    continue
                if v == target and w not in partners and w not in colluders:
                    continue
                inbox[v].append((w, sealed))
        masked = {}
        for v in share_keys:
            self.clients[v].provide_input(self.inputs[v])
            reply = self._ask(v, m.SharesForward(ctx, m.SERVER, v, tuple(inbox[v])))
            if reply is not None:
                masked[v] = reply[0].vector
        held_by = {v: {w for w, _ in inbox[v]} for v in inbox}  # who holds whose shares

        # "one": one survivor list, H dropped, so H's holders return H's masking keys and u's
        # holders its seed share. "two": H and u's other neighbours are told everyone survived,
        # the other holders of H's shares that H dropped. Each client is shown its list without
        # those of its own neighbours that never shared with it (it would refuse it otherwise).
        everyone = frozenset(masked)
        shown = {}
        for a in sorted(everyone - colluders - {target}):
            if lists == "one" and a in partners:
                continue  # told it dropped, it would refuse
            told_dropped = lists == "one" or (held_by[a] & set(partners) and a not in around)
            base = everyone - set(partners) if told_dropped else everyone
            strangers = set(graphs[view[a]].neighbours(a)) - held_by[a] - {a}
            shown[a] = tuple(sorted(base - strangers))
        lists = shown
        signatures: dict[tuple, dict[int, bytes]] = {s: {} for s in set(lists.values())}
        for a, survivors in lists.items():
            reply = self._ask(a, m.ConsistencyCheck(ctx, m.SERVER, a, survivors))
            if reply is not None:
                signatures[survivors][a] = reply[1][-m.SIGNATURE_BYTES:]
        for c in colluders:  # a colluder signs every list
            for survivors in signatures:
                statement = m.ConsistencySignature(ctx, c, m.SERVER, survivors)
                signatures[survivors][c] = m.encode(statement, self.keys[c])[-m.SIGNATURE_BYTES:]
        seed_shares: dict[int, list] = {}
        key_shares: dict[int, list] = {}
        for a, survivors in lists.items():
            proof = tuple((v, signatures[survivors][v])
                          for v in sorted(graphs[view[a]].neighbours(a))
                          if v in signatures[survivors])
            reply = self._ask(a, m.UnmaskRequest(ctx, m.SERVER, a, survivors, proof))
            if reply is None:
                continue
            for owner, share in reply[0].self_mask:
                seed_shares.setdefault(owner, []).append((a + 1, share))
            for owner, share in reply[0].mask_key:
                key_shares.setdefault(owner, []).append((a + 1, share))
        for c in colluders:  # a colluder hands over both shares of everything it holds
            for owner, (key_share, seed_share) in self.clients[c]._held.items():
                key_shares.setdefault(owner, []).append((c + 1, key_share))
                seed_shares.setdefault(owner, []).append((c + 1, seed_share))

        public = {u: m.decode(a).s_public for u, a in adverts.items()}
        for owner, shares in key_shares.items():
            if owner not in s_keys:
                try:
                    raw, _ = crypto.reconstruct_checked(
                        shares, t, crypto.KEY_BYTES,
                        lambda s, o=owner: crypto.public_bytes(
                            X25519PrivateKey.from_private_bytes(s)) == public[o])
                    s_keys[owner] = X25519PrivateKey.from_private_bytes(raw)
                except ReconstructionError:
                    pass
        estimate = np.zeros(LENGTH, dtype=self.setup.dtype)
        seed_rebuilt = False
        masks_removed = []
        if target in masked:
            estimate = masked[target].copy()
            commitment = share_keys[target].commitment
            try:
                seed, _ = crypto.reconstruct_checked(
                    seed_shares.get(target, []), t, crypto.SEED_BYTES,
                    lambda s: crypto.seed_commitment(ctx, target, s) == commitment)
                crypto.add_streams(estimate, [], [seed])
                seed_rebuilt = True
            except ReconstructionError:
                pass
            for p in sorted(held_by[target]):
                if target in s_keys:
                    shared = crypto.exchange(s_keys[target], public[p])
                elif p in s_keys:
                    shared = crypto.exchange(s_keys[p], public[target])
                else:
                    continue
                stream = crypto.pairwise_mask_seed(shared, ctx, target, p)
                crypto.add_streams(estimate, *(([], [stream]) if target < p else ([stream], [])))
                masks_removed.append(p)
            estimate &= estimate.dtype.type(self.setup.modulus_mask)
        truth = self.inputs[target]
        return {
            "split": split,
            "views_differ": graphs["T"].seed != graphs["B"].seed,
            "group_sizes": {v: sum(1 for u in view.values() if u == v) for v in ("T", "B")},
            "colluders": len(colluders),
            "partners": len(partners),
            "holders": len(holders),
            "target_masked": target in masked,
            "masking_partners_of_target": sorted(held_by.get(target, ())),
            "self_mask_seed_shares": len(seed_shares.get(target, [])),
            "masking_key_shares": len(key_shares.get(target, [])),
            "self_mask_seed_rebuilt": seed_rebuilt,
            "masks_removed": len(masks_removed),
            "partner_key_shares": [len(key_shares.get(h, [])) for h in partners],
            "partner_keys_rebuilt": sum(1 for h in partners if h in s_keys),
            "masks_in_y": len(held_by.get(target, ())),
            "match_fraction": float(np.mean(estimate == truth)),
            "exact": bool(np.array_equal(estimate, truth)),
            "rejected": len(self.rejected),
            "estimate": estimate,
        }


def attack(split: str, colluders: int, seed: int = 0, lists: str = "one") -> dict:
    """One attacked round (n = 40, k = 6, t = 5, c = 2) with `colluders` colluding neighbours
    of the target (c is the model's bound; t is the positive control beyond it)."""
    withhold = 2 if split == "reveals" else 0
    setup, keys = make_setup(withhold)
    inputs = np.random.default_rng(seed).integers(0, 1 << BITS, (N, LENGTH)).astype(np.uint16)
    return SplitGraphServer(setup, keys, inputs).run(split, colluders, lists)


def main() -> None:
    """Every split (no "reveals" where RoundSetup has no d): c colluders with either list
    strategy, t colluders (the positive control)."""
    splits = ["none", "commitments"] + (["reveals"] if "unrevealed" in RoundSetup.__dataclass_fields__
                                else [])
    runs = {f"{s}/{k}/{lists}": {key: v for key, v in attack(s, k, lists=lists).items()
                                 if key != "estimate"}
            for s in splits for k, lists in ((C, "one"), (C, "two"), (T, "one"))}
    print(json.dumps({"n": N, "k": K, "t": T, "c": C, "runs": runs}))


if __name__ == "__main__":
    main()
