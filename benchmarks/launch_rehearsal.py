"""A launch rehearsal: the main job planned over a generated week of 10^5 devices at eps 8.

What a team does before it trains on real phones, end to end with the CLI a user has:

1. `dpfleet trace generate`: a seeded, diurnal and bursty availability trace of `--devices`
   devices over `--days` (docs/traces.md);
2. `dpfleet plan --trace`: replays each report goal and timer over the trace as `simulate` would
   select (no training), under the run config's production round rules (over-selection, a
   deadline, stragglers by speed class), and picks the least noise-to-signal at the target eps
   among candidates of at least `--min-rounds` rounds; `--emit-projection` writes the keys of a
   laptop rehearsal of that launch;
3. `dpfleet simulate`: the main job (dpfleet/configs/shakespeare_cifg.toml, its 1,277 users) in
   timer mode on the same trace, training `--train-goal` devices a round while adding the noise
   of the planned cohort, accounted for the planned population, rounds, MinS and MaxP cap
   (`[projection]`: pfl-research's method; a simulation of DP, not a guarantee);
4. `dpfleet gate`: the release policy's verdict on the run's own guarantee (a projection run must
   never ship) and, beside it, on the planned launch.

Prints the figures and saves them to benchmarks/results/launch_rehearsal.json, the plan's plot
(devices available and rounds committed over the simulated week) to launch_rehearsal.png.
Full run (about 7 min on 2 cores: 1 s trace, 4-5 min plan, 1 min training):
    python benchmarks/launch_rehearsal.py
A check: python benchmarks/launch_rehearsal.py --devices 3000 --days 2 --min-rounds 3 --out /tmp/lr
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from dpfleet.coordinator.state.run_dir import to_toml
from dpfleet.io import atomic_write
from dpfleet.jsonio import dumps

ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB = ROOT / "dpfleet" / "configs" / "shakespeare_cifg.toml"
RESULTS = ROOT / "benchmarks" / "results"
POLICY = {"max_epsilon": 10.0, "delta": 1e-6, "max_rho": 2.0, "beat_public_model": True,
          "beat_unigram": True, "allow_caveats": False}
# production's round rules (Bonawitz et al. 2019): select 30% over the goal, close at the goal
# or after 12 minutes; a reference device trains for 5 minutes, a slow one 2.5x that, so most
# slow devices miss the deadline
ROUND_RULES = {"over_selection": 1.3, "deadline_minutes": 12.0}
DEVICE_TIME = {"train_minutes": 5.0}  # [devices]: the reference device's time to train and report


def dpfleet(*args: str) -> subprocess.CompletedProcess:
    """One CLI command, as a user types it; its output passes through."""
    cmd = [sys.executable, "-m", "dpfleet", *args]
    print("$ dpfleet " + " ".join(args), flush=True)
    return subprocess.run(cmd, check=False, text=True, stdout=subprocess.PIPE)


def cpu_name() -> str:
    """The CPU's model name (every figure names its machine)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return os.uname().machine


