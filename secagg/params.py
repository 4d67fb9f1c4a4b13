"""What all parties of one SecAgg round agree on before it starts.

The coordinator fixes these in the round's plan: the round id (bound into every message, key
derivation and signature, so nothing from another round is accepted), the masking graph, the
Shamir threshold, the vector length, the ring Z_(2^bits), and -- in the malicious-server
setting -- the clients' long-term Ed25519 identity keys (the PKI that makes signatures mean
something).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.secagg.crypto import ring_dtype
from dpfleet.secagg.graph import Graph, GraphPlan, plan_graph


@dataclass(frozen=True)
class RoundSetup:
    """Public parameters of one round; `identities` set means signed (malicious-server) mode."""

    round_id: int
    graph: Graph
    threshold: int
    length: int
    bits: int
    identities: Mapping[int, bytes] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.threshold <= self.graph.k:
            raise ValueError(f"threshold must be in 1..{self.graph.k}, got {self.threshold}")
        if self.length < 1:
            raise ValueError(f"vector length must be positive, got {self.length}")
        ring_dtype(self.bits)
        if self.identities is not None and set(self.identities) != set(range(self.n)):
            raise ValueError("identities must hold one Ed25519 public key per client")

    @property
    def n(self) -> int:
        return self.graph.n

    @property
    def signed(self) -> bool:
        return self.identities is not None

    @property
    def dtype(self) -> np.dtype:
        return ring_dtype(self.bits)

    @property
    def modulus_mask(self) -> int:
        return (1 << self.bits) - 1


def plan_round(
    n: int,
    length: int,
    bits: int = 32,
    graph: str = "harary",
    threshold: int | None = None,
    dropout: float = 0.1,
    corruption: float = 0.05,
    signed: bool = False,
    round_id: int = 0,
    seed: int = 0,
) -> tuple[RoundSetup, dict[int, Ed25519PrivateKey] | None, GraphPlan]:
    """A round for n simulated clients: the setup, the clients' identity keys (signed mode
    only; a real fleet would hold them on the devices) and the graph plan behind k and t.
    An explicit `threshold` overrides the derived one."""
    plan = plan_graph(n, graph, dropout, corruption, malicious=signed)
    keys = {u: Ed25519PrivateKey.generate() for u in range(n)} if signed else None
    identities = {u: k.public_key().public_bytes_raw() for u, k in keys.items()} if keys else None
    setup = RoundSetup(
        round_id=round_id,
        graph=Graph(n, plan.k, seed),
        threshold=plan.threshold if threshold is None else threshold,
        length=length,
        bits=bits,
        identities=identities,
    )
    return setup, keys, plan
