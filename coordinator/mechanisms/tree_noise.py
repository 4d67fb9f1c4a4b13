"""Tree-aggregation noise for DP-FTRL (Kairouz et al. 2021), tracked as residuals.

Round t (1-based within a tree) releases the prefix sum of the first t round sums plus the
noise of the dyadic tree nodes that cover [1, t]: one node per set bit of t, so at most
ceil(log2(t + 1)) nodes. Every node's noise is an independent N(0, std^2 I) vector.

Following paper 002 App. B ("PrivateSum"), we never hold the un-noised prefix sum: the
coordinator adds only the *residual* noise(t) - noise(t-1) to round t's sum, so the prefix sums
of what it releases are exactly the tree-noised prefix sums, and any server optimizer (momentum)
can consume the per-round values. The live state is a stack of at most log2(T) node vectors.

The tree does not draw noise itself: `nodes(tree_id, level, index)` returns a node's vector
(float32 `noise_stream.GaussianNodes`, keyed by the run's secret noise key; int64 for the discrete
Gaussian), and the residual and prefix arithmetic run in that dtype. Nodes are pure functions of
their position, so the streaming residual and a direct recomputation of a prefix's noise agree
exactly (the tests check it) and a resumed tree is rebuilt from the key. The live stack is state
in memory only: `state_dict` keeps its positions, never a vector (with the released model, the
vectors' sum would let anyone without the key subtract the noise).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dpfleet.errors import DpfleetError


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


NodeFn = Callable[[int, int, int], np.ndarray]  # (tree_id, level, index) -> node noise, shape (dim,)


class TreeNoise:
    """Streaming residual noise of the online binary tree mechanism, in the nodes' dtype."""

    def __init__(self, dim: int, nodes: NodeFn, tree_id: int = 0):
        self.dim, self.nodes, self.tree_id = dim, nodes, tree_id
        self.t = 0
        self.stack: list[tuple[int, int, np.ndarray]] = []  # (level, index, noise)

    def node_noise(self, level: int, index: int) -> np.ndarray:
        noise = np.asarray(self.nodes(self.tree_id, level, index))
        if noise.shape != (self.dim,):
            raise ValueError(f"node noise of shape {noise.shape}, expected ({self.dim},)")
        return noise

    def prefix_noise(self, t: int) -> np.ndarray:
        """Direct (non-streaming) noise of prefix t: the reference the stream must equal."""
        parts = [self.node_noise(level, index) for level, index in prefix_nodes(t)]
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        return total

    @staticmethod
    def new_node(t: int) -> tuple[int, int]:
        """(level, index) of the node that round t of a tree adds: level = trailing zeros of t."""
        level = (t & -t).bit_length() - 1
        return level, (t - 1) >> level

    def next_residual(self) -> np.ndarray:
        """Advance one round and return noise(t) - noise(t-1)."""
        self.t += 1
        level, index = self.new_node(self.t)
        new = self.node_noise(level, index)
        residual = new.copy()
        while self.stack and self.stack[-1][0] < level:  # children merged into the new node
            residual -= self.stack.pop()[2]
        self.stack.append((level, index, new))
        return residual

    def state_dict(self) -> dict:
        """Positions only (JSON): never a node vector, which is noise (`from_state` rebuilds them
        from the key). The live (level, index) pairs are those of `prefix_nodes(t)`."""
        return {"dim": self.dim, "tree_id": self.tree_id, "t": self.t,
                "nodes": [[lv, ix] for lv, ix, _ in self.stack]}

    @classmethod
    def from_state(cls, state: dict, nodes: NodeFn) -> TreeNoise:
        """The tree `state_dict` describes, its live nodes recomputed by `nodes` (O(log t) of
        them). A resume point of an older dpfleet also held their vectors: they are ignored."""
        tree = cls(int(state["dim"]), nodes, int(state["tree_id"]))
        tree.t = int(state["t"])
        live = prefix_nodes(tree.t) if tree.t else []
        if "nodes" in state and [tuple(n) for n in state["nodes"]] != live:
            raise DpfleetError(f"a saved noise tree at t = {tree.t} lists the live nodes {state['nodes']}, "
                               f"not {[list(n) for n in live]}: the resume point was edited")
        tree.stack = [(lv, ix, tree.node_noise(lv, ix)) for lv, ix in live]
        return tree
