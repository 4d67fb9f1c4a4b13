"""What a client insists on before it takes part: its local policy and its pinned keys.

The setup comes from the server, so the client must not take it on trust: a server that hands
one client a smaller threshold, a smaller neighbourhood, fewer clients, more room to withhold
graph-seed reveals, or its own identity key in place of a neighbour's could rebuild that
client's secrets. The client therefore checks the
setup against minimums configured on the device (`ClientPolicy`) and, in signed mode, against
the identity keys it got out of band (a fleet registry or key file the coordinator cannot
rewrite), before it derives or sends anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dpfleet.secagg.errors import PolicyError
from dpfleet.secagg.params import RoundSetup


@dataclass(frozen=True)
class ClientPolicy:
    """Minimums a device accepts. `lenient()` keeps only the protocol's own rules (tests)."""

    min_clients: int = 2
    min_degree: int = 1
    min_threshold: int = 1
    min_corrupt: int = 0  # the setup must size t against at least this many colluders
    require_signed: bool = True
    # the most committed clients a sparse setup may let go unrevealed (None: any): each one
    # more multiplies the graphs a withholding server chooses among (`graph.choice_bits`)
    max_unrevealed: int | None = 0

    @classmethod
    def lenient(cls) -> ClientPolicy:
        return cls(require_signed=False, max_unrevealed=None)

    @classmethod
    def for_setup(cls, setup: RoundSetup) -> ClientPolicy:
        """A policy demanding exactly this setup's strength (what an emulated fleet configures
        its devices with; anything weaker the server hands out is refused)."""
        return cls(min_clients=setup.n, min_degree=setup.k, min_threshold=setup.threshold,
                   min_corrupt=setup.corrupt, require_signed=setup.signed,
                   max_unrevealed=setup.unrevealed)

    def check(self, setup: RoundSetup, client_id: int, own_identity: bytes | None,
              pinned: Mapping[int, bytes] | None) -> None:
        """Raise `PolicyError` unless `setup` is at least as strong as this policy and, when
        signed, its identity list is exactly the pinned keys (and names us by our own key)."""
        if not 0 <= client_id < setup.n:
            raise PolicyError(f"setup has no client {client_id}")
        weaker = [
            f"{name} {have} < {need}" for name, have, need in (
                ("clients", setup.n, self.min_clients), ("degree", setup.k, self.min_degree),
                ("threshold", setup.threshold, self.min_threshold),
                ("assumed corrupt", setup.corrupt, self.min_corrupt))
            if have < need
        ]
        sparse = setup.k < setup.n - 1  # the complete graph is the same under every seed
        if sparse and self.max_unrevealed is not None and setup.unrevealed > self.max_unrevealed:
            weaker.append(f"unrevealed {setup.unrevealed} > {self.max_unrevealed}")
        if weaker:
            raise PolicyError("setup is weaker than the local policy: " + ", ".join(weaker))
        if self.require_signed and not setup.signed:
            raise PolicyError("the local policy requires signed mode")
        if not setup.signed:
            return
        if pinned is None:
            raise PolicyError("signed mode needs identity keys pinned out of band")
        if setup.identities[client_id] != own_identity:
            raise PolicyError("setup lists another identity key for this client")
        substituted = [u for u in range(setup.n) if pinned.get(u) != setup.identities[u]]
        if substituted:
            raise PolicyError(f"setup identity keys differ from the pinned ones for clients "
                              f"{substituted[:5]}{'...' if len(substituted) > 5 else ''}")
