"""The main job at bfloat16 vs float32: final held-out accuracy paired over seeds.

Each seed runs the embedded main job (`dpfleet/configs/shakespeare_cifg.toml`: public pretraining,
20 private rounds at eps 8) twice, once per `client.precision`, with `dp.noise_seed` = seed so
the two runs of a seed share clients, init and noise: the paired difference is what the
precision changes. Pretraining follows `client.precision` too, so the bfloat16 run's starting model
is its own. Rows are saved after every run (a stopped benchmark resumes where it left off).

    OMP_NUM_THREADS=1 python benchmarks/quality/precision.py          # 5 seeds x 2 precisions
    python benchmarks/quality/precision.py --report-only

Needs a CPU with native BF16 (AMX-BF16 or AVX512-BF16): elsewhere bfloat16 is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "quality"))
import torch  # noqa: E402
from host_info import host  # noqa: E402
from mechanisms import add_run_options, main_job_rows, save_rows  # noqa: E402
from paired import format_difference, paired_difference  # noqa: E402

from dpfleet.coordinator.config import parse_config  # noqa: E402
from dpfleet.coordinator.engine.simulation import run_simulation  # noqa: E402
from dpfleet.io import atomic_write  # noqa: E402
from dpfleet.jsonio import dumps  # noqa: E402
from dpfleet.public.public_init import pretrain_on_public  # noqa: E402

CONFIG = ROOT / "dpfleet" / "configs" / "shakespeare_cifg.toml"
OUT = ROOT / "benchmarks" / "results" / "precision_quality.json"
PRECISIONS = ("float32", "bfloat16")


def run_cell(base: dict, precision: str, seed: int) -> dict:
    values = json.loads(json.dumps(base))
    values["seed"] = seed
    values["dp"]["noise_seed"] = seed  # research mode: the pair shares its noise
    values.setdefault("client", {})["precision"] = precision
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        res = run_simulation(parse_config(values), Path(tmp) / "run", progress=False, log=lambda s: None,
                             pretrain=pretrain_on_public)
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    return {"precision": precision, "seed": seed, "accuracy": res.final["accuracy"],
            "starting_accuracy": summary.get("initial", {}).get("accuracy"),
            "epsilon": res.privacy["epsilon"], "used": summary["precision"],
            "wall_s": time.perf_counter() - t0}


def summarize(rows: list[dict]) -> dict:
    by = {(r["precision"], r["seed"]): r for r in rows}
    seeds = sorted({s for p, s in by if all((q, s) in by for q in PRECISIONS)})
    acc = {p: [by[p, s]["accuracy"] for s in seeds] for p in PRECISIONS}
    wall = {p: [by[p, s]["wall_s"] for s in seeds] for p in PRECISIONS}
    return {"seeds": seeds, "accuracy": acc, "wall_s": wall,
            "bf16_minus_fp32": paired_difference(acc["bfloat16"], acc["float32"]) if seeds else None,
            "host": host(torch.get_num_threads())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(ap, OUT)
    args = ap.parse_args(argv)
    base, rows = main_job_rows(CONFIG, args)
    done = {(r["precision"], r["seed"]) for r in rows}
    todo = [] if args.report_only else [(p, s) for s in args.seeds for p in PRECISIONS if (p, s) not in done]
    for precision, seed in tqdm(todo, desc="precision quality", unit="run"):
        rows.append(run_cell(base, precision, seed))
        save_rows(rows, args.out)
    summary = summarize(rows)
    atomic_write(args.out.with_suffix(".summary.json"), dumps(summary, indent=1) + "\n")
    for p in PRECISIONS:
        print(f"{p:9s} accuracy {' '.join(f'{a:.4f}' for a in summary['accuracy'][p])}   "
              f"wall {' '.join(f'{w:.0f}s' for w in summary['wall_s'][p])}")
    if summary["bf16_minus_fp32"]:
        print(f"bfloat16 - float32 over {len(summary['seeds'])} seeds: "
              f"{format_difference(summary['bf16_minus_fp32'], digits=4)}")
    print(f"saved {args.out} and {args.out.with_suffix('.summary.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
