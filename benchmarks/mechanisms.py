"""Accuracy against epsilon per mechanism: the main job at the planner's choice, per mechanism, epsilon, seed.

Each cell runs examples/shakespeare_cifg.toml with dp.target_epsilon = EPS and dp.mechanism = KIND:
the planner (coordinator/run_privacy/config_plan.py) gives the report goal, the largest MinS, the worst-case
MaxP for the config's rounds and the z that KIND needs at EPS, so the mechanisms differ only in
their noise (same cohort, participation, clients and init per seed). Seed s also sets dp.noise_seed
= s (research mode: the noise key is derivable, so these runs carry NO privacy against whoever
knows the seed; the comparison is paired on clients, init and key, nothing else changes).
`--public none` drops the config's [pretrain] (public pretraining on WikiText-2 + KJV), so the two
rows of one seed measure what public data adds.

`--projection N` rows (labelled "projection": true) answer "what would a fleet of N devices get at
this epsilon": the planner's z / M for population N (same rounds, target and mechanism choice) is
applied at the 1,277-client run's own report goal, z = (z_N / M_N) x M; the run's own accounted eps
is then far above the target (recorded as epsilon_run): it is a projection, not a private run.

Resumable: rows are appended to benchmarks/results/mechanisms.json after every run, and a cell
(mechanism, epsilon, seed, public, projection) already there is skipped. One run at a time, at the
config's client.threads (1): other work on the machine keeps its cores. Then:
  mechanisms.png   accuracy against epsilon per mechanism (mean and sample sd over seeds)
  mechanisms.md    the cells' means and each mechanism's paired 95% t-interval against the tree
Run: OMP_NUM_THREADS=1 python benchmarks/mechanisms.py [--epsilons 2 4 8 16] [--seeds 0 1 2 3 4]
     [--mechanisms tree banded blt] [--public pretrain none] [--projection 100000 1000000]
     [--report-only]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "quality"))
from paired import format_difference, paired_difference  # noqa: E402

from dpfleet.coordinator.accounting.planner import make_plan, mechanism_rows  # noqa: E402
from dpfleet.coordinator.accounting.zcdp import zcdp_for_epsilon  # noqa: E402
from dpfleet.coordinator.config import PLANNED_KEYS, parse_config, read_toml  # noqa: E402
from dpfleet.coordinator.engine.simulation import run_simulation  # noqa: E402

CONFIG = ROOT / "examples" / "shakespeare_cifg.toml"
OUT = ROOT / "benchmarks" / "results" / "mechanisms.json"
CELL = ("mechanism", "target_epsilon", "seed", "public", "projection_population")


def add_run_options(ap: argparse.ArgumentParser, out: Path) -> None:
    """The options every resumable main-job benchmark takes (seeds, a rounds override, the rows
    file, report only)."""
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--rounds", type=int, default=None, help="override the config's rounds (checks)")
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--report-only", action="store_true")


def main_job_rows(config: Path, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """(the main job's config dict, read against its folder, with `--rounds` applied; the rows
    `--out` already holds): where a resumable benchmark starts."""
    from dpfleet.coordinator.config import paths_against

    base = paths_against(read_toml(config), config.parent)
    if args.rounds:
        base["rounds"] = args.rounds
        base["eval_every"] = min(base.get("eval_every", 10), args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return base, load_rows(args.out)


def load_rows(path: Path = OUT) -> list[dict]:
    return json.loads(path.read_text()) if path.is_file() else []


def save_rows(rows: list[dict], path: Path = OUT) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    tmp.replace(path)


def cell_values(base: dict, kind: str, eps: float, seed: int, public: str,
                projection: int | None = None, population: int = 1277) -> tuple[dict, dict]:
    """The config dict of one cell and what the row records about how it was set."""
    values = copy.deepcopy(base)
    for section, key in PLANNED_KEYS:  # the planner's, never the example's
        values.get(section, {}).pop(key, None)
    values["seed"] = seed
    values["dp"]["noise_seed"] = seed  # research mode: paired noise (see the module docstring)
    values["dp"]["target_epsilon"] = eps
    values["dp"]["mechanism"] = kind
    if public == "none":
        values.pop("pretrain", None)
    extra: dict = {}
    if projection:
        delta = values["dp"].get("delta", 1e-6)
        rounds = values["rounds"]
        rho = zcdp_for_epsilon(eps, delta)
        big = make_plan(projection, rounds, rho, delta=delta)
        big_row = next(r for r in mechanism_rows(big.chosen, rounds, rho, (kind,)))
        small = make_plan(population, rounds, rho, delta=delta).chosen
        z = big_row.noise_multiplier / big.chosen.report_goal * small.report_goal
        values["dp"]["target_epsilon"] = 0.0
        values["dp"]["noise_multiplier"] = z
        values["dp"]["report_goal"] = small.report_goal
        values["participation"] = {**values.get("participation", {}), "mode": "uniform",
                                   "min_separation": small.min_separation,
                                   "max_participation": small.max_participation}
        extra = {"projection_report_goal": big.chosen.report_goal,
                 "projection_noise_multiplier": big_row.noise_multiplier,
                 "projection_min_separation": big.chosen.min_separation,
                 "projection_max_participation": big.chosen.max_participation,
                 "noise_per_report": big_row.noise_multiplier / big.chosen.report_goal}
    return values, extra


def run_cell(base: dict, kind: str, eps: float, seed: int, public: str,
             projection: int | None = None) -> dict:
    values, extra = cell_values(base, kind, eps, seed, public, projection)
    cfg = parse_config(values)
    load = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        res = run_simulation(cfg, Path(tmp) / "run", progress=False, log=lambda s: None)
        plan_file = Path(tmp) / "run" / "plan.json"
        plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    wall = time.perf_counter() - t0
    p = res.privacy
    return {
        "mechanism": kind, "epsilon": eps if projection else p["epsilon"], "target_epsilon": eps,
        "delta": cfg.dp.delta, "seed": seed,
        "public": ("none" if public == "none" or not cfg.pretrain.corpus
                   else f"pretrain {'+'.join(cfg.pretrain.corpus)} {cfg.pretrain.steps} steps"),
        "accuracy": res.final["accuracy"], "unigram": res.baseline["accuracy"],
        "rounds": len(res.metrics), "wall_s": wall, "noise_multiplier": cfg.dp.noise_multiplier,
        "report_goal": cfg.dp.report_goal, "min_separation": cfg.participation.min_separation,
        "max_participation": cfg.participation.max_participation,
        "observed_max_participation": p["max_participation"],
        "epsilon_run": p["epsilon"], "projection": bool(projection),
        "projection_population": projection or 0, **extra,
        "plan_chosen": plan["chosen"] if plan else None,
        "curve": [[m["round"], m["accuracy"]] for m in res.metrics if m.get("accuracy") is not None],
        "client_trainer": summary.get("client_trainer"), "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "loadavg_before": load,
        "loadavg_after": os.getloadavg(),
    }


def public_only_row(base: dict, seed: int) -> dict:
    """The reference: the config's public model alone, before any private round (eps 0), scored on
    seed `seed`'s held-out users (the seed also draws the train / held-out split)."""
    import dataclasses

    from dpfleet.coordinator.engine.evaluation import evaluate, split_held_out, unigram_baseline
    from dpfleet.coordinator.engine.simulation import prepare_data
    from dpfleet.export.models import build_model
    from dpfleet.public.public_init import pretrain_on_public

    cfg = parse_config({**copy.deepcopy(base), "seed": seed})
    load, t0 = os.getloadavg(), time.perf_counter()
    torch.set_num_threads(max(1, cfg.client.threads))
    tokenizer, data = prepare_data(cfg, None)
    rows, baseline_clients = split_held_out(data.test, cfg.data.eval_examples or None)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    model = build_model(model_cfg)
    info = pretrain_on_public(cfg, model_cfg, model, tokenizer, log=lambda s: None)
    return {"mechanism": "public only", "epsilon": 0.0, "target_epsilon": 0.0, "delta": cfg.dp.delta,
            "seed": seed, "pretrain_seed": cfg.pretrain.seed,
            "public": f"pretrain {'+'.join(cfg.pretrain.corpus)} {cfg.pretrain.steps} steps",
            "accuracy": evaluate(model, rows)["accuracy"],
            "unigram": unigram_baseline((c.examples for c in baseline_clients), rows)["accuracy"],
            "rounds": 0, "wall_s": time.perf_counter() - t0, "pretrain_seconds": info["seconds"],
            "pretrain_cached": info["cached"], "noise_multiplier": 0.0, "report_goal": 0,
            "max_participation": 0, "projection": False, "projection_population": 0,
            "torch_threads": torch.get_num_threads(), "loadavg_before": load}


