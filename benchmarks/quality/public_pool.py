"""Issue 16 item 4: a public pool of ~23k records, q in {0.5%, 2%, 10%}, ~2 epochs per row.

Same pipeline as `public_training.py` (`dpfleet public pipeline`, private `shakespeare-solo`,
T' = T / 2), with a pool 58x larger: WikiText-2 sentences, KJV verses and the co-written plays
(`shakespeare-collab`, in-style and disjoint from the private data, see edge/overlap.py).

Rows (per seed; every arm of a seed shares its clients and, through `dp.noise_seed = seed`,
its tree-noise draws, so arms are compared as paired differences):
  none                      no public training
  match-q<q>-<s>st          l_priv matching (paper 000 Table 3: rank by the DP checkpoint's
                            log-prob at T'), top q of the pool, s Adam steps of 32
  random-q<q>-<s>st         the same-size random selection (control)
The grid holds three families: every q at ~`--epochs` epochs (match and random); the smaller
q at the step budget of the largest q's epochs (same steps, more passes: sample efficiency);
the largest q at fewer steps (same selection, fewer steps).

CPU cut (2 shared cores, no accelerator): the teacher Gemma-3-270M scores ~50 tokens/s there, so
l_pub of 23k x 16 tokens (~6,000 teacher-seconds) and KD labels are left out; matching is on
l_priv only (match_beta = 1) and public training is L_LM only (kd_beta = 0).

    python benchmarks/quality/public_pool.py --seeds 0 1 2          # the run (writes .json/.md/.png)
    python benchmarks/quality/public_pool.py --quick                # a small smoke grid in minutes
    python benchmarks/quality/public_pool.py --summarize            # .md/.png from the .json

`--lpub-kd` adds the teacher rows at one q (none, l_priv matching, l_pub matching at
match_beta = 0.5, KD at kd_beta = 0.1, both) with the teacher run only on part of the pool
(lpub_kd.py: l_pub on each seed's top `--candidates` by l_priv, KD labels for the selected):

    python benchmarks/quality/public_pool.py --lpub-kd --seeds 0 1 2 3 4 --check-sample 500
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
from grid import add_grid_args, private_simulation
from paired import format_difference, paired_difference
from tqdm import tqdm

HERE = Path(__file__).parent
SOURCES = ["wikitext2", "kjv", "shakespeare-collab"]


def steps_for(n_selected: int, epochs: float, batch: int) -> int:
    return max(1, math.ceil(epochs * n_selected / batch))


def arms(args) -> list[dict]:
    """The grid's arms (name, selection, q, steps), in table order."""
    from dpfleet.public.matching import selection_size

    n = sum(args.pool)
    qs = sorted(args.q)
    budget = steps_for(selection_size(n, qs[-1]), args.epochs, args.batch_size)
    out = [{"name": "none", "selection": "none", "q": 0.0, "steps": 0}]

    def add(selection: str, q: float, steps: int) -> None:
        name = f"{selection}-q{q * 100:g}%-{steps}st"
        if all(a["name"] != name for a in out):
            out.append({"name": name, "selection": selection, "q": q, "steps": steps,
                        "selected": selection_size(n, q),
                        "epochs": steps * args.batch_size / selection_size(n, q)})

    def two_epochs(q: float) -> int:
        return steps_for(selection_size(n, q), args.epochs, args.batch_size)

    # most informative first, so that a run cut short still holds whole comparisons: the
    # largest q (match, random), each smaller q at its epochs, then at the largest q's steps,
    # then the random controls of the smaller q
    add("match", qs[-1], budget)
    add("random", qs[-1], budget)
    for q in reversed(qs[:-1]):
        add("match", q, two_epochs(q))
    for q in reversed(qs[:-1]):
        add("match", q, budget)
    for q in reversed(qs[:-1]):
        add("random", q, two_epochs(q))
    for epochs in args.fewer_epochs:
        add("match", qs[-1], steps_for(selection_size(n, qs[-1]), epochs, args.batch_size))
    return out


def config(args, arm: dict, seed: int) -> dict:
    public = {"teacher": args.teacher, "vocab_size": 4096, "selection": arm["selection"],
              "fraction": arm["q"] or 0.1, "steps": arm["steps"], "batch_size": args.batch_size,
              "lr": 3e-3, "match_beta": arm.get("match_beta", 1.0), "kd_beta": arm.get("kd_beta", 0.0)}
    sim = private_simulation(args, args.noise[0], seed, eval_every=args.rounds // 2,
                             eval_examples=args.eval_examples)
    sim["dp"]["noise_seed"] = seed  # research mode: arms of one seed share their noise draws
    return {"public": public, "simulation": sim,
            "pool": {"sources": SOURCES, "records": list(args.pool), "seq_len": 16, "seed": 0}}


