"""The main job (examples/shakespeare_cifg.toml, its default data) with each DP-FTRL mechanism.

Same config, seed and noise multiplier for tree, banded and blt (dp.mechanism): the matrix-
factorization strategies are optimised at run start for the participation the config enforces
(disjoint: MaxP 1), so at equal z they differ in both epsilon and the model's noise. One seed,
`--repeats` noise draws (each run draws a fresh secret key, so accuracy varies between draws even
at one seed): a quick look, not the issue-23 evidence (5 seeds per cell, epsilon grid).
Writes benchmarks/results/mechanisms_quick.json (one row per mechanism and draw).
Run: OMP_NUM_THREADS=1 python benchmarks/mechanisms_quick.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from dpfleet.coordinator.config import parse_config, read_toml
from dpfleet.coordinator.engine.simulation import run_simulation

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "mechanisms_quick.json"
MECHANISMS = ("tree", "banded", "blt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2, help="noise draws per mechanism")
    repeats = parser.parse_args().repeats
    values = read_toml(ROOT / "examples" / "shakespeare_cifg.toml")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for draw, kind in ((d, k) for d in range(repeats) for k in MECHANISMS):
            values["dp"] = dict(values["dp"], mechanism=kind)
            cfg = parse_config(values)
            load = os.getloadavg()
            t0 = time.perf_counter()
            result = run_simulation(cfg, Path(tmp) / f"{kind}{draw}", progress=False, log=lambda s: None)
            seconds = time.perf_counter() - t0
            privacy = result.privacy
            row = {"mechanism": kind, "noise_draw": draw, "epsilon": privacy["epsilon"],
                   "delta": cfg.dp.delta,
                   "accuracy": result.final["accuracy"], "unigram": result.baseline["accuracy"],
                   "noise_multiplier": cfg.dp.noise_multiplier, "seconds": seconds,
                   "rounds": cfg.rounds, "seed": cfg.seed, "participation": cfg.participation.mode,
                   "min_separation": privacy["min_separation"],
                   "max_participation": privacy["max_participation"],
                   "mechanism_spec": privacy.get("mechanism_spec"),
                   "torch_threads": torch.get_num_threads(),
                   "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                   "loadavg_before": load, "loadavg_after": os.getloadavg()}
            rows.append(row)
            print(f"{kind:7s} eps {row['epsilon']:8.3f}  accuracy {row['accuracy']:.4f}  "
                  f"(unigram {row['unigram']:.4f})  {seconds:6.1f} s  load {load[0]:.2f}")
    OUT.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
