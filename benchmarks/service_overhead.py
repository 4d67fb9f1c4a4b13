"""Coordinator overhead per round of `dpfleet service serve`, on loopback, in one process.

The coordinator (aiohttp, the round driver, the SQLite commit) and `--devices` emulated devices
(fleet/link.py + fleet/participant.py, training one at a time in a worker thread) share one
event loop, so the figures are an upper bound on what the coordinator adds. Per round:
wall time from open to commit, minus the seconds its devices spent training (they train one
after another, so that sum is the training part of the round's wall time; with SecAgg the rest
still holds the devices' own protocol work, which shares this process), and the coordinator's
own compute (the commit, plus the SecAgg server state machine's time); request latency
p50 / p99 of the non-long-poll device requests (register, blobs, reports, SecAgg posts, status).
The issue's 1,000-device load test with device worker processes is `fleet`'s benchmark; this one
isolates the coordinator's share. Saves results/service_overhead.json with cores, torch threads
and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from service_fleet import fleet_data, run_devices, tiny_cfg  # noqa: E402

from dpfleet.fleet.link import CoordinatorLink  # noqa: E402
from dpfleet.fleet.participant import local_policy  # noqa: E402
from dpfleet.service.server import shutdown, start  # noqa: E402

LONG_POLLS = ("/v1/checkin", "/secagg?")


def bench(devices: int, goal: int, rounds: int, aggregation: str, keep: Path | None = None) -> dict:
    extra = {"aggregation": {"kind": aggregation, "signed": True}} if aggregation == "secagg" else {}
    cfg = tiny_cfg(rounds=rounds, eval_every=rounds,
                   data={"max_clients": devices, "test_fraction": 0.1},
                   dp={"report_goal": goal},
                   service={"checkin_window_s": 0.5, "report_deadline_s": 120.0,
                            "secagg_phase_deadline_s": 60.0}, **extra)
    latencies: dict[str, list[float]] = {}
    real = CoordinatorLink.request

    async def timed(self, method, path_qs, *a, **kw):
        began = time.perf_counter()
        out = await real(self, method, path_qs, *a, **kw)
        if not (path_qs.startswith(LONG_POLLS[0]) or (LONG_POLLS[1] in path_qs and method == "GET")):
            kind = path_qs.split("?")[0].split("/")[-1] if "/rounds/" in path_qs else \
                path_qs.split("/")[2]
            latencies.setdefault(kind, []).append(time.perf_counter() - began)
        return out

    CoordinatorLink.request = timed
    try:
        with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
            root = Path(tmp) if keep is None else keep / f"{aggregation}-{devices}"
            users, examples = fleet_data(cfg, root / "fleet")
            keys = {u: Ed25519PrivateKey.generate() for u in users}
            pinned = {u: k.public_key().public_bytes_raw() for u, k in keys.items()}
            kw = {}
            if aggregation == "secagg":
                kw = {"pinned": pinned, "policy": lambda n: local_policy(
                    goal, cfg.aggregation.graph, cfg.aggregation.corruption, n)}

            async def main():
                running = await start(cfg, root / "state", log=lambda s: None)
                began = time.perf_counter()
                fleet = asyncio.create_task(run_devices(running.url, keys, examples, **kw))
                await asyncio.wait_for(asyncio.shield(running.task), 1800)
                total = time.perf_counter() - began
                outcomes = await asyncio.wait_for(fleet, 60)
                history = list(running.driver.history)
                await shutdown(running)
                return total, outcomes, history

            total, outcomes, history = asyncio.run(main())
    finally:
        CoordinatorLink.request = real
    train = {}
    for outs in outcomes.values():
        for r, _, o in outs:
            train[r] = train.get(r, 0.0) + o.train_seconds
    rows = [{"round": h["round"], "wall_s": h["wall_s"], "train_s": train.get(h["round"], 0.0),
             "overhead_s": h["wall_s"] - train.get(h["round"], 0.0), "commit_s": h["commit_s"],
             "secagg_server_s": h["secagg_server_s"]}
            for h in history if h["status"] == "committed"]
    over = [r["overhead_s"] for r in rows]
    server = [r["commit_s"] + (r["secagg_server_s"] or 0.0) for r in rows]
    return {
        "devices": len(users), "report_goal": goal, "rounds": rounds, "aggregation": aggregation,
        "total_s": total, "per_round": rows,
        "overhead_s_median": float(np.median(over)), "overhead_s_max": float(np.max(over)),
        # the coordinator's own compute: the commit plus (SecAgg) the server state machine
        "coordinator_compute_s_median": float(np.median(server)),
        "rounds_failed": sum(h["status"] == "failed" for h in history),
        "requests": sum(map(len, latencies.values())),
        "latency_ms_p50": 1000 * float(np.percentile(sum(latencies.values(), []), 50)),
        "latency_ms_p99": 1000 * float(np.percentile(sum(latencies.values(), []), 99)),
        "latency_ms_by_kind": {k: {"n": len(v), "p50": 1000 * float(np.percentile(v, 50)),
                                   "p99": 1000 * float(np.percentile(v, 99))}
                               for k, v in sorted(latencies.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[40])
    parser.add_argument("--goal", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--aggregation", nargs="+", default=["plain", "secagg"])
    parser.add_argument("--keep", type=Path, default=None,
                        help="Keep each run's state (service.log) under this folder.")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "service_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for n in args.devices:
        for agg in args.aggregation:
            row = bench(n, args.goal, args.rounds, agg, args.keep)
            print(f"{agg:6s} devices {row['devices']:4d} goal {args.goal}: overhead per round "
                  f"median {row['overhead_s_median']:.3f} s (max {row['overhead_s_max']:.3f}; "
                  f"coordinator compute {row['coordinator_compute_s_median']:.3f} s), "
                  f"latency p50 {row['latency_ms_p50']:.1f} ms p99 {row['latency_ms_p99']:.1f} ms, "
                  f"{row['rounds_failed']} failed rounds")
            for kind, lat in row["latency_ms_by_kind"].items():
                print(f"    {kind:8s} n {lat['n']:5d}  p50 {lat['p50']:8.1f} ms  p99 {lat['p99']:8.1f} ms")
            results.append(row)
    payload = {"machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                           "loadavg": os.getloadavg(), "python": platform.python_version()},
               "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