def run_grid(args, arm_list: list[dict] | None = None, teacher_work=None) -> list[dict]:
    """Run (or collect) every seed of `arm_list` (default: the main grid's arms)."""
    import torch

    from dpfleet.public.pipeline import TeacherWork, parse_pipeline, run_pipeline

    torch.set_num_threads(args.threads)
    # arm-major: a run cut short holds every seed of its first arms (whole paired comparisons)
    grid = [(seed, arm) for arm in (arm_list or arms(args)) for seed in args.seeds]
    results = []
    for seed, arm in tqdm(grid, desc="pipeline runs", unit="run"):
        out = args.work / f"{arm['name']}-s{seed}"
        if (out / "summary.json").is_file() and not args.rerun:  # finished earlier
            s = json.loads((out / "summary.json").read_text())
        elif args.collect or not claim(out):  # report only, or another worker's run
            continue
        else:
            s = run_pipeline(parse_pipeline(config(args, arm, seed)), out, overwrite=True,
                             progress=False, log=lambda _: None,
                             teacher_work=teacher_work or TeacherWork)
        results.append({"arm": arm["name"], "seed": seed, "accuracy": s["final"]["accuracy"],
                        "perplexity": s["final"]["perplexity"], "epsilon": s["epsilon"],
                        "accuracy_before_public_training": s["accuracy_before_public_training"],
                        "sources": s.get("sources"), "public_seconds": s.get("public_seconds"),
                        "seconds": s["wall_seconds"]})
        tqdm.write(json.dumps(results[-1], default=float))
        save(args, results, partial=True, arm_list=arm_list)  # partial results survive an interruption
    return results


