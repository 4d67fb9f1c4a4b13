"""Tree-aggregation noise for DP-FTRL (Kairouz et al. 2021), tracked as residuals.

Round t (1-based within a tree) releases the prefix sum of the first t round sums plus the
noise of the dyadic tree nodes that cover [1, t]: one node per set bit of t, so at most
ceil(log2(t + 1)) nodes. Every node's noise is an independent N(0, std^2 I) vector.

Following paper 002 App. B ("PrivateSum"), we never hold the un-noised prefix sum: the
coordinator adds only the *residual* noise(t) - noise(t-1) to round t's sum, so the prefix sums
of what it releases are exactly the tree-noised prefix sums, and any server optimizer (momentum)
can consume the per-round values. The live state is a stack of at most log2(T) node vectors.

Node noise is drawn from a generator keyed by (seed, tree, level, index): the streaming residual
and a direct recomputation of a prefix's noise agree exactly, which the tests check. The seed is
a server secret; checkpoints store it with the stack.
"""

from __future__ import annotations

import numpy as np


def prefix_nodes(t: int) -> list[tuple[int, int]]:
    """Dyadic nodes (level, index) whose leaf ranges partition [1, t]."""
    if t < 1:
        raise ValueError("prefix length must be >= 1")
    nodes, start = [], 0
    for level in range(t.bit_length() - 1, -1, -1):
        if t >> level & 1:
            nodes.append((level, start >> level))  # covers leaves start+1 .. start+2^level
            start += 1 << level
    return nodes


class TreeNoise:
    """Streaming residual noise of the online binary tree mechanism."""

    def __init__(self, dim: int, std: float, seed: int, tree_id: int = 0):
        if std < 0:
            raise ValueError("noise std must be >= 0")
        self.dim, self.std, self.seed, self.tree_id = dim, std, seed, tree_id
        self.t = 0
        self.stack: list[tuple[int, int, np.ndarray]] = []  # (level, index, noise)

    def node_noise(self, level: int, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.tree_id, level, index])
        return rng.standard_normal(self.dim, dtype=np.float32) * np.float32(self.std)

    def prefix_noise(self, t: int) -> np.ndarray:
        """Direct (non-streaming) noise of prefix t: the reference the stream must equal."""
        total = np.zeros(self.dim, dtype=np.float32)
        for level, index in prefix_nodes(t):
            total += self.node_noise(level, index)
        return total

    def next_residual(self) -> np.ndarray:
        """Advance one round and return noise(t) - noise(t-1)."""
        self.t += 1
        level = (self.t & -self.t).bit_length() - 1  # the new node's level = trailing zeros of t
        residual = self.node_noise(level, (self.t - 1) >> level)
        new = residual.copy()
        while self.stack and self.stack[-1][0] < level:  # children merged into the new node
            residual -= self.stack.pop()[2]
        self.stack.append((level, (self.t - 1) >> level, new))
        return residual

    def current_noise(self) -> np.ndarray:
        total = np.zeros(self.dim, dtype=np.float32)
        for _, _, noise in self.stack:
            total += noise
        return total

    def state_dict(self) -> dict:
        return {
            "dim": self.dim, "std": self.std, "seed": self.seed, "tree_id": self.tree_id,
            "t": self.t, "nodes": [(lv, ix) for lv, ix, _ in self.stack],
            "noise": [n for _, _, n in self.stack],
        }

    @classmethod
    def from_state(cls, state: dict) -> TreeNoise:
        tree = cls(state["dim"], state["std"], state["seed"], state["tree_id"])
        tree.t = state["t"]
        tree.stack = [(lv, ix, n) for (lv, ix), n in zip(state["nodes"], state["noise"], strict=True)]
        return tree
