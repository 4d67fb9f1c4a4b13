"""`dpfleet audit` on the main job: accounted epsilon against the empirical estimate and bound.

The main job (examples/shakespeare_cifg.toml as it stands: 20 rounds, dp.target_epsilon with the
planner's report goal, MinS, MaxP and mechanism, public pretraining, client lr 1.0) with ~N
gradient canaries and 4 text canaries added, audited honestly at several stated targets (each row
is the planner's choice at that target), then broken three ways at `--broken-eps`: noise off
(--break noise-off), clipping off, noise / 10, each with the accountant unchanged. One run (one
secret noise key and one canary key) per row: the estimate's spread between runs is in its
interval, not averaged away. Each row has the final-model (one-shot) estimate and the all-rounds
one (max over releases of the cosine with each round's change).
The rows of the previous benchmark (the fixed-noise main job of 60 x 20, disjoint, tree, git
32b79ee, final-model scores only) are kept under `old_rows`: real measurements of that config.
Writes benchmarks/results/audit.json and benchmarks/results/audit.png.
Run: OMP_NUM_THREADS=1 python benchmarks/audit.py [--canaries 256] [--eps 4 8 16] [--broken-eps 8]
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

from dpfleet.coordinator.audit.canaries import AuditSettings, run_audit
from dpfleet.coordinator.config import parse_config, read_toml
from dpfleet.public.public_init import pretrain_on_public

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BROKEN = ("noise-off", "clipping", "noise-div-10")


def _bits(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"  # None: a diverged model has no finite perplexity


def _label(row: dict) -> str:
    broken = (row["broken"] or {}).get("mode")
    target = f"eps {row['target_epsilon']:g}" if "target_epsilon" in row else f"z {row['noise_multiplier']:g}"
    return f"{target}, {broken}" if broken else target


def plot(rows: list[dict], path: Path) -> None:
    """Accounted (x) against estimated (y, log: a broken run's estimate is 10-100x its accounted eps).
    Rows at the same accounted eps are spread sideways so their bars do not overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    right = max(r["epsilon_accounted"] for r in rows) * 1.35
    seen: dict[float, int] = {}
    for row in rows:
        acc = row["epsilon_accounted"]
        x = acc + 0.45 * seen.get(acc, 0)
        seen[acc] = seen.get(acc, 0) + 1
        color = "tab:red" if row["broken"] else "tab:blue"
        every = row["all_rounds"]
        for est, (lo, hi), marker, dx in (
                (row["epsilon_estimate"], row["epsilon_estimate_interval"], "o", -0.1),
                (every["epsilon_estimate"], every["epsilon_estimate_interval"], "s", 0.1)):
            ax.errorbar([x + dx], [est], yerr=[[est - lo], [hi - est]], fmt=marker, color=color, capsize=3,
                        mfc="white" if marker == "s" else color)
        ax.plot([x], [row["epsilon_lower_bound"]], "v", color=color, alpha=0.6)
        ax.annotate(_label(row), (x + 0.15, every["epsilon_estimate"]), fontsize=7, rotation=20)
    line = [right * i / 200 for i in range(201)]  # dense: a straight line is not one on symlog
    ax.plot(line, line, "k--", lw=0.8, label="empirical = accounted")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlim(0, right)
    ax.set_ylim(0, max(r["all_rounds"]["epsilon_estimate_interval"][1] for r in rows) * 2)
    ax.set_xlabel("accounted epsilon (delta 1e-6)")
    ax.set_ylabel("empirical epsilon (symlog)")
    ax.set_title("dpfleet audit, main job (planned eps, 20 rounds): o final-model estimate, "
                 "s all-rounds estimate\n(95% intervals), v lower bound (0.95); blue honest, red "
                 "deliberately broken", fontsize=9)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _row(values: dict, cell: dict, settings: AuditSettings, broken: str | None, run_dir: Path) -> dict:
    """One audited run of `values` (a config dict), as a row of audit.json; printed as it lands."""
    load = os.getloadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    a = run_audit(parse_config(values), run_dir, AuditSettings(**{**settings.__dict__, "broken": broken}),
                  progress=False, log=lambda s: None, pretrain=pretrain_on_public)
    plan_file = Path(a["run_dir"]) / "plan.json"
    plan = json.loads(plan_file.read_text())["chosen"] if plan_file.exists() else None
    row = {**cell, "broken": broken, "plan": plan,
           "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
           "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
           "loadavg": load, "loadavg_after": os.getloadavg(), "confidence": settings.confidence,
           **{k: v for k, v in a.items() if k != "run_dir"}}
    every = a["all_rounds"]
    (lo, hi), (alo, ahi) = a["epsilon_estimate_interval"], every["epsilon_estimate_interval"]
    z = values["dp"].get("noise_multiplier") or plan["noise_multiplier"]
    print(f"{_label(row):22s} {a['mechanism']} z {z:.3f}  accounted {a['epsilon_accounted']:6.2f}"
          f"  final {a['epsilon_estimate']:6.2f} [{lo:.2f}, {hi:.2f}]"
          f"  all-rounds {every['epsilon_estimate']:6.2f} [{alo:.2f}, {ahi:.2f}]"
          f"  bound {a['epsilon_lower_bound']:.2f} ({a['lower_bound_score']})"
          f"  exposure {_bits(a['exposure']['median_bits'])}/{_bits(a['exposure']['max_bits'])} bits"
          f"  acc {a['accuracy']:.4f}  {row['wall_s']:.0f} s  load {load[0]:.2f}  {a['verdict'][:10]}",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--canaries", type=int, default=256)
    parser.add_argument("--eps", type=float, nargs="+", default=[4.0, 8.0, 16.0],
                        help="stated dp.target_epsilon of the honest runs")
    parser.add_argument("--broken-eps", type=float, default=8.0, help="target epsilon of the broken runs")
    parser.add_argument("--rev", default=None,
                        help="instead: the fixed-noise main job of this git revision (32b79ee) at --z, "
                             "written to old_rows (rows are kept)")
    parser.add_argument("--z", type=float, nargs="+", default=[0.7, 2.0, 5.0], help="with --rev")
    parser.add_argument("--broken-z", type=float, default=2.0, help="with --rev")
    parser.add_argument("--plot-only", action="store_true", help="redraw audit.png from audit.json")
    args = parser.parse_args()
    out = RESULTS / "audit.json"
    if args.plot_only:
        plot(json.loads(out.read_text())["rows"], RESULTS / "audit.png")
        return
    torch.set_num_threads(1)  # other work shares the 2 cores
    example = "examples/shakespeare_cifg.toml"
    before = json.loads(out.read_text()) if out.exists() else {}
    settings = AuditSettings(canaries=args.canaries, text_canaries=4)
    rows, old_rows = before.get("rows", []), before.get("old_rows", [])
    with tempfile.TemporaryDirectory() as tmp:
        if args.rev:
            text = subprocess.run(["git", "show", f"{args.rev}:{example}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
            base = {**tomllib.loads(text), "checkpoint_every": 0}
            old_rows = []
            for z, broken in [(z, None) for z in args.z] + [(args.broken_z, b) for b in BROKEN]:
                values = {**base, "dp": {**base["dp"], "noise_multiplier": z}}
                old_rows.append(_row(values, {"noise_multiplier": z, "config": f"{example} at {args.rev}"},
                                     settings, broken, Path(tmp) / f"z{z}-{broken}"))
                _write(out, example, settings, rows, old_rows)
            return
        base = read_toml(ROOT / example)
        rows = []
        # two honest targets, the broken runs, then any further targets (rows are written as they land)
        for eps, broken in ([(e, None) for e in args.eps[:2]] + [(args.broken_eps, b) for b in BROKEN]
                            + [(e, None) for e in args.eps[2:]]):
            values = {**base, "checkpoint_every": 0, "dp": {**base["dp"], "target_epsilon": eps}}
            run_dir = Path(tmp) / f"eps{eps}-{broken}"
            rows.append(_row(values, {"target_epsilon": eps}, settings, broken, run_dir))
            _write(out, example, settings, rows, old_rows)
    plot(rows, RESULTS / "audit.png")
    print(f"wrote {out} and {RESULTS / 'audit.png'}")


def _write(out: Path, example: str, settings: AuditSettings, rows: list[dict], old_rows: list[dict]) -> None:
    from dpfleet.jsonio import dumps

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps({
        "config": f"{example} (the working tree), dp.target_epsilon per row", "canaries": settings.canaries,
        "text_canaries": settings.text_canaries, "confidence": settings.confidence, "rows": rows,
        "old_rows": old_rows,
        "old_rows_note": "the previous main job: fixed noise, 60 rounds x 20, disjoint, tree, client lr 5, "
                         "no pretraining (git 32b79ee), rerun with the all-rounds score (--rev 32b79ee)",
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
