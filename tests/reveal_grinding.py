"""A server that grinds the masking graph by withholding graph-seed reveals (for the attack test
and benchmarks/adversarial/commit_reveal_dropout.py).

The setup lets up to d committed clients go unrevealed. The server sees every reveal before it
forwards any, so it can try each set of at most d reveals to leave out (never the target's: the
target would refuse) and keep the graph that gives the target the most corrupt neighbours. Each
candidate graph is the REAL one the target would derive (`graph_seed`, `Graph.neighbours`).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from dpfleet.secagg.graph import Graph, log_tails
from dpfleet.secagg.params import graph_seed


def choices(n: int, d: int, target: int) -> list[frozenset[int]]:
    """Every set of at most d clients other than `target` the server may leave out."""
    others = [u for u in range(n) if u != target]
    return [frozenset(s) for i in range(d + 1) for s in itertools.combinations(others, i)]


def grind(n: int, k: int, corruption: float, d: int, trials: int, seed: int = 0,
          target: int = 0) -> dict:
    """Per trial (fresh reveals and a fresh colluder set, each client corrupt with probability
    `corruption`, the target honest): the target's corrupt-neighbour count in the graph of all
    reveals (an honest server) and the largest count over every withholding choice (the
    grinder). Also the per-graph tail P[Bin(k, corruption) > c] and G, for the union bound."""
    rng = np.random.default_rng(seed)
    context = rng.bytes(32)  # a setup hash; seeded, so a run repeats exactly
    options = choices(n, d, target)
    honest, ground = [], []
    for _ in range(trials):
        corrupt = {u for u in range(n) if u != target and rng.random() < corruption}
        reveals = [(u, rng.bytes(32)) for u in range(n)]
        counts = [len(Graph(n, k, graph_seed(context, [r for r in reveals if r[0] not in left]))
                      .neighbours(target) & corrupt) for left in options]
        honest.append(counts[0])  # options[0] leaves nothing out
        ground.append(max(counts))
    tails = np.exp(log_tails(k, corruption))  # tails[c + 1] = P[Bin(k, p) > c]
    return {"n": n, "k": k, "corruption": corruption, "d": d, "trials": trials,
            "graphs": len(options), "honest": np.array(honest), "ground": np.array(ground),
            "tail": {c: float(tails[c + 1]) for c in range(k + 1)}}


def exceed_rates(result: dict) -> list[dict]:
    """For each c: how often the honest graph and the grinder's best graph put more than c
    corrupt neighbours around the target, next to the union bound min(1, G * tail(c))."""
    rows = []
    for c, tail in result["tail"].items():
        rows.append({"c": c, "single_graph_tail": tail,
                     "union_bound": min(1.0, result["graphs"] * tail),
                     "honest_rate": float(np.mean(result["honest"] > c)),
                     "grinder_rate": float(np.mean(result["ground"] > c))})
    return rows


def slack(bound: float, trials: int) -> float:
    """Three binomial standard errors at the bound: room for sampling noise in a rate."""
    return 3 * math.sqrt(max(bound, 1.0 / trials) * (1 - min(bound, 0.5)) / trials)
