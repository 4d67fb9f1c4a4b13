"""The tree mechanism's residual noise in Z^dim (int64 nodes, e.g. discrete Gaussian).

Same arithmetic as `tree_noise.TreeNoise` (paper 002 App. B, PrivateSum): round t adds
noise(t) - noise(t-1), where noise(t) is the sum of the nodes `prefix_nodes(t)`. In integers the
residual stream and a direct prefix recomputation agree exactly, with no rounding at all.

Nodes come from `nodes(tree_id, level, index)`, a deterministic function of the run's secret
key, so the state is just (tree_id, t): `at(t)` rebuilds the live stack by recomputing
`prefix_nodes(t)`. (To be unified with TreeNoise once that takes a `nodes` callable.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dpfleet.coordinator.tree_noise import prefix_nodes

Nodes = Callable[[int, int, int], np.ndarray]


class IntegerTreeNoise:
    """Streaming residual noise of the online binary tree, with int64 node vectors."""

    def __init__(self, dim: int, nodes: Nodes, tree_id: int = 0):
        self.dim, self.nodes, self.tree_id = dim, nodes, tree_id
        self.t = 0
        self.stack: list[tuple[int, int, np.ndarray]] = []  # (level, index, noise)

    def node(self, level: int, index: int) -> np.ndarray:
        noise = np.asarray(self.nodes(self.tree_id, level, index))
        if noise.dtype != np.int64 or noise.shape != (self.dim,):
            raise TypeError(f"integer tree nodes must be int64 of shape ({self.dim},), "
                            f"got {noise.dtype} {noise.shape}")
        return noise

    def prefix_noise(self, t: int) -> np.ndarray:
        """Direct (non-streaming) noise of prefix t: the reference the stream must equal."""
        total = np.zeros(self.dim, dtype=np.int64)
        for level, index in prefix_nodes(t):
            total += self.node(level, index)
        return total

    def next_residual(self) -> np.ndarray:
        """Advance one round and return noise(t) - noise(t-1)."""
        self.t += 1
        level = (self.t & -self.t).bit_length() - 1  # the new node's level = trailing zeros of t
        new = self.node(level, (self.t - 1) >> level)
        residual = new.copy()
        while self.stack and self.stack[-1][0] < level:  # children merged into the new node
            residual -= self.stack.pop()[2]
        self.stack.append((level, (self.t - 1) >> level, new))
        return residual

    def at(self, t: int) -> IntegerTreeNoise:
        """Jump to just after round t (e.g. on resume): the live stack is prefix_nodes(t)."""
        self.t = t
        self.stack = [(lv, ix, self.node(lv, ix)) for lv, ix in (prefix_nodes(t) if t else [])]
        return self
