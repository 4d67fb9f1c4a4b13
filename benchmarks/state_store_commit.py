"""Cost of a durable round commit (`coordinator/state/state_store.py:commit_round`).

Per commit: the round's state folder (theta + momentum as safetensors, written and fsynced,
renamed, parent fsynced), then one SQLite transaction (WAL, synchronous=FULL) with the release
row, `--cohort` participation rows and device counters. Median and p90 over `--commits` rounds,
per model size; the commit's file part and its transaction are timed apart, within one run.
Saves results/state_store_commit.json with the machine's cores, torch threads and load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from dpfleet.coordinator.state.release_log import release_record
from dpfleet.coordinator.state.state_store import StateStore


def bench(params: int, commits: int, cohort: int, fleet: int) -> dict:
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(params, dtype=np.float32)
    devices = [f"d{i}" for i in range(fleet)]
    files, totals = [], []
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:  # the repo disk, not tmpfs
        store = StateStore(Path(tmp) / "state", {"bench": params})
        store.register_devices(devices)

        def write_state(folder: Path) -> None:
            start = time.perf_counter()
            save_file({"theta": theta, "momentum": theta}, str(folder / "server_state.safetensors"))
            files.append(time.perf_counter() - start)

        for r in range(1, commits + 1):
            chosen = [devices[int(i)] for i in rng.choice(fleet, cohort, replace=False)]
            rec = release_record(round=r, tree_id=0, t=r, key_id="k", participants=chosen,
                                 restart=r == 1, clip_norm=1.0, released=str(r), data_sha256="d")
            start = time.perf_counter()
            store.commit_round(rec, str(r), write_state, {"metrics": {"round": r, "epsilon": 0.0}})
            totals.append(time.perf_counter() - start)
        store.close()
    ms = lambda xs, q: 1e3 * float(np.quantile(xs, q))  # noqa: E731
    return {"parameters": params, "commits": commits, "cohort": cohort, "fleet": fleet,
            "commit_ms_median": ms(totals, 0.5), "commit_ms_p90": ms(totals, 0.9),
            "safetensors_write_ms_median": ms(files, 0.5),
            "rest_ms_median (fsyncs + rename + transaction)": 1e3 * statistics.median(
                t - f for t, f in zip(totals, files, strict=True))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    parser.add_argument("--commits", type=int, default=30)
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--fleet", type=int, default=1000)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "state_store_commit.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = [bench(n, args.commits, args.cohort, args.fleet) for n in args.sizes]
    for row in rows:
        print(json.dumps(row))
    result = {"machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                          "platform": platform.platform()},
              "results": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
