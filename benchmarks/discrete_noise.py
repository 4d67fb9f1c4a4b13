"""Cost of one tree node of noise: exact discrete Gaussian (dp.noise = "discrete") vs continuous.

Per dimension d (81,088 = the default CIFG model; 4.4M = the large LSTM), best of `--repeat`:
- discrete: `DiscreteGaussianNodes` at the sigma a 32-bit SecAgg ring with 20 clients and z = 1
  gets from `ring_noise.plan_ring`, driven by AES-256-CTR words (`NodeStream`); also the words it consumed per
  coordinate and the time AES alone takes for that many words;
- continuous: `GaussianNodes` (float32 Gaussian node under the same kind of key).
Ratios are within one run. Records cpu count, torch threads and load. Saves
results/discrete_noise.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from dpfleet.coordinator.mechanisms.discrete_gaussian import DiscreteGaussianNodes
from dpfleet.coordinator.mechanisms.noise_stream import GaussianNodes
from dpfleet.coordinator.mechanisms.noise_stream import NodeStream as Stream
from dpfleet.coordinator.mechanisms.ring_noise import plan_ring


class Counting:
    """Counts the words a sampler draws from the wrapped stream."""

    def __init__(self, stream):
        self.stream, self.count = stream, 0

    def words(self, n):
        self.count += n
        return self.stream.words(n)


def best_of(repeat: int, fn) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def measure(dim: int, key: bytes, repeat: int) -> dict:
    plan = plan_ring(dim, 0.3, 32, 20, 1.0, rounds=2000)
    counters = []

    def streams(t, lv, ix):
        counters.append(Counting(Stream(key, t, lv, ix, domain=b"dgauss")))
        return counters[-1]

    nodes = DiscreteGaussianNodes(plan.sigma_sq, plan.length, streams, t=plan.t)
    index = iter(range(10**6))
    discrete_s, sample = best_of(repeat, lambda: nodes(0, 0, next(index)))
    words = counters[-1].count
    aes_s, _ = best_of(repeat, lambda: Stream(key, 1, 0, 0, domain=b"dgauss").words(words))
    gaussian = GaussianNodes(key, 0.3, dim)
    continuous_s, _ = best_of(repeat, lambda: gaussian(0, 0, next(index)))
    return {"dim": dim, "ring_length": plan.length, "sigma": plan.sigma,
            "discrete_seconds": round(discrete_s, 4), "continuous_seconds": round(continuous_s, 4),
            "discrete_over_continuous": round(discrete_s / continuous_s, 1),
            "words_per_coordinate": round(words / plan.length, 2),
            "aes_seconds_for_those_words": round(aes_s, 4),
            "sample_std_over_sigma": round(float(sample.std()) / plan.sigma, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dims", default="81088,4400000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "discrete_noise.json"))
    args = parser.parse_args()
    key = os.urandom(32)
    load_before = os.getloadavg()
    rows = []
    for dim in (int(d) for d in args.dims.split(",")):
        rows.append(measure(dim, key, args.repeat))
        print(json.dumps(rows[-1]), flush=True)
    result = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "stream": Stream.__name__, "numpy": np.__version__, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
