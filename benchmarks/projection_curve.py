"""The main job's accuracy against eps for planned populations of 10^4, 10^5, 10^6 (`[projection]`).

What accuracy would a launch to N devices reach at eps? Shakespeare has 1,277 training users, too
few for DP to add over the public model at eps 2; pfl-research answers the question by training a
small cohort and adding the noise of the large one (its StackOverflow benchmark: train 400, noise
for 5,000, accounted over 10^6). Each cell runs the embedded main job (dpfleet/configs/
shakespeare_cifg.toml) with a `[projection]`:

* the planned launch: the planner (`make_plan`, tree noise) at population N, the config's rounds
  and eps at `--delta` chooses the noise cohort M_noise (or `--noise-cohort`) and z;
* the run: the 1,277 users at the planner's report goal for them at the same eps (M_train, uniform
  participation with its MinS / MaxP), dp.noise_multiplier = z, projection.noise_cohort = M_noise,
  projection.population = N: the released average carries the launch's noise z C / M_noise.

The projected eps (privacy.json's `projection`, a simulation of DP at population N, not a
guarantee) meets the target; the run's own eps (`epsilon_run`, z M_train / M_noise on its actual
sum) is far above it. `--delta` defaults to 1e-7: a run refuses delta >= 1/N, and one delta keeps
the populations comparable. Seed s sets dp.noise_seed = s (research mode) so the populations are
paired on clients, init and noise key. The public model (the pretrained start, eps 0) and the
unigram baseline are measured per seed, and the report says, at each eps, whether the private
rounds add over the public model: the paired difference's 95% t-interval above 0.

Resumable: rows are appended to the JSON after every run; a cell (N, eps, seed) already there is
skipped. Then it prints the table, saves the JSON and the plot (projection_curve.png).
Full run (the lead's; 3 x 3 x 5 = 45 runs of the main job plus 5 public rows):
    OMP_NUM_THREADS=1 python benchmarks/projection_curve.py
A check: python benchmarks/projection_curve.py --seeds 0 --rounds 2 --populations 10000 --epsilons 8
    --out /tmp/projection_curve.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "quality"))
from mechanisms import add_run_options, main_job_rows, public_only_row, save_rows  # noqa: E402
from paired import format_difference, paired_difference  # noqa: E402

from dpfleet.coordinator.accounting.planner import make_plan  # noqa: E402
from dpfleet.coordinator.accounting.zcdp import zcdp_for_epsilon  # noqa: E402
from dpfleet.coordinator.config import PLANNED_KEYS, parse_config  # noqa: E402
from dpfleet.coordinator.engine.simulation import run_simulation  # noqa: E402
from dpfleet.coordinator.sweep import t_interval  # noqa: E402
from dpfleet.io import atomic_write  # noqa: E402
from dpfleet.jsonio import dumps  # noqa: E402
from dpfleet.public.public_init import pretrain_on_public  # noqa: E402

CONFIG = ROOT / "dpfleet" / "configs" / "shakespeare_cifg.toml"
OUT = ROOT / "benchmarks" / "results" / "projection_curve.json"
TRAIN_POPULATION = 1277  # the main job's training users (the planner's M_train is for them)


def cell_values(base: dict, population: int, eps: float, seed: int, delta: float,
                noise_cohort: int | None = None) -> tuple[dict, dict]:
    """One cell's config dict and what its row records of the plan behind it."""
    values = copy.deepcopy(base)
    for section, key in PLANNED_KEYS:  # the plan's, never the example's
        values.get(section, {}).pop(key, None)
    rounds = values["rounds"]
    rho = zcdp_for_epsilon(eps, delta)
    launch = make_plan(population, rounds, rho, delta=delta, report_goal=noise_cohort).chosen
    train = make_plan(TRAIN_POPULATION, rounds, rho, delta=delta).chosen
    values["seed"] = seed
    values["dp"].update(noise_seed=seed, target_epsilon=0.0, mechanism="tree", delta=delta,
                        noise_multiplier=launch.noise_multiplier,
                        report_goal=min(train.report_goal, launch.report_goal))
    values["participation"] = {**values.get("participation", {}), "mode": "uniform",
                               "min_separation": train.min_separation,
                               "max_participation": train.max_participation}
    values["projection"] = {"noise_cohort": launch.report_goal, "population": population}
    return values, {"noise_cohort": launch.report_goal, "noise_multiplier": launch.noise_multiplier,
                    "planned_min_separation": launch.min_separation,
                    "planned_max_participation": launch.max_participation}


def run_cell(base: dict, population: int, eps: float, seed: int, delta: float,
             noise_cohort: int | None = None) -> dict:
    values, plan = cell_values(base, population, eps, seed, delta, noise_cohort)
    cfg = parse_config(values)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        res = run_simulation(cfg, Path(tmp) / "run", progress=False, log=lambda s: None,
                             pretrain=pretrain_on_public)
    p = res.privacy
    return {"population": population, "target_epsilon": eps, "seed": seed, "delta": delta, **plan,
            "accuracy": res.final["accuracy"], "unigram": res.baseline["accuracy"],
            "train_cohort": cfg.dp.report_goal, "rounds": len(res.metrics),
            "epsilon_projected": p["projection"]["epsilon"], "projection_label": p["projection"]["label"],
            "epsilon_run": p["epsilon"], "noise_multiplier_run": p["noise_multiplier"],
            "wall_s": time.perf_counter() - t0}


