"""`dpfleet audit` on the main job: accounted epsilon against the empirical estimate and bound.

The main job (examples/shakespeare_cifg.toml: 60 rounds of 20 devices, disjoint, tree noise,
momentum 0.5) with ~N gradient canaries and 4 text canaries added, audited honestly at several
noise multipliers (so several accounted epsilons), then broken three ways at one of them: noise
off (--debug-nonprivate), clipping off, noise / 10, each with the accountant unchanged. One run
(one secret noise key and one canary key) per row: the estimate's spread between runs is in its
interval, not averaged away.
`--rev` reads the main job from a git revision (the recorded run: `--rev 32b79ee`, the fixed-noise
main job of 60 rounds x 20, disjoint, tree; the example later became a planned target-epsilon job).
Writes benchmarks/results/audit.json and benchmarks/results/audit.png.
Run: OMP_NUM_THREADS=1 python benchmarks/audit.py [--rev 32b79ee] [--canaries 256] [--z 0.7 2 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path

import torch

from dpfleet.coordinator.audit_run import AuditSettings, run_audit
from dpfleet.coordinator.config import parse_config, read_toml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BROKEN = ("noise-off", "clipping", "noise-div-10")


def _bits(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"  # None: a diverged model has no finite perplexity


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for row in rows:
        acc, est = row["epsilon_accounted"], row["epsilon_estimate"]
        lo, hi = row["epsilon_estimate_interval"]
        broken = (row["broken"] or {}).get("mode")
        color = "tab:red" if broken else "tab:blue"
        ax.errorbar([acc], [est], yerr=[[est - lo], [hi - est]], fmt="o", color=color, capsize=3)
        ax.plot([acc], [row["epsilon_lower_bound"]], "v", color=color, alpha=0.6)
        z = f"z = {row['noise_multiplier']:g}"
        label = f"{broken} ({z})" if broken else z
        ax.annotate(label, (acc, est), textcoords="offset points", xytext=(8, -3), fontsize=8)
    top = max(max(r["epsilon_estimate_interval"][1], r["epsilon_accounted"]) for r in rows) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="empirical = accounted")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("accounted epsilon (delta 1e-6)")
    ax.set_ylabel("empirical epsilon")
    ax.set_title("dpfleet audit, main job (o: one-shot estimate + 95% interval, v: lower bound)\n"
                 "blue honest, red deliberately broken", fontsize=10)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--canaries", type=int, default=256)
    parser.add_argument("--z", type=float, nargs="+", default=[0.7, 2.0, 5.0],
                        help="noise multipliers of the honest runs")
    parser.add_argument("--broken-z", type=float, default=2.0, help="z of the broken runs")
    parser.add_argument("--rev", default=None, help="git revision of examples/shakespeare_cifg.toml")
    parser.add_argument("--plot-only", action="store_true", help="redraw audit.png from audit.json")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads((RESULTS / "audit.json").read_text())["rows"], RESULTS / "audit.png")
        return
    example = "examples/shakespeare_cifg.toml"
    if args.rev:
        base = tomllib.loads(subprocess.run(["git", "show", f"{args.rev}:{example}"], cwd=ROOT, check=True,
                                            capture_output=True, text=True).stdout)
    else:
        base = read_toml(ROOT / example)
    if "target_epsilon" in base.get("dp", {}):
        raise SystemExit("this main job plans its noise from dp.target_epsilon, and the benchmark varies "
                         "dp.noise_multiplier: run it on the fixed-noise main job, --rev 32b79ee")
    base["checkpoint_every"] = 0
    settings = AuditSettings(canaries=args.canaries, text_canaries=4)
    cells = [(z, None) for z in args.z] + [(args.broken_z, b) for b in BROKEN]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for z, broken in cells:
            values = {**base, "dp": {**base["dp"], "noise_multiplier": z}}
            load = os.getloadavg()
            t0, c0 = time.perf_counter(), time.process_time()
            a = run_audit(parse_config(values), Path(tmp) / f"z{z}-{broken}",
                          AuditSettings(**{**settings.__dict__, "broken": broken}),
                          progress=False, log=lambda s: None)
            row = {"noise_multiplier": z, "broken": broken, "seconds": time.perf_counter() - t0,
                   "cpu_seconds": time.process_time() - c0, "torch_threads": torch.get_num_threads(),
                   "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "loadavg_before": load,
                   "loadavg_after": os.getloadavg(),
                   **{k: v for k, v in a.items() if k != "run_dir"}}
            rows.append(row)
            print(f"z {z:4.1f} {broken or 'honest':13s} accounted {a['epsilon_accounted']:7.2f}  "
                  f"estimate {a['epsilon_estimate']:8.2f} [{a['epsilon_estimate_interval'][0]:.2f}, "
                  f"{a['epsilon_estimate_interval'][1]:.2f}]  bound {a['epsilon_lower_bound']:.2f}  "
                  f"exposure {_bits(a['exposure']['median_bits'])}/{_bits(a['exposure']['max_bits'])} bits  "
                  f"acc {a['accuracy']:.4f}  {row['seconds']:.0f} s  load {load[0]:.2f}", flush=True)
    from dpfleet.jsonio import dumps

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "audit.json").write_text(dumps({
        "config": f"{example} at {args.rev or 'the working tree'}", "canaries": args.canaries,
        "text_canaries": 4,
        "confidence": settings.confidence, "rows": rows}, indent=2) + "\n")
    plot(rows, RESULTS / "audit.png")
    print(f"wrote {RESULTS / 'audit.json'} and {RESULTS / 'audit.png'}")


if __name__ == "__main__":
    main()
