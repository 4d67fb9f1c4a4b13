"""SecAgg / SecAgg+ cost grid, PRG throughput, and the n=50, d=1e6 round (issue 6).

Records, on this machine:
1. raw AES-128-CTR throughput of `cryptography` and the mask-expansion throughput of
   `dpfleet.secagg.crypto.add_streams` (one stream, and several folded into one vector);
2. one round at n=50, d=1e6 (Flower's SecAgg+ takes about 8 s here), harary and complete;
3. the grid n in {100, 500, 1000} x d in {1e5, 1e6, 4.4e6} x dropout in {0, 0.1, 0.3}, harary
   first, then the complete graph, cheapest cells first, within a wall-time budget.

Every cell runs the whole protocol in one process, one party after the other, so its wall
time grows like n * k * d. A cell whose estimated cost (PRG bytes over the measured expansion
speed plus a per-neighbour key-agreement cost calibrated on a small round) exceeds the per-cell
cap or what is left of the budget is skipped, and listed with its estimate. `round_seconds`
is the critical path with clients in parallel on their own devices (slowest client per phase
plus the server), which is what a deployment would wait for, network excluded.

    python benchmarks/secagg_grid.py [--budget 840] [--cell-cap 150]

`--issue11 [--before-tree DIR]` instead measures what issue 11 asks, written to
`results/secagg_issue11.json`: (a) bytes per client per phase in signed mode at n = 100, 200,
1000 (d = 1e6, 32-bit ring) against the d * b / 8 upload floor; (b) round time at n = 50, 100
x d = 1e5, 1e6, signed and unsigned, each cell run alternately on the code in DIR (a copy of
main before the change, e.g. `git archive`) and on this tree, in fresh processes, so the
before/after ratio is taken under the same machine load (recorded per run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from dpfleet.secagg.bench import bench_round, cipher_throughput, expansion_throughput
from dpfleet.secagg.graph import plan_graph

CLIENTS = (100, 500, 1000)
DIMS = (100_000, 1_000_000, 4_400_000)
DROPOUTS = (0.0, 0.1, 0.3)
FLOWER_SECONDS = 8.0  # Flower SecAgg+, n=50, d=1e6, measured on this machine (issue 6)
OUT = Path(__file__).parent / "results" / "secagg_grid.json"


def estimate(n: int, d: int, dropout: float, graph: str, speed: float, pair_cost: float) -> float:
    """Seconds for one in-process round: PRG bytes (client masks, server self-mask removal,
    dropped clients' pairwise masks) at `speed`, input copies, and key work per neighbour."""
    k = plan_graph(n, graph, dropout).k
    dropped = round(dropout * n)
    streams = n * (k + 1) + (n - dropped) + dropped * k * (1 - dropout)
    return (streams * d * 4) / (speed * 1e9) + 6 * n * d * 4 / 2e9 + n * k * pair_cost


def summary(cell: dict) -> str:
    return (f"n={cell['clients']:<5} d={cell['dim']:<8} drop={cell['dropout']:<4} "
            f"{cell['graph']:<8} k={cell['k']:<4} t={cell['threshold']:<4} "
            f"wall {cell['wall_seconds']:7.2f}s  round {cell['round_seconds']:6.3f}s  "
            f"sent/client {cell['bytes_sent_per_client']['mean'] / 1e6:8.2f} MB  "
            f"exact {cell['sum_exact']}")


def _cli_round(tree: Path | None, n: int, d: int, signed: bool) -> dict:
    """One `dpfleet secagg bench --json` round in a fresh process, on `tree`'s code if given."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, "-m", "dpfleet", "secagg", "bench", "-n", str(n), "-d", str(d),
           "--json"] + (["--signed"] if signed else [])
    load = os.getloadavg()[0]
    # run inside `tree`: from this checkout's root, its own dpfleet/ would shadow PYTHONPATH
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True,
                         cwd=tree).stdout
    cell = json.loads(out)
    cell["loadavg_1min_before_run"] = load
    return cell


def issue11(before_tree: Path | None, out: Path) -> None:
    started = time.perf_counter()
    result: dict = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                                "loadavg_start": os.getloadavg(),
                                "note": "2 cores shared with 5 other engineers' jobs"}}
    sizes = []
    for n in (100, 200, 1000):
        cell = bench_round(n, 1_000_000, 0.0, "harary", 32, signed=True)
        cell["loadavg"] = os.getloadavg()
        total = sum(cell["bytes_sent_per_client_by_phase"].values())
        cell["sent_over_upload_floor"] = total / cell["upload_floor_bytes"]
        sizes.append(cell)
        print(f"signed n={n} k={cell['k']} t={cell['threshold']}: sent/client "
              f"{total:.0f} B = {cell['sent_over_upload_floor']:.4f} x d*b/8; received "
              f"{sum(cell['bytes_received_per_client_by_phase'].values()):.0f} B; by phase "
              f"{cell['bytes_sent_per_client_by_phase']}", flush=True)
    result["bytes_signed_d1e6"] = sizes
    rounds = []
    for signed in (False, True):
        for n in (50, 100):
            for d in (100_000, 1_000_000):
                pair = {"clients": n, "dim": d, "signed": signed}
                for label, tree in (("before", before_tree), ("after", None)):
                    if label == "before" and before_tree is None:
                        continue
                    pair[label] = _cli_round(tree, n, d, signed)
                if "before" in pair:
                    pair["round_speedup"] = (pair["before"]["round_seconds"]
                                             / pair["after"]["round_seconds"])
                    pair["wall_speedup"] = (pair["before"]["wall_seconds"]
                                            / pair["after"]["wall_seconds"])
                if (n, d) == (50, 1_000_000):  # the one cell Flower was measured at
                    pair["after_vs_flower_round"] = (FLOWER_SECONDS
                                                     / pair["after"]["round_seconds"])
                rounds.append(pair)
                print(f"n={n} d={d} signed={signed}: round "
                      f"{pair.get('before', {}).get('round_seconds', float('nan')):.3f} -> "
                      f"{pair['after']['round_seconds']:.3f} s, wall "
                      f"{pair.get('before', {}).get('wall_seconds', float('nan')):.2f} -> "
                      f"{pair['after']['wall_seconds']:.2f} s, exact "
                      f"{pair['after']['sum_exact']}", flush=True)
    result["rounds"] = rounds
    result["before_tree"] = str(before_tree) if before_tree else None
    result["flower_seconds_n50_d1e6"] = FLOWER_SECONDS
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["total_seconds"] = time.perf_counter() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} ({result['total_seconds']:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=840.0, help="seconds for the grid")
    parser.add_argument("--cell-cap", type=float, default=150.0, help="max seconds per cell")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--issue11", action="store_true",
                        help="issue 11 measurements (bytes per phase, before/after round times)")
    parser.add_argument("--before-tree", type=Path, default=None,
                        help="with --issue11: a directory holding main's dpfleet package")
    args = parser.parse_args()
    if args.issue11:
        issue11(args.before_tree, args.out or OUT.with_name("secagg_issue11.json"))
        return
    args.out = args.out or OUT
    started = time.perf_counter()

    cipher = cipher_throughput()
    one = expansion_throughput(streams=1)
    many = expansion_throughput(megabytes=32, streams=24)
    throughput = {
        "aes128_ctr_GBps": cipher,
        "mask_expansion_GBps": one,
        "mask_expansion_24_streams_GBps": many,
        "expansion_over_cipher": one / cipher,
        "expansion_24_streams_over_cipher": many / cipher,
    }
    print(f"AES-128-CTR {cipher:.2f} GB/s; mask expansion {one:.2f} GB/s "
          f"({one / cipher:.2f}x), 24 streams into one vector {many:.2f} GB/s "
          f"({many / cipher:.2f}x)")

    flower = {}
    for graph in ("harary", "complete"):
        cell = bench_round(50, 1_000_000, 0.0, graph)
        cell["speedup_vs_flower_round"] = FLOWER_SECONDS / cell["round_seconds"]
        cell["speedup_vs_flower_wall"] = FLOWER_SECONDS / cell["wall_seconds"]
        flower[graph] = cell
        print("flower comparison:", summary(cell))

    calibration = bench_round(100, 100_000, 0.1, "harary")
    k = calibration["k"]
    prg_seconds = estimate(100, 100_000, 0.1, "harary", many, 0.0)
    pair_cost = max(calibration["wall_seconds"] - prg_seconds, 0.0) / (100 * k)
    print(f"calibration: {pair_cost * 1e3:.3f} ms of key work per client-neighbour pair")

    cells = [(n, d, p, g) for g in ("harary", "complete") for n in CLIENTS for d in DIMS
             for p in DROPOUTS]
    costs = {c: estimate(*c, many, pair_cost) for c in cells}
    order = sorted(cells, key=lambda c: (c[3] != "harary", costs[c]))
    grid, skipped = [], []
    grid_started = time.perf_counter()
    for n, d, p, g in order:
        spent = time.perf_counter() - grid_started
        cost = costs[n, d, p, g]
        cell_id = {"clients": n, "dim": d, "dropout": p, "graph": g, "estimated_seconds": cost}
        if cost > args.cell_cap:
            skipped.append({**cell_id, "reason": f"estimate over the {args.cell_cap:.0f} s cap"})
            continue
        if spent + cost > args.budget:
            skipped.append({**cell_id, "reason": "estimate over what is left of the budget"})
            continue
        cell = bench_round(n, d, p, g)
        cell["estimated_seconds"] = cost
        grid.append(cell)
        print(summary(cell), flush=True)
    for s in skipped:
        print(f"skipped n={s['clients']} d={s['dim']} drop={s['dropout']} {s['graph']}: "
              f"~{s['estimated_seconds']:.0f} s, {s['reason']}")

    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "note": "2 cores shared with other jobs: absolute times are noisy"},
        "throughput": throughput,
        "flower_n50_d1e6": {"flower_seconds": FLOWER_SECONDS, **flower},
        "calibration_pair_seconds": pair_cost,
        "budget_seconds": args.budget,
        "cell_cap_seconds": args.cell_cap,
        "grid": grid,
        "skipped": skipped,
        "total_seconds": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({len(grid)} cells run, {len(skipped)} skipped, "
          f"{result['total_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
