"""`simulate` on GENERATED populations of 10^3..10^6 clients: peak RSS and selection time per round.

Each size runs `run_simulation` in a fresh process (peak RSS is that size's own): 500 real
Shakespeare clients cycled to the size (`[data] generated_population`, labelled, no privacy
meaning), 5 rounds of 50 clients, uniform participation with MinS 1, a tiny CIFG. Selection is
timed inside the run (`Participation.propose`), and, in the same process after the run, against
the former mask-based draw (a full allowed mask + rng.choice over the pool array) on the same
guard state, as a ratio.

    python benchmarks/generated_simulate.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SIZES = (10**3, 10**4, 10**5, 10**6)
CFG = {
    "rounds": 5, "eval_every": 5, "seed": 0, "checkpoint_every": 0,
    "data": {"dataset": "shakespeare", "max_clients": 500, "max_examples": 16, "eval_examples": 200},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8},
    "client": {"lr": 1.0, "batch_size": 16},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 50, "momentum": 0.9},
    "participation": {"mode": "uniform", "min_separation": 1},
}


def mask_draw_ms(part, r: int, repeats: int = 20) -> float:
    """The selection as written before this change: O(population) mask and pool per round."""
    t0 = time.perf_counter()
    for _ in range(repeats):
        pool = np.flatnonzero(part.guard.allowed(r))
        rng = np.random.default_rng([part.seed, 0x5B, r])
        rng.choice(pool, part.report_goal, replace=False)
    return 1000 * (time.perf_counter() - t0) / repeats


def one(size: int, out: Path) -> dict:
    import torch

    from dpfleet.coordinator.config import parse_config
    from dpfleet.coordinator.engine import participation
    from dpfleet.coordinator.engine.simulation import run_simulation

    times: list[float] = []
    propose = participation.Participation.propose
    parts = []

    def timed(self, *a, **kw):
        parts.append(self)
        t0 = time.perf_counter()
        try:
            return propose(self, *a, **kw)
        finally:
            times.append(1000 * (time.perf_counter() - t0))

    participation.Participation.propose = timed
    cfg = parse_config({**CFG, "data": {**CFG["data"], "generated_population": size}})
    t0 = time.perf_counter()
    result = run_simulation(cfg, out, progress=False, log=lambda s: None)
    wall = time.perf_counter() - t0
    part = parts[-1]
    r = len(result.metrics)
    new_ms = [0.0] * 20
    for i in range(20):
        t1 = time.perf_counter()
        propose(part, r)
        new_ms[i] = 1000 * (time.perf_counter() - t1)
    old_ms = mask_draw_ms(part, r)
    return {"clients": size, "generated": True, "cycled_from": 500, "rounds": r,
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "wall_s": round(wall, 2), "propose_ms_in_run": [round(t, 3) for t in times],
            "propose_ms_after": round(float(np.median(new_ms)), 4),
            "mask_draw_ms_after": round(old_ms, 4),
            "mask_over_new": round(old_ms / float(np.median(new_ms)), 2),
            "torch_threads": torch.get_num_threads(),
            "summary_says_generated": json.loads(
                (out / "summary.json").read_text())["generated_population"]["generated"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "generated_simulate.json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.run)))
        return
    results = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for size in SIZES:
            cmd = [sys.executable, __file__, "--one", str(size), "--run", f"{tmp}/run{size}"]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(line.strip().splitlines()[-1]))
            print(results[-1], flush=True)
    out = {"results": results, "cpu_count": os.cpu_count(), "loadavg_before": load_before,
           "loadavg_after": os.getloadavg(),
           "note": "GENERATED populations (500 real Shakespeare clients cycled): speed and memory "
                   "only; their epsilon is no guarantee for real people"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
