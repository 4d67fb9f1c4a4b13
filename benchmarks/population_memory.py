"""Resident memory of a client population from 10^3 to 10^6 clients: memory-mapped store vs lists.

Each size runs in a fresh process (so peak RSS is that size's own). The population is GENERATED:
Shakespeare's real training clients (word tokenizer, 20-token rows) cycled to the size
(`edge/client_store.generated`), flagged as such in the JSON. Per size: build the population,
draw 100 cohorts of 50 clients, read their rows, and record peak RSS and the mean time to select
and read one cohort. `lists` holds the same population as `FederatedData` does today (one
ClientData with its own array per client), for contrast, up to 10^5 clients.

    python benchmarks/population_memory.py
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


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(size: int, kind: str, cache: Path) -> dict:
    from trainer_throughput import PEER

    from dpfleet.coordinator.config import parse_config
    from dpfleet.coordinator.engine.simulation import prepare_data
    from dpfleet.edge.client_data import ClientData
    from dpfleet.edge.client_store import build_store, generated

    tokenizer, data = prepare_data(parse_config(PEER))
    base_rss = rss_mib()
    store = generated(build_store(data.train, tokenizer.vocab_size, cache, "shakespeare"), size)
    if kind == "lists":  # what FederatedData holds: one object and array per client
        population = [ClientData(store.user(i), store.examples(i).copy()) for i in range(size)]

        def cohort(ids):
            return [population[i] for i in ids]
    else:
        cohort = store.clients
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    rows = 0
    for _ in range(100):
        ids = rng.choice(size, 50, replace=False)
        rows += sum(len(c.examples) for c in cohort(ids))
    per_cohort_ms = 1000 * (time.perf_counter() - t0) / 100
    return {"clients": size, "kind": kind, "generated": store.meta["generated"],
            "cycled_from": store.meta["cycled_from"], "peak_rss_mib": round(rss_mib(), 1),
            "rss_after_data_prep_mib": round(base_rss, 1),
            "ms_per_cohort_select_and_read": round(per_cohort_ms, 3),
            "rows_read": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=2, metavar=("SIZE", "KIND"), help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "population_memory.json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.cache)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for kind, sizes in (("store", SIZES), ("lists", SIZES[:3])):
            for size in sizes:
                cmd = [sys.executable, __file__, "--one", str(size), kind, "--cache", tmp]
                line = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                      env=dict(os.environ, PYTHONPATH=str(ROOT / "benchmarks"))).stdout
                results.append(json.loads(line.strip().splitlines()[-1]))
                print(results[-1], flush=True)
    out = {"results": results, "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
           "note": "generated population: real Shakespeare clients cycled (labelled); memory only"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