def key(row: dict) -> tuple:
    return tuple(row.get(k) if k != "public" else row["public"].split()[0] for k in CELL)


def order(item: tuple) -> tuple:
    (kind, eps, public, proj), _ = item
    return proj, public, eps, kind


def report(rows: list[dict], out: Path = OUT) -> str:
    """mechanisms.md (and mechanisms.png): cell means and paired intervals against the tree."""
    cells: dict = defaultdict(dict)
    loads = [r["loadavg_before"][0] for r in rows]
    for r in rows:
        cells[(r["mechanism"], r["target_epsilon"], r["public"], r["projection_population"])][r["seed"]] = r
    lines = ["# DP-FTRL mechanisms on the main job (benchmarks/mechanisms.py)", "",
             "Accuracy: held-out next-token accuracy (mean and sample sd over seeds). Each row runs the "
             "planner's choice at its target epsilon (delta 1e-6, N 1,277); noise_seed = seed "
             "(research mode) pairs the mechanisms. Projection rows train the 1,277 clients with the "
             "noise per device a population of N would need at the target: NOT private at that eps. "
             "'public only' is the pretrained model before any private round. Wall time at 1 torch thread; "
             f"machine load (1-min loadavg) {min(loads):.1f}-{max(loads):.1f} on 2 cores.", "",
             "| mechanism | target eps | public | projected N | seeds | accuracy | unigram | z | report goal "
             "| MaxP | wall s (mean) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (kind, eps, public, proj), by_seed in sorted(cells.items(), key=order):
        acc = [r["accuracy"] for r in by_seed.values()]
        mean = sum(acc) / len(acc)
        sd = math.sqrt(sum((a - mean) ** 2 for a in acc) / (len(acc) - 1)) if len(acc) > 1 else float("nan")
        r0 = next(iter(by_seed.values()))
        wall = sum(r["wall_s"] for r in by_seed.values()) / len(by_seed)
        spread = f" ± {sd:.4f}" if len(acc) > 1 else ""
        lines.append(f"| {kind} | {eps:g} | {public} | {proj or '-'} | {len(acc)} | {mean:.4f}{spread} | "
                     f"{r0['unigram']:.4f} | {r0['noise_multiplier']:.4g} | {r0['report_goal']} | "
                     f"{r0['max_participation']} | {wall:.0f} |")
    lines += ["", "Paired difference against the tree (same seed, same noise key; points of accuracy, "
              "95% t-interval from the sample sd):", "",
              "| mechanism - tree | target eps | public | projected N | difference [95% CI], up / down |",
              "|---|---|---|---|---|"]
    for (kind, eps, public, proj), by_seed in sorted(cells.items(), key=order):
        tree = cells.get(("tree", eps, public, proj), {})
        seeds = sorted(set(by_seed) & set(tree))
        if kind == "tree" or not seeds:
            continue
        d = paired_difference([100 * by_seed[s]["accuracy"] for s in seeds],
                              [100 * tree[s]["accuracy"] for s in seeds])
        lines.append(f"| {kind} - tree | {eps:g} | {public} | {proj or '-'} | {format_difference(d)} |")
    publics = sorted({c[2] for c in cells})
    if len(publics) > 1:
        lines += ["", "Paired difference of public pretraining (same seed, mechanism and noise key):", "",
                  "| mechanism | target eps | pretrain - none, [95% CI], seeds up / down |", "|---|---|---|"]
        for (kind, eps, public, proj), by_seed in sorted(cells.items()):
            none = cells.get((kind, eps, "none", proj), {})
            seeds = sorted(set(by_seed) & set(none))
            if public == "none" or proj or not seeds:
                continue
            d = paired_difference([100 * by_seed[s]["accuracy"] for s in seeds],
                                  [100 * none[s]["accuracy"] for s in seeds])
            lines.append(f"| {kind} | {eps:g} | {format_difference(d)} |")
    alone = next((by_seed for (kind, *_), by_seed in cells.items() if kind == "public only"), {})
    if alone:
        lines += ["", "What the private rounds add to the public model (same seed's held-out users):", "",
                  "| mechanism | target eps | private rounds - public model alone, [95% CI], up / down |",
                  "|---|---|---|"]
        for (kind, eps, public, proj), by_seed in sorted(cells.items(), key=order):
            seeds = sorted(set(by_seed) & set(alone))
            if kind == "public only" or public == "none" or proj or not seeds:
                continue
            d = paired_difference([100 * by_seed[s]["accuracy"] for s in seeds],
                                  [100 * alone[s]["accuracy"] for s in seeds])
            lines.append(f"| {kind} | {eps:g} | {format_difference(d)} |")
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    plot(cells, out.with_suffix(".png"))
    return text


def plot(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    series: dict = defaultdict(list)
    unigram = []
    for (kind, eps, public, proj), by_seed in cells.items():
        acc = [r["accuracy"] for r in by_seed.values()]
        if kind == "public only":
            ax.axhline(sum(acc) / len(acc), color="tab:olive", ls="-.", lw=0.9,
                       label=f"public model alone ({public}; mean of {len(acc)} seeds' held-out users)")
            continue
        mean = sum(acc) / len(acc)
        sd = math.sqrt(sum((a - mean) ** 2 for a in acc) / (len(acc) - 1)) if len(acc) > 1 else 0.0
        label = f"{kind}, {public.split()[0]}" + (f", projection N={proj:,}" if proj else "")
        series[label].append((eps, mean, sd))
        unigram += [r["unigram"] for r in by_seed.values()]
    for label, points in sorted(series.items()):
        points.sort()
        style = dict(marker="*", ms=11, ls="none") if "projection" in label else dict(marker="o", capsize=3)
        ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                    label=label, **style)
    if unigram:
        ax.axhline(sum(unigram) / len(unigram), color="grey", ls=":", label="unigram baseline")
    ax.axhline(0.12, color="k", ls="--", lw=0.8, label="main job's accuracy goal (0.12)")
    ax.set(xscale="log", xlabel="epsilon (delta 1e-6)", ylabel="next-token accuracy (held out)",
           title="main job, planner's choice per epsilon")
    ax.set_xticks([2, 4, 8, 16], ["2", "4", "8", "16"])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--mechanisms", nargs="+", default=["tree", "banded", "blt"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--public", nargs="+", default=["pretrain"], choices=["pretrain", "none"],
                    help="pretrain: the config's [pretrain]; none: without it")
    ap.add_argument("--projection", type=int, nargs="*", default=[],
                    help="also projection rows for these populations (at each epsilon and mechanism)")
    ap.add_argument("--no-grid", action="store_true", help="only the projection rows")
    ap.add_argument("--report-only", action="store_true", help="rewrite mechanisms.md / .png, run nothing")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows = load_rows(args.out)
    if not args.report_only:
        base = read_toml(CONFIG)
        done = {key(r) for r in rows}
        todo = [(k, e, s, p, None) for s in args.seeds for p in args.public for e in args.epsilons
                for k in args.mechanisms if not args.no_grid]
        todo += [(k, e, s, p, n) for n in args.projection for s in args.seeds for p in args.public
                 for e in args.epsilons for k in args.mechanisms]
        for seed in args.seeds if base.get("pretrain") else ():
            if ("public only", 0.0, seed, "pretrain", 0) not in done:
                rows.append(public_only_row(base, seed))
                save_rows(rows, args.out)
                print(f"public only, seed {seed}: accuracy {rows[-1]['accuracy']:.4f}", flush=True)
        for kind, eps, seed, public, proj in todo:
            if (kind, eps, seed, public, proj or 0) in done:
                continue
            row = run_cell(base, kind, eps, seed, public, proj)
            rows.append(row)
            save_rows(rows, args.out)
            print(f"{kind:6s} eps {eps:5g} seed {seed} {public:8s} proj {proj or '-':>8}: accuracy "
                  f"{row['accuracy']:.4f} (unigram {row['unigram']:.4f}), eps_run {row['epsilon_run']:.2f}, "
                  f"z {row['noise_multiplier']:.4g}, M {row['report_goal']}, {row['wall_s']:.0f} s, "
                  f"load {row['loadavg_before'][0]:.1f}", flush=True)
    if rows:
        print(report(rows, args.out))


if __name__ == "__main__":
    main()
