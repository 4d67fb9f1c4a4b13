"""Client updates per second and peak memory of the main job's configuration.

Runs the main job's config (examples/shakespeare_cifg.toml) for a few rounds without progress
bars, and records wall time per round, client updates per second, local SGD steps per second and
the process's peak resident memory. Results: benchmarks/results/simulate_throughput.json.

    python benchmarks/simulate_throughput.py [--rounds 10] [--config examples/shakespeare_cifg.toml]

`--workload peer` instead times the round trainers on issue 15's peer-shaped workload
(benchmarks/trainer_throughput.py; results/trainer_throughput.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

import torch

from dpfleet.coordinator.engine.simulation import run_simulation
from dpfleet.coordinator.run_privacy.config_plan import load_run_config

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "shakespeare_cifg.toml")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "simulate_throughput.json")
    ap.add_argument("--workload", choices=("main", "peer"), default="main")
    args, _ = ap.parse_known_args()
    if args.workload == "peer":  # every other argument goes to trainer_throughput.py as given
        import runpy
        import sys

        rest = [a for a in sys.argv[1:] if a not in ("--workload", "peer", "--workload=peer")]
        sys.argv = [str(ROOT / "benchmarks" / "trainer_throughput.py"), *rest]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return

    def timed(rounds: int) -> tuple[float, object, dict]:
        # evaluate once, at the end of each run
        cfg, plan = load_run_config(args.config, {"eval_every": 10**9, "rounds": rounds})
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            result = run_simulation(cfg, Path(tmp) / "run", progress=False, log=lambda s: None, plan=plan)
            wall = time.perf_counter() - t0
            summary = json.loads((result.run_dir / "summary.json").read_text())
        return wall, result, summary

    # Setup (data, tokenizer, final evaluation) is the same in both runs: the difference is
    # the cost of args.rounds rounds alone.
    base_wall, _, _ = timed(1)
    wall, result, summary = timed(args.rounds + 1)
    per_round = (wall - base_wall) / args.rounds
    updates = sum(m["clients"] for m in result.metrics[1:])
    out = {
        "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
        "rounds_timed": args.rounds,
        "report_goal": result.privacy["report_goal"],  # the plan's, with dp.target_epsilon
        "model": load_run_config(args.config)[0].model.arch,
        "parameters": summary["parameters"],
        "setup_and_eval_seconds": round(base_wall, 2),
        "seconds_per_round": round(per_round, 3),
        "client_updates_per_second": round(updates / (wall - base_wall), 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} ({os.cpu_count()} cpus)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
