"""The main job under timer-limited participation: observed MinS / MaxP, waits, refusals, eps.

Runs examples/shakespeare_cifg.toml with `[participation] mode = "timer"` (device timers on a
simulated clock, availability with a diurnal swing, the coordinator's MinS refusal) and records
what the participation log shows next to what the timer implies, the privacy figures (PLD and
RDP), how much simulated time the rounds took and the wall time. With --no-training it drives
the participation control alone (no model), e.g. for many more rounds than the config's.
Results: benchmarks/results/participation_timer.json (the main job, 60 rounds, 5 h timer) and
participation_timer_fleet.json (participation only: 1600 rounds, 10 h timer), from

    python benchmarks/participation_timer.py
    python benchmarks/participation_timer.py --no-training --rounds 1600 --timer-hours 10 \
        --out benchmarks/results/participation_timer_fleet.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from dpfleet.coordinator.accounting.zcdp import observe_participation
from dpfleet.coordinator.config import load_config
from dpfleet.coordinator.engine.participation import Participation, RoundUnfillable
from dpfleet.coordinator.engine.simulation import prepare_data, run_simulation
from dpfleet.coordinator.run_privacy.run_accountant import RunAccountant

ROOT = Path(__file__).resolve().parents[1]


def participation_only(cfg, population: int) -> dict:
    part = Participation(cfg.participation, population, cfg.dp.report_goal, cfg.rounds, cfg.seed)
    acc = RunAccountant(cfg.dp.noise_multiplier, cfg.dp.delta)
    log, waited, refused, stopped = [], 0, 0, None
    for r in range(cfg.rounds):
        try:
            sel = part.propose(r)
        except RoundUnfillable as exc:
            stopped = str(exc)
            break
        part.commit(sel, sel.devices)
        acc.record([str(i) for i in sel.devices], False)
        log.append({"round": r, "devices": [str(i) for i in sel.devices]})
        waited, refused = waited + sel.waited_slots, refused + sel.refused
    obs = observe_participation(log)
    return {"rounds_completed": len(log), "min_separation": obs.min_separation,
            "max_participation": obs.max_participation, "zcdp": acc.record([], False)["zcdp"],
            "waited_rounds": waited, "refused_check_ins": refused,
            "simulated_hours": part.hours(part.slot), "stopped_early": stopped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "shakespeare_cifg.toml")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--timer-hours", type=float, default=5.0)
    ap.add_argument("--round-minutes", type=float, default=10.0)
    ap.add_argument("--availability", type=float, default=0.5)
    ap.add_argument("--diurnal", type=float, default=0.5)
    ap.add_argument("--no-training", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "participation_timer.json")
    args = ap.parse_args()

    cfg = load_config(args.config, {
        **({"rounds": args.rounds} if args.rounds else {}), "participation.mode": "timer",
        "participation.timer_period": args.timer_hours, "participation.round_minutes": args.round_minutes,
        "devices.availability": args.availability, "devices.diurnal_amplitude": args.diurnal})
    name = args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config
    setup = {"config": str(name),
             "rounds": cfg.rounds, "report_goal": cfg.dp.report_goal,
             "noise_multiplier": cfg.dp.noise_multiplier, "delta": cfg.dp.delta,
             "participation": vars(cfg.participation)}
    t0 = time.perf_counter()
    if args.no_training:
        _, data = prepare_data(cfg)
        out = {**setup, "population": len(data.train), "training": False,
               **participation_only(cfg, len(data.train))}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_simulation(cfg, Path(tmp) / "run", progress=True, log=print)
            p = result.privacy
            summary = json.loads((result.run_dir / "summary.json").read_text())
        m = result.metrics
        out = {
            **setup, "population": p["population"], "training": True,
            "rounds_completed": len(m), "stopped_early": result.stopped_early,
            "min_separation_enforced": p["min_separation_enforced"],
            "min_separation": p["min_separation"], "max_participation": p["max_participation"],
            "timer_worst_case": p["timer_worst_case"],
            "zcdp": p["zcdp"], "epsilon_pld": p["epsilon"], "epsilon_rdp": p["epsilon_rdp"],
            "waited_hours": sum(r["waited_hours"] for r in m),
            "refused_check_ins": sum(r["refused"] for r in m),
            "simulated_hours": summary["simulated_hours"],
            "final_accuracy": round(result.final["accuracy"], 4),
            "unigram_baseline_accuracy": round(result.baseline["accuracy"], 4),
        }
    out["wall_seconds"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