def claim(out: Path) -> bool:
    """Take run folder `out` for this process unless a live worker holds it, so that several
    workers can share one --work folder (a killed worker's claim is stale and is taken over)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "worker.pid"
    if path.is_file():
        try:
            os.kill(int(path.read_text()), 0)
            return int(path.read_text()) == os.getpid()
        except (ProcessLookupError, ValueError):
            path.unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # another worker was faster
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def save(args, results: list[dict], partial: bool = False, arm_list: list[dict] | None = None,
         **extra) -> None:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    payload = {"settings": settings, "arms": arm_list or arms(args), "results": results,
               "partial": partial, **extra,
               "machine": {"cpu_count": os.cpu_count(), "torch_threads": args.threads,
                           "loadavg": list(os.getloadavg())}}
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=float))


def _cell(values: list[float]) -> str:
    v = np.asarray(values)
    return f"{v.mean():.2f}" + (f" ± {v.std(ddof=1):.2f}" if len(v) > 1 else "")


# comparisons the notes discuss: (row, base) as arm-name patterns resolved against the grid
def comparisons(arm_list: list[dict]) -> list[tuple[str, str, str]]:
    """(family, row, base) pairs: vs none, match vs random, fixed steps, fixed selection."""
    by = {(a["selection"], a["q"], a["steps"]): a["name"] for a in arm_list}
    out = []
    for a in arm_list[1:]:
        out.append(("vs no public data", a["name"], "none"))
    for (sel, q, steps), name in by.items():
        if sel == "match" and ("random", q, steps) in by:
            out.append(("matching vs random (same size, same steps)", name, by["random", q, steps]))
    qs = sorted({a["q"] for a in arm_list if a["selection"] == "match"})
    match = [a for a in arm_list if a["selection"] == "match"]
    budget = max(a["steps"] for a in match if a["q"] == qs[-1])
    fixed = [a for a in match if a["steps"] == budget]
    for a in fixed:
        if a["q"] != qs[-1]:
            out.append((f"same steps ({budget}), smaller selection", a["name"],
                        by["match", qs[-1], budget]))
    for q in qs:
        same_q = sorted((a for a in match if a["q"] == q), key=lambda a: a["steps"])
        for a in same_q[:-1]:
            out.append((f"same selection (q = {q * 100:g}%), fewer steps", a["name"],
                        same_q[-1]["name"]))
    return out


def markdown(payload: dict) -> str:
    results, arm_list, st = payload["results"], payload["arms"], payload["settings"]
    seeds = sorted({r["seed"] for r in results})
    by = {(r["arm"], r["seed"]): r for r in results}
    parts = ", ".join(f"{n:,} {s}" for n, s in zip(st["pool"], SOURCES, strict=True))
    lines = [
        f"Pool {sum(st['pool']):,} records ({parts}), "
        f"16 on-device tokens each. Private: shakespeare-solo, T = {st['rounds']} rounds of "
        f"{st['report_goal']} clients, T' = {st['rounds'] // 2}, z = {st['noise'][0]}, "
        f"momentum {st['momentum'][0]}, dp.noise_seed = seed. Seeds {seeds} (n = {len(seeds)}). "
        "Accuracy (%) and perplexity on held-out private clients "
        f"({st['eval_examples']} examples), mean ± sample sd over seeds.", ""]
    lines += arm_tables(arm_list, by, seeds, comparisons(arm_list),
                        "Paired differences over seeds (row - base): accuracy in points and "
                        "perplexity, mean [95% t-interval, sample sd], seeds up / down.")
    secs = [r["seconds"] for r in results]
    lines += ["", f"{len(results)} pipeline runs, {sum(secs) / 60:.1f} min in all (median "
              f"{np.median(secs):.0f} s per run); machine: {payload['machine']}."]
    return "\n".join(lines) + "\n"


def arm_tables(arm_list: list[dict], by: dict, seeds: list[int],
               pairs: list[tuple[str, str, str]], note: str) -> list[str]:
    """The per-arm table, then `note` and the paired-difference table of `pairs`."""
    return ["| arm | selected | steps | epochs | seeds | accuracy | perplexity | acc. at T' | "
            "selected from wikitext2 / kjv / collab (mean) |",
            "|---|---|---|---|---|---|---|---|---|", *arm_rows(arm_list, by, seeds), "", note, "",
            "| family | row - base | accuracy (points) | perplexity |", "|---|---|---|---|",
            *difference_rows(pairs, by, seeds)]


def arm_rows(arm_list: list[dict], by: dict, seeds: list[int]) -> list[str]:
    """One table line per arm with results: size, steps, accuracy, perplexity, sources."""
    lines = []
    for a in arm_list:
        rows = [by[a["name"], s] for s in seeds if (a["name"], s) in by]
        if not rows:
            continue
        picked = "-"
        if rows[0].get("sources"):
            picked = " / ".join(f"{np.mean([r['sources'][s]['selected'] for r in rows]):.0f}"
                                for s in SOURCES)
        before = [r["accuracy_before_public_training"] * 100 for r in rows
                  if r["accuracy_before_public_training"] is not None]
        lines.append(
            f"| {a['name']} | {a.get('selected', 0)} | {a['steps']} | "
            f"{a.get('epochs', 0):.2f} | {len(rows)} | {_cell([r['accuracy'] * 100 for r in rows])} | "
            f"{_cell([r['perplexity'] for r in rows])} | {_cell(before) if before else ''} | {picked} |")
    return lines


def difference_rows(pairs: list[tuple[str, str, str]], by: dict, seeds: list[int]) -> list[str]:
    """One table line per (family, row, base) with both in `by`: paired differences over seeds."""
    lines = []
    for family, row, base in pairs:
        common = [s for s in seeds if (row, s) in by and (base, s) in by]
        if not common:
            continue
        acc = paired_difference([by[row, s]["accuracy"] * 100 for s in common],
                                [by[base, s]["accuracy"] * 100 for s in common])
        ppl = paired_difference([by[row, s]["perplexity"] for s in common],
                                [by[base, s]["perplexity"] for s in common])
        lines.append(f"| {family} | {row} - {base} | {format_difference(acc)} | "
                     f"{format_difference(ppl, 1)} |")
    return lines


def plot(payload: dict, png: Path) -> None:
    """Accuracy gain over `none` (paired, mean and 95% interval) against public steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, arm_list = payload["results"], payload["arms"]
    seeds = sorted({r["seed"] for r in results})
    by = {(r["arm"], r["seed"]): r["accuracy"] * 100 for r in results}
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for selection, marker in (("match", "o"), ("random", "s")):
        for q in sorted({a["q"] for a in arm_list if a["selection"] == selection}):
            pts = []
            for a in sorted((a for a in arm_list if a["selection"] == selection and a["q"] == q),
                            key=lambda a: a["steps"]):
                common = [s for s in seeds if (a["name"], s) in by and ("none", s) in by]
                if common:
                    d = paired_difference([by[a["name"], s] for s in common],
                                          [by["none", s] for s in common])
                    pts.append((a["steps"], d["mean"], d["ci95"]))
            if pts:
                x, m, ci = zip(*pts, strict=True)
                err = np.nan_to_num(np.array([[mm - c[0] for mm, c in zip(m, ci, strict=True)],
                                              [c[1] - mm for mm, c in zip(m, ci, strict=True)]]))
                ax.errorbar(x, m, yerr=err, marker=marker, capsize=3,
                            ls="-" if selection == "match" else ":",
                            label=f"{selection} q = {q * 100:g}%")
    ax.axhline(0, color="grey", lw=0.8)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set(xscale="log", xlabel="public training steps (batch 32)",
           ylabel="accuracy - none (points), paired, 95% CI",
           title=f"Public pool of {sum(payload['settings']['pool']):,} records, n = {len(seeds)} seeds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


READING = "## How we read it"  # hand-written from here on; a rewrite of the tables keeps it


def write_report(payload: dict, out: Path) -> None:
    text = markdown(payload)
    plot(payload, out.with_suffix(".png"))
    md = out.with_suffix(".md")
    kept = md.read_text().partition(READING) if md.is_file() else ("", "", "")
    md.write_text("# A public pool that matters (issue 16 item 4), CPU run\n\n## What was run "
                  "and what the numbers show\n\n" + text + ("\n" + kept[1] + kept[2] if kept[1] else ""))
    print(text)


# -- l_pub and KD on a candidate set (--lpub-kd) ----------------------------------------------
# paper 000's h is (l_pub + l_priv) / 2 (Algorithm 1; App. D.3's beta = 0.5) and the pipeline's
# default kd_beta = 0.1; both are kept rather than tuned on these 3 seeds
LPUB_SECTION = "## l_pub matching and KD on the large pool (CPU, candidate set)"
LPUB_READING = "### How we read the l_pub / KD rows"


def lpub_arms(args) -> list[dict]:
    """none, the l_priv base and the teacher arms, all at one q and step count."""
    from dpfleet.public.matching import selection_size

    n, q, steps = sum(args.pool), args.lpub_q, args.lpub_steps
    size = selection_size(n, q)
    tag = f"q{q * 100:g}%-{steps}st"
    out = [{"name": "none", "selection": "none", "q": 0.0, "steps": 0}]
    for name, beta, kd in (("match", 1.0, 0.0), ("lpub", args.match_beta, 0.0),
                           ("kd", 1.0, args.kd_beta), ("lpubkd", args.match_beta, args.kd_beta)):
        out.append({"name": f"{name}-{tag}", "selection": "match", "q": q, "steps": steps,
                    "selected": size, "epochs": steps * args.batch_size / size,
                    "match_beta": beta, "kd_beta": kd})
    return out


def _finished(args, arm: dict, seed: int) -> Path:
    """The run folder of (arm, seed) once a worker has finished it (waits for other workers)."""
    out = args.work / f"{arm['name']}-s{seed}"
    while not (out / "summary.json").is_file():
        time.sleep(10)
    return out


def run_lpub_kd(args) -> None:
    """none and l_priv matching first; then l_pub of each seed's candidates and KD labels of
    the selected records (teacher work shared by workers chunk by chunk); then the teacher arms."""
    import torch
    from lpub_kd import PartialTeacher

    from dpfleet.public.matching import build_pool, top_fraction
    from dpfleet.public.pipeline import parse_pipeline, teacher_vocab

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    arm_list = lpub_arms(args)
    results = run_grid(args, arm_list[:2])  # none, match (no teacher)
    base = arm_list[1]
    l_priv = {s: np.load(_finished(args, base, s) / "scores.npz")["l_priv"] for s in args.seeds}
    chosen = {s: json.loads((_finished(args, base, s) / "summary.json").read_text())
              ["selected_indices"] for s in args.seeds}
    cfg = parse_pipeline(config(args, arm_list[2], args.seeds[0]))
    vocab = teacher_vocab(cfg, print)
    pool = build_pool(cfg.pool.sources, cfg.pool.records, vocab.tokenizer, cfg.pool.seq_len,
                      cfg.pool.seed)
    # each seed's candidates are its own top records by l_priv (no coupling between seeds)
    candidates = {s: sorted(int(i) for i in top_fraction(l_priv[s], args.candidates))
                  for s in args.seeds}
    union = sorted({i for c in candidates.values() for i in c})
    work = PartialTeacher(cfg, vocab, pool, True, union)
    t0 = time.perf_counter()
    work.score_candidates(claim)
    l_pub_all = work.logprobs()
    l_pub = {s: _restricted(l_pub_all, candidates[s]) for s in args.seeds}
    picked = lpub_selections(l_pub, l_priv, args)
    labelled = sorted({int(i) for s in args.seeds for i in [*chosen[s], *picked[s]]})
    work.labelled = labelled
    work.label(claim)
    teacher = {"pid": os.getpid(), **work.teacher_stats, "wall_seconds": time.perf_counter() - t0}
    (args.work / f"teacher-{os.getpid()}.json").write_text(json.dumps(teacher))

    def factory(cfg, vocab, pool, progress):
        return PartialTeacher(cfg, vocab, pool, progress, candidates[cfg.simulation.seed],
                              labelled)

    results += run_grid(args, arm_list[2:], factory)
    stats = {"candidates": len(union), "candidates_per_seed": len(candidates[args.seeds[0]]),
             "labelled": len(labelled), "selection": selection_stats(
                 l_priv, l_pub, chosen, picked, len(candidates[args.seeds[0]]), args)}
    if args.check_sample:
        stats["outside_check"] = outside_check(args, cfg, vocab, pool, union, l_priv, l_pub_all,
                                               candidates, picked)
    stats["teacher_workers"] = [json.loads(p.read_text())
                                for p in sorted(args.work.glob("teacher-*.json"))]
    results = run_grid(argparse.Namespace(**{**vars(args), "collect": True}), arm_list)
    folders = [args.work / f"{a['name']}-s{s}" for a in arm_list for s in args.seeds]
    first = min((f / "pipeline.json").stat().st_mtime for f in folders
                if (f / "pipeline.json").is_file())
    last = max((f / "summary.json").stat().st_mtime for f in folders
               if (f / "summary.json").is_file())
    save(args, results, partial=len(results) < len(arm_list) * len(args.seeds),
         arm_list=arm_list, lpub_kd=stats, wall_seconds=last - first,
         this_invocation_seconds=time.perf_counter() - start)
    write_lpub_report(json.loads(args.out.read_text()), args.out)


def _restricted(l_pub: np.ndarray, keep: list[int]) -> np.ndarray:
    out = np.full(len(l_pub), -np.inf)
    out[keep] = l_pub[keep]
    return out


def lpub_selections(l_pub: dict, l_priv: dict, args) -> dict:
    """Per seed, the top q by h_beta, as the pipeline's lpub arm selects it."""
    from dpfleet.public.matching import match_scores, top_fraction

    return {s: top_fraction(match_scores(l_pub[s], l_priv[s], args.match_beta), args.lpub_q)
            for s in l_priv}


def outside_check(args, cfg, vocab, pool, union: list[int], l_priv: dict, l_pub_all: np.ndarray,
                  candidates: dict, picked: dict) -> dict:
    """How many records each seed's candidate cut keeps out of its l_pub selection: records
    whose h would reach the q-th best selected h. Counted exactly among the other seeds'
    candidates (scored), estimated from a random sample of the rest (scored here)."""
    from lpub_kd import PartialTeacher

    from dpfleet.public.matching import match_scores

    outside = np.setdiff1d(np.arange(len(pool.sequences)), union)
    sample = np.sort(np.random.default_rng(0).choice(outside, args.check_sample, replace=False))
    work = PartialTeacher(cfg, vocab, pool, True, sample)
    work.score_candidates(claim)
    (args.work / f"teacher-check-{os.getpid()}.json").write_text(json.dumps(
        {"pid": os.getpid(), **work.teacher_stats}))
    l_sample = work.logprobs()[sample]
    out = {"sample": int(len(sample)), "outside": int(len(outside))}
    for s in l_priv:
        h_star = float(np.min(match_scores(l_pub_all[picked[s]], l_priv[s][picked[s]],
                                           args.match_beta)))
        others = np.setdiff1d(union, candidates[s])
        exact = int((match_scores(l_pub_all[others], l_priv[s][others], args.match_beta)
                     >= h_star).sum())
        above = int((match_scores(l_sample, l_priv[s][sample], args.match_beta) >= h_star).sum())
        out[str(s)] = {"other_candidates_above_threshold": exact,
                       "sample_above_threshold": above,
                       "estimated_outside_entrants": exact + above / len(sample) * len(outside),
                       **exact_selection_estimate(args, pool, union, sample, l_priv[s], l_pub_all,
                                                  l_sample, candidates[s], len(outside))}
    return out


def exact_selection_estimate(args, pool, union, sample, l_priv: np.ndarray, l_pub_all: np.ndarray,
                             l_sample: np.ndarray, candidates: list[int], n_outside: int) -> dict:
    """What Algorithm 1 with l_pub over the whole pool would select, extrapolated: the scored
    records (the union, weight 1; the sample, weight n_outside / len(sample)) ranked by h and
    cut at the selection size; its share of this seed's candidates and of each source."""
    from dpfleet.public.matching import match_scores, selection_size

    idx = np.concatenate([union, sample])
    h = match_scores(np.concatenate([l_pub_all[union], l_sample]), l_priv[idx], args.match_beta)
    weight = np.concatenate([np.ones(len(union)), np.full(len(sample), n_outside / len(sample))])
    order = np.argsort(-h, kind="stable")
    size = selection_size(len(pool.sequences), args.lpub_q)
    keep = order[: int(np.searchsorted(np.cumsum(weight[order]), size)) + 1]
    w = weight[keep].copy()
    w[-1] -= w.sum() - size  # the record crossing the cut counts only for the rest of it
    own = np.isin(idx[keep], candidates)
    return {"estimated_exact_share_from_candidates": float(w[own].sum() / size),
            "estimated_exact_sources": {src: float(w[[pool.sources[i] == src for i in
                                                       idx[keep]]].sum() / size)
                                        for src in SOURCES}}


def selection_stats(l_priv: dict, l_pub: dict, chosen: dict, picked: dict, n_cand: int,
                    args) -> dict:
    """Per seed: overlap of the two selections, and how tight the candidate cut is: a record
    outside seed s's candidates has l_priv <= its cut c_s, so it could enter the combined top q
    only with l_pub >= (h* - beta c_s) / (1 - beta), h* the q-th best combined score."""
    from dpfleet.public.matching import match_scores

    beta = args.match_beta
    out = {}
    for s in l_priv:
        order = np.argsort(-l_priv[s], kind="stable")
        cut = float(l_priv[s][order[n_cand - 1]])
        h_star = float(np.min(match_scores(l_pub[s], l_priv[s], beta)[picked[s]]))
        need = (h_star - beta * cut) / (1 - beta) if beta < 1 else math.inf
        finite = l_pub[s][np.isfinite(l_pub[s])]
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        out[str(s)] = {
            "overlap_with_l_priv_selection": len(set(map(int, chosen[s])) & set(map(int, picked[s]))),
            "worst_l_priv_rank_selected": int(rank[picked[s]].max()) + 1,
            "l_priv_cut": cut, "l_pub_needed_outside": need,
            "candidates_with_l_pub_above_needed": int((finite >= need).sum()),
            "l_pub_candidates_max": float(finite.max()), "l_pub_candidates_median":
                float(np.median(finite)),
        }
    return out


def lpub_comparisons(arm_list: list[dict]) -> list[tuple[str, str, str]]:
    none, match, lpub, kd, both = (a["name"] for a in arm_list)
    return [("vs no public data", match, none), ("vs no public data", lpub, none),
            ("vs no public data", kd, none), ("vs no public data", both, none),
            ("l_pub in the ranking (beta = 0.5 vs 1)", lpub, match),
            ("KD added (kd_beta > 0)", kd, match),
            ("l_pub and KD vs l_priv only", both, match),
            ("KD on top of l_pub matching", both, lpub),
            ("l_pub on top of KD", both, kd)]


def lpub_markdown(payload: dict) -> str:
    results, arm_list, st = payload["results"], payload["arms"], payload["settings"]
    seeds = sorted({r["seed"] for r in results})
    by = {(r["arm"], r["seed"]): r for r in results}
    stats = payload.get("lpub_kd", {})
    lines = [
        f"Same pool and private setting as above (z = {st['noise'][0]}, T = {st['rounds']}, "
        f"T' = {st['rounds'] // 2}), q = {st['lpub_q'] * 100:g}% at {st['lpub_steps']} steps, "
        f"all arms rerun in one work folder with today's code (paired by seed, dp.noise_seed = "
        f"seed). match: l_priv only (beta = 1); lpub: h = {1 - st['match_beta']:g} l_pub + "
        f"{st['match_beta']:g} l_priv; kd: kd_beta = {st['kd_beta']:g}, k = 10 teacher top-k "
        f"(teacher-space top-k, the pipeline default). Seeds {seeds} (n = {len(seeds)}).", ""]
    lines += arm_tables(arm_list, by, seeds, lpub_comparisons(arm_list),
                        "Paired differences over seeds (row - base), mean [95% t-interval, sample "
                        "sd], seeds up / down.")
    if stats:
        lines += ["", f"Teacher work: each seed's candidates are its top "
                  f"{st['candidates'] * 100:g}% = {stats['candidates_per_seed']:,} records by its "
                  f"own l_priv; l_pub of their union ({stats['candidates']:,} records), top-k "
                  f"labels for the {stats['labelled']:,} records some arm selects.", "",
                  "| seed | lpub selection shared with match | worst l_priv rank in lpub selection "
                  "| l_pub a non-candidate would need | candidates above it | candidate l_pub "
                  "median / max |", "|---|---|---|---|---|---|"]
        for s, v in stats["selection"].items():
            lines.append(f"| {s} | {v['overlap_with_l_priv_selection']} | "
                         f"{v['worst_l_priv_rank_selected']} | {v['l_pub_needed_outside']:.2f} | "
                         f"{v['candidates_with_l_pub_above_needed']} | "
                         f"{v['l_pub_candidates_median']:.2f} / {v['l_pub_candidates_max']:.2f} |")
        check = stats.get("outside_check")
        if check:
            est = "; ".join(f"seed {s}: {check[s]['other_candidates_above_threshold']} of the "
                            f"other seeds' candidates, {check[s]['sample_above_threshold']} of "
                            f"the sample, ~{check[s]['estimated_outside_entrants']:.0f} in all"
                            for s in check if s not in ("sample", "outside"))
            lines += ["", f"Check of the candidate cut: l_pub also of {check['sample']} random "
                      f"records outside every seed's candidates (of {check['outside']:,}). "
                      "Records outside a seed's candidates whose h would reach the q-th best h "
                      f"of its l_pub selection (so the cut kept them out): {est}."]
            seeds_c = [s for s in check if s not in ("sample", "outside")]
            if "estimated_exact_sources" in check[seeds_c[0]]:
                share = [check[s]["estimated_exact_share_from_candidates"] * 100 for s in seeds_c]
                mix = {src: np.mean([check[s]["estimated_exact_sources"][src] * 100
                                     for s in seeds_c]) for src in SOURCES}
                lines += ["", "Extrapolated exact selection (candidates and other seeds' "
                          "candidates with weight 1, the sample with weight outside / sample, "
                          "ranked by h): "
                          f"{min(share):.0f}-{max(share):.0f}% of it from the seed's candidates; "
                          "sources (mean over seeds) " + " / ".join(
                              f"{src} {v:.0f}%" for src, v in mix.items()) + "."]
        workers = [w for w in stats["teacher_workers"] if w.get("lpub_tokens") or
                   w.get("topk_tokens")]
        for job, what in (("lpub", "l_pub (teacher-tokenizer tokens)"),
                          ("topk", "top-k labels (on-device tokens)")):
            tokens = sum(w[f"{job}_tokens"] for w in workers)
            secs = sum(w[f"{job}_seconds"] for w in workers)
            if secs:
                lines.append(f"\nTeacher {what}: {tokens:,} tokens scored in this run (cache "
                             f"misses) in {secs / 60:.1f} teacher-minutes over {len(workers)} "
                             f"process run(s), {tokens / secs:.1f} tokens/s per 1-thread process.")
    secs = [r["seconds"] for r in results]
    lines += ["", f"{len(results)} pipeline runs, {sum(secs) / 60:.1f} min in all (median "
              f"{np.median(secs):.0f} s per run); first run start to last run end "
              f"{payload.get('wall_seconds', 0) / 60:.1f} "
              f"min; machine: {payload['machine']}."]
    return "\n".join(lines) + "\n"


def plot_differences(payload: dict, png: Path, pairs: list[tuple[str, str, str]]) -> None:
    """Paired accuracy and perplexity differences (mean, 95% interval) of each comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({r["seed"] for r in payload["results"]})
    by = {(r["arm"], r["seed"]): r for r in payload["results"]}
    rows = [(f"{row} - {base}", [s for s in seeds if (row, s) in by and (base, s) in by], row, base)
            for _, row, base in pairs]
    rows = [r for r in rows if r[1]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.45 * len(rows) + 1.5), sharey=True)
    for ax, (key, scale, label) in zip(axes, (("accuracy", 100, "accuracy (points)"),
                                              ("perplexity", 1, "perplexity")), strict=True):
        for y, (_, common, row, base) in enumerate(rows):
            d = paired_difference([by[row, s][key] * scale for s in common],
                                  [by[base, s][key] * scale for s in common])
            lo, hi = np.nan_to_num(d["ci95"], nan=d["mean"])
            ax.errorbar(d["mean"], y, xerr=[[d["mean"] - lo], [hi - d["mean"]]], fmt="o",
                        capsize=3)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set(xlabel=f"{label}, paired, 95% CI")
    axes[0].set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle(f"l_pub / KD rows, n = {len(seeds)} seeds")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def write_lpub_report(payload: dict, out: Path) -> None:
    """The l_pub / KD section of public_pool.md (the hand-written reading after LPUB_READING
    is kept), and its plot."""
    text = lpub_markdown(payload)
    plot_differences(payload, out.with_suffix(".png"), lpub_comparisons(payload["arms"]))
    md = HERE / "public_pool.md" if out.parent.resolve() == HERE.resolve() else out.with_suffix(".md")
    head, _, rest = (md.read_text() if md.is_file() else "").partition(LPUB_SECTION)
    kept = rest.partition(LPUB_READING)
    md.write_text(head.rstrip("\n") + "\n\n" + LPUB_SECTION + "\n\n" + text
                  + ("\n" + kept[1] + kept[2] if kept[1] else ""))
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_grid_args(ap)
    ap.set_defaults(noise=[0.7], momentum=[0.5])
    ap.add_argument("--pool", type=int, nargs=3, default=[10_000, 10_000, 3_000],
                    help="records of wikitext2, kjv, shakespeare-collab")
    ap.add_argument("--q", type=float, nargs="+", default=[0.005, 0.02, 0.1])
    ap.add_argument("--epochs", type=float, default=2.0, help="public epochs of the main rows")
    ap.add_argument("--fewer-epochs", type=float, nargs="*", default=[],
                    help="extra rows: the largest q at these epochs (same selection, fewer steps)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-examples", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--teacher", default="gemma3-270m", help="only its trimmed vocabulary is used")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dpfleet-public-pool"))
    ap.add_argument("--out", type=Path, default=HERE / "public_pool.json")
    ap.add_argument("--rerun", action="store_true", help="rerun pipelines finished in --work")
    ap.add_argument("--collect", action="store_true",
                    help="run nothing: report the runs already finished in --work")
    ap.add_argument("--quick", action="store_true",
                    help="smoke grid: pool 1,000 records, T = 10, 1 seed, q 2%% and 10%%")
    ap.add_argument("--summarize", action="store_true", help="only rewrite .md/.png from the .json")
    lp = ap.add_argument_group("teacher rows (--lpub-kd): l_pub matching and KD at one q")
    lp.add_argument("--lpub-kd", action="store_true",
                    help="run none, l_priv matching, l_pub matching, KD and both at --lpub-q, with "
                         "l_pub scored on a candidate set and KD labels for selected records only; "
                         "writes public_pool_lpub_kd.{json,png} and a section of public_pool.md")
    lp.add_argument("--lpub-q", type=float, default=0.02)
    lp.add_argument("--lpub-steps", type=int, default=144)
    lp.add_argument("--candidates", type=float, default=0.04,
                    help="l_pub is scored on the union over seeds of this top fraction by l_priv")
    lp.add_argument("--match-beta", type=float, default=0.5, help="weight of l_priv in h")
    lp.add_argument("--kd-beta", type=float, default=0.1)
    lp.add_argument("--check-sample", type=int, default=0,
                    help="also score this many random non-candidates (after the arms) to estimate "
                         "how many records the candidate cut keeps out of the l_pub selection")
    args = ap.parse_args()
    if args.lpub_kd:
        if args.out == HERE / "public_pool.json":
            args.out = HERE / "public_pool_lpub_kd.json"
        if args.work == Path("/tmp/dpfleet-public-pool"):
            args.work = Path("/tmp/dpfleet-public-pool-lpub-kd")
        if args.quick:  # smoke run: its own folder, report beside its json
            args.lpub_steps, args.candidates = 8, 0.1
            args.work = args.work.with_name(args.work.name + "-quick")
            args.out = args.work / "public_pool_lpub_kd.json"
            args.work.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.pool, args.rounds, args.seeds, args.q = [500, 400, 100], 10, args.seeds[:1], [0.02, 0.1]
        if not args.lpub_kd:
            args.work = args.work.with_name(args.work.name + "-quick")
        args.eval_examples = 300
        if args.out == HERE / "public_pool.json":
            args.out = args.work / "public_pool.json"
            args.work.mkdir(parents=True, exist_ok=True)
    if args.lpub_kd:
        if args.summarize:
            return write_lpub_report(json.loads(args.out.read_text()), args.out)
        return run_lpub_kd(args)
    if args.summarize:
        return write_report(json.loads(args.out.with_suffix(".json").read_text()), args.out)
    start = time.perf_counter()
    results = run_grid(args)
    save(args, results, partial=len(results) < len(arms(args)) * len(args.seeds))
    payload = json.loads(args.out.with_suffix(".json").read_text())
    if not args.collect:
        payload["wall_seconds"] = time.perf_counter() - start
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=float))
    write_report(payload, args.out)


if __name__ == "__main__":
    main()
