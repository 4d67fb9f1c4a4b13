"""The online binary tree (Kairouz et al. 2021) as a `Mechanism`: dpfleet's first strategy.

Noise: `tree_noise.TreeNoise` over node vectors that are pure functions of (key, domain, tree,
level, index): `noise_stream.GaussianNodes` on the float path (domains b"gauss" for the model,
b"count" for adaptive clipping's counts) and `ring_noise.ring_nodes` (int64 discrete Gaussians,
b"dgauss") in the SecAgg ring. A resume point holds the tree's position only; `resume` recomputes
the live nodes from the key (O(log t) of them). Sensitivity: the exact worst case over every
participation pattern with the MinS / MaxP given and the restarts (`tree_sensitivity`, every
dyadic node). Restarts start a fresh tree (a new tree id) and keep the accounting exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpfleet.coordinator.mechanisms.base import Mechanism, check_purpose
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.coordinator.mechanisms.registry import register
from dpfleet.coordinator.mechanisms.tree_noise import TreeNoise
from dpfleet.coordinator.mechanisms.tree_sensitivity import (
    pattern_sensitivity_squared,
    tree_sensitivity_squared,
)

DOMAINS = {"model": b"gauss", "count": b"count"}


class TreeMechanism(Mechanism):
    """The online binary tree: log2(n) node noises per prefix sum, restarts allowed."""

    name = "tree"
    supports_restarts = True

    def __init__(self, nodes: str = "all"):
        """`nodes`: "all" dyadic nodes (the published analysis, what a run accounts) or "prefix"
        (only those a streaming prefix sum uses: exact for the plain online tree, tighter)."""
        self.nodes = nodes

    def identity(self) -> dict:
        return {"kind": "tree"} if self.nodes == "all" else {"kind": "tree", "nodes": self.nodes}

    def sensitivity_squared(self, rounds: int, min_separation: int | None, max_participation: int,
                            restarts: Sequence[int] = ()) -> int:
        if max_participation == 0:
            return 0
        return tree_sensitivity_squared(rounds, max_participation, min_separation, list(restarts),
                                        nodes=self.nodes)

    def device_sensitivity_squared(self, patterns: Sequence[Sequence[int]], rounds: int,
                                   restarts: Sequence[int] = ()) -> np.ndarray:
        """The exact sens^2 of each device's actual pattern (never above the worst case)."""
        return pattern_sensitivity_squared(patterns, rounds, list(restarts), nodes=self.nodes)

    def _nodes(self, dim: int, std: float, key: bytes, purpose: str) -> GaussianNodes:
        return GaussianNodes(key, std, dim, DOMAINS[check_purpose(purpose)])

    def stream(self, dim: int, std: float, key: bytes, segment: int = 0,
               purpose: str = "model") -> TreeNoise:
        return TreeNoise(dim, self._nodes(dim, std, key, purpose), segment)

    def resume(self, state: dict, dim: int, std: float, key: bytes, purpose: str = "model") -> TreeNoise:
        """The live nodes recomputed from the key (no replay: O(log t) nodes, not t)."""
        return TreeNoise.from_state(state, self._nodes(dim, std, key, purpose))

    def ring_stream(self, plan, key: bytes, segment: int = 0) -> TreeNoise:
        from dpfleet.coordinator.mechanisms.ring_noise import ring_nodes

        return TreeNoise(plan.length, ring_nodes(plan, key), segment)

    def resume_ring(self, state: dict, plan, key: bytes) -> TreeNoise:
        from dpfleet.coordinator.mechanisms.ring_noise import ring_nodes

        return TreeNoise.from_state(state, ring_nodes(plan, key))

    def prefix_error(self, rounds: int) -> float:
        from dpfleet.coordinator.mechanisms.spec import MechanismSpec, prefix_error

        return prefix_error(MechanismSpec("tree", rounds))

    def describe(self) -> str:
        return ("online binary tree (Kairouz et al. 2021): round t's prefix sum carries the noise "
                "of the popcount(t) dyadic nodes that cover it")


register("tree", TreeMechanism, lambda rounds, mins, maxp: TreeMechanism(),
         lambda identity: TreeMechanism(identity.get("nodes", "all")),
         "online binary tree (Kairouz et al. 2021): log2(n) node noises per prefix sum;\n"
         "no optimisation, exact sensitivity by dynamic program (today's default).")
