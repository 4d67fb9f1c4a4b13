"""Tree-noise generation cost per round: AES-256-CTR (secret key) against the old PCG64 draws.

Each round of the online tree draws exactly one new node vector and folds the finished children
into the residual (`TreeNoise.next_residual`); this times that per round for the main job's model
(d = 81,088) and a 4.4M-parameter model, with the node noise from `noise_stream.GaussianNodes`
(AES-CTR keystream -> 53-bit uniforms -> Box-Muller, float64 -> float32) and from the code before
issue 10 (`np.random.default_rng([seed, tree, level, index]).standard_normal(d, float32)`). It also
splits the AES path into keystream and Box-Muller. Ratios are within one run, same load.
Results: benchmarks/results/noise_generation.json.

    python benchmarks/noise_generation.py [--rounds 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dpfleet.coordinator.mechanisms.noise_stream import (
    GaussianNodes,
    NodeStream,
    new_noise_key,
    standard_normals,
)
from dpfleet.coordinator.mechanisms.tree_noise import TreeNoise

ROOT = Path(__file__).resolve().parents[1]
DIMS = (81_088, 4_400_000)


class OldPCG64Nodes:
    """The node noise before issue 10 (seeded from the config seed: not private)."""

    def __init__(self, seed: int, std: float, dim: int):
        self.seed, self.std, self.dim = seed, std, dim

    def __call__(self, tree_id: int, level: int, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, tree_id, level, index])
        return rng.standard_normal(self.dim, dtype=np.float32) * np.float32(self.std)


def per_round_seconds(nodes, dim: int, rounds: int, repeats: int) -> list[float]:
    """Median-able samples of the mean seconds per `next_residual` over `rounds` rounds."""
    out = []
    for _ in range(repeats):
        tree = TreeNoise(dim, nodes)
        t0 = time.perf_counter()
        for _ in range(rounds):
            tree.next_residual()
        out.append((time.perf_counter() - t0) / rounds)
    return out


def timed(fn, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "noise_generation.json")
    args = ap.parse_args()
    key = new_noise_key()
    load_before = os.getloadavg()
    results = []
    for dim in DIMS:
        aes = per_round_seconds(GaussianNodes(key, 1.0, dim), dim, args.rounds, args.repeats)
        old = per_round_seconds(OldPCG64Nodes(0, 1.0, dim), dim, args.rounds, args.repeats)
        stream = timed(lambda d=dim: NodeStream(key, 0, 0, 1).words(d + d % 2), args.repeats)
        normals = timed(lambda d=dim: standard_normals(NodeStream(key, 0, 0, 2), d), args.repeats)
        row = {
            "dim": dim,
            "aes_ctr_seconds_per_round": statistics.median(aes),
            "old_pcg64_seconds_per_round": statistics.median(old),
            "aes_over_old": statistics.median(aes) / statistics.median(old),
            "aes_keystream_seconds_per_node": statistics.median(stream),
            "aes_keystream_plus_box_muller_seconds_per_node": statistics.median(normals),
            "samples": {"aes": aes, "old": old},
        }
        results.append(row)
        ms = {k: v * 1e3 for k, v in row.items() if k.endswith(("round", "node"))}
        print(f"d = {dim:>9,}: AES-CTR {ms['aes_ctr_seconds_per_round']:8.1f} ms/round, old PCG64 "
              f"{ms['old_pcg64_seconds_per_round']:8.1f} ms/round (x{row['aes_over_old']:.2f}); "
              f"keystream {ms['aes_keystream_seconds_per_node']:.1f} ms, keystream + Box-Muller "
              f"{ms['aes_keystream_plus_box_muller_seconds_per_node']:.1f} ms")
    out = {
        "rounds_per_sample": args.rounds, "repeats": args.repeats, "results": results,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "machine": platform.machine(), "python": platform.python_version(),
        "numpy": np.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