def summarize(rows: list[dict]) -> dict:
    """Per (N, eps): accuracy mean and 95% t-interval; the public model and unigram the same way;
    at each eps, the private rounds against the public model on the same seeds (paired)."""
    public = {r["seed"]: r["accuracy"] for r in rows if r.get("population") == 0}
    cells: dict = defaultdict(dict)
    for r in rows:
        if r.get("population"):
            cells[(r["population"], r["target_epsilon"])][r["seed"]] = r
    out = {"public_model": _interval(list(public.values())),
           "unigram": _interval([r["unigram"] for r in rows if r.get("population") == 0]), "cells": []}
    for (population, eps), by_seed in sorted(cells.items()):
        seeds = sorted(s for s in by_seed if s in public)
        cell = {"population": population, "target_epsilon": eps, "seeds": len(by_seed),
                "accuracy": _interval([r["accuracy"] for r in by_seed.values()]),
                "epsilon_projected": max(r["epsilon_projected"] for r in by_seed.values()),
                "epsilon_run": max(r["epsilon_run"] for r in by_seed.values()),
                "noise_cohort": next(iter(by_seed.values()))["noise_cohort"]}
        if seeds:
            d = paired_difference([by_seed[s]["accuracy"] for s in seeds], [public[s] for s in seeds])
            cell["over_public"] = {**d, "text": format_difference(d, 4),
                                   "adds": bool(d["n"] > 1 and d["ci95"][0] > 0)}
        out["cells"].append(cell)
    return out


def _interval(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "ci95": None, "n": 0}
    mean, half = t_interval(values)
    return {"mean": mean, "ci95": half, "n": len(values)}


def table(summary: dict) -> str:
    pub, uni = summary["public_model"], summary["unigram"]
    lines = [f"public model (eps 0): {_cell(pub)}   unigram baseline: {_cell(uni)}",
             "projected eps: a simulation of DP at population N, not a guarantee; eps run: the run's own",
             f"{'N':>9} {'eps':>5} {'M_noise':>8} {'seeds':>5} {'accuracy (95% CI)':>22} "
             f"{'eps run':>9}  over the public model (paired)"]
    for c in summary["cells"]:
        over = c.get("over_public", {})
        verdict = (" adds" if over.get("adds") else " -") if over else ""
        lines.append(f"{c['population']:>9,} {c['target_epsilon']:>5g} {c['noise_cohort']:>8,} "
                     f"{c['seeds']:>5} {_cell(c['accuracy']):>22} {c['epsilon_run']:>9.3g}  "
                     f"{over.get('text', '-')}{verdict}")
    return "\n".join(lines)


def _cell(figure: dict) -> str:
    if figure["mean"] is None:
        return "-"
    return f"{figure['mean']:.4f}" + ("" if figure["ci95"] is None else f" ± {figure['ci95']:.4f}")


def plot(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for population in sorted({c["population"] for c in summary["cells"]}):
        cells = [c for c in summary["cells"] if c["population"] == population]
        ax.errorbar([c["target_epsilon"] for c in cells], [c["accuracy"]["mean"] for c in cells],
                    yerr=[c["accuracy"]["ci95"] or 0 for c in cells], marker="o", capsize=3,
                    label=f"projection to N = {population:,}")
    for name, figure, style in (("public model (eps 0)", summary["public_model"], "--"),
                                ("unigram baseline", summary["unigram"], ":")):
        if figure["mean"] is not None:
            ax.axhline(figure["mean"], color="gray", linestyle=style, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("projected eps (a simulation of DP at population N, not a guarantee)")
    ax.set_ylabel("held-out next-token accuracy")
    ax.set_title("main job, projected to planned populations (95% t-intervals)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--populations", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    ap.add_argument("--delta", type=float, default=1e-7)
    ap.add_argument("--noise-cohort", type=int, default=None,
                    help="M_noise for every population (default: the planner's at each N)")
    add_run_options(ap, OUT)
    args = ap.parse_args(argv)
    base, rows = main_job_rows(CONFIG, args)
    done = {(r["population"], r["target_epsilon"], r["seed"]) for r in rows}
    todo = [(0, 0.0, s) for s in args.seeds] + [(n, e, s) for n in args.populations
                                                for e in args.epsilons for s in args.seeds]
    todo = [] if args.report_only else [c for c in todo if c not in done]
    for population, eps, seed in tqdm(todo, desc="projection curve", unit="run"):
        if population == 0:  # the public model alone, scored on this seed's held-out users
            row = {**public_only_row(base, seed), "population": 0}
        else:
            row = run_cell(base, population, eps, seed, args.delta, args.noise_cohort)
        rows.append(row)
        save_rows(rows, args.out)
    summary = summarize(rows)
    save_rows(rows, args.out)
    atomic_write(args.out.with_suffix(".summary.json"), dumps(summary, indent=1) + "\n")
    print(table(summary))
    print(f"saved {args.out}, {args.out.with_suffix('.summary.json')}, "
          f"{plot(summary, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