def run_config(trace: Path, args: argparse.Namespace) -> dict:
    """The main job in timer mode on the trace: its own report goal, the production round rules
    (the plan's timer replaces the 24 h here once it is chosen)."""
    cfg = tomllib.loads(MAIN_JOB.read_text())
    cfg["dp"].update(target_epsilon=0.0, mechanism="tree", delta=args.delta, report_goal=args.train_goal)
    cfg["participation"] = {"mode": "timer", "timer_period": 24.0,
                            "round_minutes": args.round_minutes, **ROUND_RULES}
    cfg["devices"] = {"trace": str(trace), **DEVICE_TIME}
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=100_000)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--round-minutes", type=float, default=60.0)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-7)
    parser.add_argument("--min-rounds", type=int, default=20)
    parser.add_argument("--train-goal", type=int, default=35,
                        help="devices trained a round (the planned cohort x 1,277 / 10^5 is about 35)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the rehearsal's files (default: a temporary one); the "
                             "figures go to benchmarks/results unless --out is given")
    args = parser.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="dpfleet-rehearsal-"))
    if args.out:
        work.mkdir(parents=True, exist_ok=False)
    started, load = time.time(), os.getloadavg()[0]
    trace = work / "trace.jsonl.gz"
    dpfleet("trace", "generate", "--devices", str(args.devices), "--days", str(args.days),
            "--seed", "0", str(trace))
    base = run_config(trace, args)
    atomic_write(work / "run.toml", to_toml(base))
    planned = dpfleet("plan", "--trace", str(trace), "--days", str(args.days), "--round-minutes",
                      str(args.round_minutes), "--target-epsilon", str(args.epsilon), "--delta",
                      str(args.delta), "--mechanism", "tree", "--min-rounds", str(args.min_rounds),
                      "--config", str(work / "run.toml"), "--emit-projection",
                      str(work / "rehearse.toml"), "--out", str(work / "plan"))
    print(planned.stdout)
    if planned.returncode:
        sys.exit(planned.returncode)
    fragment = tomllib.loads((work / "rehearse.toml").read_text())
    timer = json.loads((work / "plan" / "plan.json").read_text())["chosen"]["timer_hours"]
    cfg = {**base, "rounds": fragment["rounds"], "projection": fragment["projection"],
           "dp": {**base["dp"], **fragment["dp"]},
           "participation": {**base["participation"], "timer_period": timer}}  # the plan's timer
    atomic_write(work / "rehearsal.toml", to_toml(cfg))
    trained = dpfleet("simulate", str(work / "rehearsal.toml"), "--out", str(work / "run"), "--quiet")
    print(trained.stdout)
    if trained.returncode:
        sys.exit(trained.returncode)
    atomic_write(work / "policy.toml", to_toml(POLICY))
    gate = dpfleet("gate", str(work / "run"), "--policy", str(work / "policy.toml"), "--json")
    verdict = json.loads(gate.stdout)
    plan = json.loads((work / "plan" / "plan.json").read_text())
    summary = json.loads((work / "run" / "summary.json").read_text())
    privacy = json.loads((work / "run" / "privacy.json").read_text())
    chosen = plan["chosen"]
    metrics = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines() if x]
    record = {
        "cpu": cpu_name(), "load_at_start": load, "devices": args.devices, "days": args.days,
        "round_minutes": args.round_minutes, "target_epsilon": args.epsilon, "delta": args.delta,
        "round_rules": {**ROUND_RULES, **DEVICE_TIME}, "policy": POLICY,
        "plan": {k: chosen[k] for k in ("report_goal", "timer_hours", "rounds", "rounds_per_day", "filled",
                                        "min_separation", "max_participation",
                                        "realised_min_separation", "realised_max_participation",
                                        "mechanism", "noise_multiplier", "noise_to_signal", "epsilon")},
        "available": plan["available"],
        "run": {"train_goal": args.train_goal, "rounds": len(metrics),
                "accuracy": summary["final"]["accuracy"], "starting_accuracy": summary["initial"]["accuracy"],
                "unigram_accuracy": summary["unigram_baseline"]["accuracy"],
                "epsilon_own": privacy["epsilon"], "epsilon_projected": privacy["projection"]["epsilon"],
                "min_separation": privacy.get("min_separation"),
                "max_participation": privacy.get("max_participation"),
                "round_close": summary.get("round_close"),
                "simulated_days": metrics[-1]["clock_hours"] / 24 if metrics else None},
        "gate": {"own_passed": verdict["passed"],
                 "launch_passed": (verdict.get("projection") or {}).get("passed")},
        "wall_s": round(time.time() - started, 1),
    }
    print(dumps(record, indent=2))
    if args.out is None:
        atomic_write(RESULTS / "launch_rehearsal.json", dumps(record, indent=2) + "\n")
        shutil.copyfile(work / "plan" / "plan.png", RESULTS / "launch_rehearsal.png")
        print(f"wrote {RESULTS / 'launch_rehearsal.json'} and launch_rehearsal.png")


if __name__ == "__main__":
    main()
